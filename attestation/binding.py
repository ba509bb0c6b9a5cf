"""How one OHTTP key configuration is tied to both the CPU and the GPU report.

    freshness   = len8(nonce) ‖ nonce ‖ uint64_be(timestamp) ‖ len16(state) ‖ state
    report_data = SHA-512("veil-attest-v1" ‖ len16(key_config) ‖ key_config
                          ‖ measurement.digest() ‖ freshness)          (64 bytes, CPU report)
    gpu_nonce   = SHA-256(report_data)                                  (32 bytes, GPU report)

`state` is the GPU confidential-computing state the node observed while
collecting (environment, CC feature, developer tools), so that it cannot be
edited after the fact. Length prefixes keep the concatenation unambiguous.
"""

from __future__ import annotations

import hashlib
import struct

from attestation.measurement import Measurement

ATTEST_TAG = b"veil-attest-v1"
NONCE_SIZE = 32
REPORT_DATA_SIZE = 64


def freshness_bytes(nonce: bytes, timestamp: int, state: bytes) -> bytes:
    """The freshness component: the verifier's nonce, the collection time and the observed GPU state."""
    if len(nonce) != NONCE_SIZE:
        raise ValueError(f"a freshness nonce is {NONCE_SIZE} bytes")
    return struct.pack(">B", len(nonce)) + nonce + struct.pack(">QH", timestamp, len(state)) + state


def report_data(key_config: bytes, measurement: Measurement, freshness: bytes) -> bytes:
    """The 64 bytes a CPU TEE report carries."""
    if len(key_config) > 0xFFFF:
        raise ValueError("a key configuration is at most 65535 bytes")
    material = ATTEST_TAG + struct.pack(">H", len(key_config)) + key_config + measurement.digest() + freshness
    return hashlib.sha512(material).digest()


def gpu_nonce(report_data_value: bytes) -> bytes:
    """The 32-byte nonce the GPU attestation report is requested with."""
    return hashlib.sha256(report_data_value).digest()
