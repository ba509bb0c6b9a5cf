"""Shared fixtures and helpers for the attestation tests (no tests of its own)."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from attestation.backends.sim import SimBackend
from attestation.bundle import EvidenceBundle
from attestation.measurement import Measurement, measure_code, measure_model
from attestation.receipts import ReceiptSigner
from ohttp.keys import generate_key_pair
from policy import Policy, parse_policy, shipped_policy, shipped_policy_path

NONCE = bytes(range(32))
# A receipt key to bind into evidence that answers no request, so signs nothing.
RECEIPT_KEY = ReceiptSigner.generate().public_key


@pytest.fixture(autouse=True)
def sim_root_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own simulated root, so nothing leaks between runs."""
    directory = tmp_path / "sim-root"
    monkeypatch.setenv("VEIL_SIM_ROOT_DIR", str(directory))
    return directory


@pytest.fixture(scope="session")
def code_digest() -> bytes:
    return measure_code(("attestation", "policy", "ohttp"))


def measurement_for(policy: Policy, code: bytes) -> Measurement:
    return Measurement(code_digest=code, policy_digest=policy.digest, model_digest=measure_model(None))


def key_config() -> bytes:
    return generate_key_pair(7).config.encode()


def dev_policy() -> Policy:
    return shipped_policy("dev")


def dev_variant(old: str, new: str) -> Policy:
    text = shipped_policy_path("dev").read_text()
    assert old in text
    return parse_policy(text.replace(old, new))


def collect(backend: SimBackend, policy: Policy, code: bytes, *, config: bytes | None = None, nonce: bytes = NONCE) -> EvidenceBundle:
    return backend.collect(config if config is not None else key_config(), measurement_for(policy, code), nonce,
                           RECEIPT_KEY)


def edit_json(bundle: EvidenceBundle, change) -> str:
    """Apply `change(document)` to the bundle's JSON form and return the new text."""
    document = json.loads(bundle.to_json())
    change(document)
    return json.dumps(document)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def unb64(text: str) -> bytes:
    return base64.b64decode(text)


def flip(data: bytes, index: int) -> bytes:
    return data[:index] + bytes([data[index] ^ 0x01]) + data[index + 1 :]
