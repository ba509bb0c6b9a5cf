"""How one OHTTP key configuration and one receipt key are tied to both the CPU and the GPU report.

    freshness   = len8(nonce) ‖ nonce ‖ uint64_be(timestamp) ‖ len16(state) ‖ state
    report_data = SHA-512("veil-attest-v2" ‖ len16(key_config) ‖ key_config ‖ receipt_key
                          ‖ measurement.digest() ‖ freshness)          (64 bytes, CPU report)
    gpu_nonce   = SHA-256(report_data)                                  (32 bytes, GPU report)

`receipt_key` is the node's Ed25519 public key (32 raw bytes) that signs its answers' receipts
(`attestation.receipts`): bound here, a receipt under it is the attested code's word.
`state` is the GPU confidential-computing state the node observed while
collecting (environment, CC feature, developer tools), so that it cannot be
edited after the fact. Length prefixes (and the receipt key's fixed size) keep the
concatenation unambiguous.
"""

from __future__ import annotations

import hashlib
import struct

from attestation.measurement import Measurement

ATTEST_TAG = b"veil-attest-v2"
NONCE_SIZE = 32
RECEIPT_KEY_SIZE = 32  # an Ed25519 public key
REPORT_DATA_SIZE = 64


def freshness_bytes(nonce: bytes, timestamp: int, state: bytes) -> bytes:
    """The freshness component: the verifier's nonce, the collection time and the observed GPU state."""
    if len(nonce) != NONCE_SIZE:
        raise ValueError(f"a freshness nonce is {NONCE_SIZE} bytes")
    return struct.pack(">B", len(nonce)) + nonce + struct.pack(">QH", timestamp, len(state)) + state


def report_data(key_config: bytes, receipt_key: bytes, measurement: Measurement, freshness: bytes) -> bytes:
    """The 64 bytes a CPU TEE report carries."""
    if len(key_config) > 0xFFFF:
        raise ValueError("a key configuration is at most 65535 bytes")
    if len(receipt_key) != RECEIPT_KEY_SIZE:
        raise ValueError(f"a receipt key is {RECEIPT_KEY_SIZE} bytes (an Ed25519 public key)")
    material = (ATTEST_TAG + struct.pack(">H", len(key_config)) + key_config + receipt_key
                + measurement.digest() + freshness)
    return hashlib.sha512(material).digest()


def gpu_nonce(report_data_value: bytes) -> bytes:
    """The 32-byte nonce the GPU attestation report is requested with."""
    return hashlib.sha256(report_data_value).digest()
