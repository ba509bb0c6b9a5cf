"""The interface every evidence backend implements, and the steps they share."""

from __future__ import annotations

import time
from typing import Protocol, runtime_checkable

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, utils

from attestation.binding import NONCE_SIZE, freshness_bytes, report_data
from attestation.bundle import EvidenceBundle
from attestation.errors import BackendError
from attestation.measurement import Measurement


@runtime_checkable
class AttestationBackend(Protocol):
    """Produces evidence bundles for this node."""

    name: str

    def collect(self, key_config: bytes, measurement: Measurement, nonce: bytes, receipt_key: bytes) -> EvidenceBundle:
        """Evidence binding `key_config`, `receipt_key` and `measurement`, answering `nonce` (32 bytes)."""
        ...


def check_nonce(nonce: bytes) -> None:
    if len(nonce) != NONCE_SIZE:
        raise BackendError(f"the freshness nonce must be {NONCE_SIZE} bytes")


def now_seconds() -> int:
    return int(time.time())


def bind(key_config: bytes, receipt_key: bytes, measurement: Measurement, nonce: bytes, timestamp: int,
         state: bytes) -> bytes:
    """The report_data for these inputs (see attestation.binding)."""
    return report_data(key_config, receipt_key, measurement, freshness_bytes(nonce, timestamp, state))


def sign_raw_p384(private_key: ec.EllipticCurvePrivateKey, data: bytes) -> bytes:
    """ECDSA P-384 / SHA-384 signature as raw r ‖ s (96 bytes), the SPDM encoding."""
    r, s = utils.decode_dss_signature(private_key.sign(data, ec.ECDSA(hashes.SHA384())))
    return r.to_bytes(48, "big") + s.to_bytes(48, "big")


__all__ = ["AttestationBackend", "EvidenceBundle", "bind", "check_nonce", "now_seconds", "sign_raw_p384"]
