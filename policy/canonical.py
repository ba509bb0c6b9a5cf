"""Canonical encoding of a policy, so that its digest names its meaning, not its formatting.

The encoding is compact JSON with sorted keys, every key present (defaults
filled in) and every set-like list sorted, prefixed by a format tag. Comments,
whitespace, key order, TOML syntax variants and list order therefore do not
change the digest; any change of a value does.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from policy.model import Policy

CANONICAL_FORMAT = "veil-policy-v1"


def section_dict(section: object) -> dict[str, Any]:
    """A section dataclass as a plain dict with tuples as lists."""
    return {
        field.name: _plain(getattr(section, field.name))
        for field in dataclasses.fields(section)  # type: ignore[arg-type]
    }


def canonical_encoding(policy: Policy) -> bytes:
    """The bytes the policy digest is taken over."""
    document = {
        "format": CANONICAL_FORMAT,
        "name": policy.name,
        "attestation": section_dict(policy.attestation),
        "engine": section_dict(policy.engine),
        "routing": section_dict(policy.routing),
        "audit": section_dict(policy.audit),
        "authorization": section_dict(policy.authorization),
        "transparency": section_dict(policy.transparency),
    }
    text = json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return text.encode("ascii")


def digest_of(canonical: bytes) -> bytes:
    """SHA-256 of a canonical encoding."""
    return hashlib.sha256(canonical).digest()


def _plain(value: object) -> object:
    # Set-like tuples are kept sorted by the loader, so they encode as-is.
    if isinstance(value, tuple):
        return [_plain(item) for item in value]
    if dataclasses.is_dataclass(value):
        return section_dict(value)
    return value
