"""Issuer keys, an issuer directory file and a policy listing them: what a gateway demanding tokens needs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from issuer.keys import add_key
from ohttp.privacypass import DirectoryKey, IssuerDirectory, IssuerKey, encode_directory
from policy import load_policy, shipped_policy_path
from tests.test_gateway_support import SimEvidence

ISSUER_NAME = "issuer.veil.test"


def make_keys(folder: Path, count: int) -> list[IssuerKey]:
    return [add_key(folder, 1_000 + index) for index in range(count)]


def write_directory(path: Path, keys: list[IssuerKey]) -> Path:
    """A directory listing every key in `keys` (the gateway must ignore those the policy does not list)."""
    listed = tuple(DirectoryKey(key.token_key, 1_000 + index) for index, key in enumerate(keys))
    path.write_bytes(encode_directory(IssuerDirectory(f"https://{ISSUER_NAME}/token-request", listed)))
    return path


def policy_listing(path: Path, keys: list[IssuerKey], issuer_name: str = ISSUER_NAME) -> Path:
    """The dev policy, with [authorization] naming `issuer_name` and `keys`."""
    text = shipped_policy_path("dev").read_text()
    ids = ", ".join(f'"{key.token_key.key_id.hex()}"' for key in keys)
    text = text.replace('issuer_name = ""', f'issuer_name = "{issuer_name}"').replace(
        "issuer_keys = []", f"issuer_keys = [{ids}]")
    path.write_text(text)
    return path


def node_evidence(policy_path: Path) -> SimEvidence:
    """Simulated node evidence measuring the policy at `policy_path` (the gateway verifies under it)."""
    evidence = SimEvidence()
    evidence.measurement = dataclasses.replace(evidence.measurement, policy_digest=load_policy(policy_path).digest)
    return evidence
