"""Strict JSON and base64 helpers for evidence: duplicates, unknown fields and bad padding are errors."""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

from attestation.errors import EvidenceFormatError


def b64encode(data: bytes) -> str:
    """Standard base64 with padding."""
    return base64.b64encode(data).decode("ascii")


def b64decode(text: Any, where: str, *, length: int | None = None) -> bytes:
    """Decode standard padded base64; enforce `length` when given."""
    if not isinstance(text, str):
        raise EvidenceFormatError(f"{where} must be a base64 string")
    try:
        data = base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError):
        raise EvidenceFormatError(f"{where} is not valid padded base64 (truncated or corrupted)") from None
    if b64encode(data) != text:
        raise EvidenceFormatError(f"{where} is not canonical base64")
    if length is not None and len(data) != length:
        raise EvidenceFormatError(f"{where} must decode to {length} bytes (truncated or padded)")
    return data


def loads_strict(text: str | bytes) -> Any:
    """Parse JSON, refusing duplicated keys and non-finite numbers."""
    try:
        return json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_refuse_constant)
    except EvidenceFormatError:
        raise
    except (ValueError, TypeError, RecursionError):
        raise EvidenceFormatError("evidence is not valid JSON") from None


def expect_object(value: Any, where: str, keys: set[str], optional: set[str] = frozenset()) -> dict[str, Any]:
    """Require a JSON object with exactly `keys` (plus any of `optional`)."""
    if not isinstance(value, dict):
        raise EvidenceFormatError(f"{where} must be a JSON object")
    missing = keys - value.keys()
    unknown = value.keys() - keys - optional
    if missing:
        raise EvidenceFormatError(f"{where} lacks field(s) {sorted(missing)}")
    if unknown:
        raise EvidenceFormatError(f"{where} has unknown field(s) {sorted(unknown)[:5]}")
    return value


def expect_int(value: Any, where: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise EvidenceFormatError(f"{where} must be an integer from {low} to {high}")
    return value


def expect_choice(value: Any, where: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise EvidenceFormatError(f"{where} must be one of {list(allowed)}")
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise EvidenceFormatError("evidence JSON has a duplicated field; each field must appear once")
        result[key] = value
    return result


def _refuse_constant(name: str) -> Any:
    raise EvidenceFormatError("evidence JSON holds a non-finite number")
