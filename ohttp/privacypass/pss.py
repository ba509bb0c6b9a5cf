"""EMSA-PSS-ENCODE (RFC 8017 §9.1.1) with SHA-384 and MGF1-SHA-384, and the integer conversions.

Blind RSA needs the encoded message itself, which `cryptography` does not expose:
it only signs and verifies. The final signature is still checked by
`cryptography`'s own PSS verifier (see `blind_rsa.finalize`), so an encoding
mistake here shows up as a refused signature, never as an accepted forgery.
"""

from __future__ import annotations

import hashlib
import os

from .errors import BlindingError

HASH_LENGTH = 48  # SHA-384


def i2osp(value: int, length: int) -> bytes:
    """Integer to a big-endian octet string of exactly `length` bytes (RFC 8017 §4.1)."""
    return value.to_bytes(length, "big")


def os2ip(data: bytes) -> int:
    """Big-endian octet string to a non-negative integer (RFC 8017 §4.2)."""
    return int.from_bytes(data, "big")


def mgf1_sha384(seed: bytes, mask_length: int) -> bytes:
    """MGF1 (RFC 8017 §B.2.1) with SHA-384."""
    blocks = (mask_length + HASH_LENGTH - 1) // HASH_LENGTH
    mask = b"".join(hashlib.sha384(seed + i2osp(counter, 4)).digest() for counter in range(blocks))
    return mask[:mask_length]


def emsa_pss_encode(message: bytes, em_bits: int, salt_length: int, *, salt: bytes | None = None) -> bytes:
    """EM for `message` with a fresh random salt (or the given one, for published vectors)."""
    em_length = (em_bits + 7) // 8
    if em_length < HASH_LENGTH + salt_length + 2:
        raise BlindingError("the RSA modulus is too small for PSS with SHA-384: use a key of at least 2048 bits")
    if salt is None:
        salt = os.urandom(salt_length)
    if len(salt) != salt_length:
        raise ValueError(f"the PSS salt must be {salt_length} bytes")
    message_hash = hashlib.sha384(message).digest()
    h = hashlib.sha384(b"\x00" * 8 + message_hash + salt).digest()
    padding = b"\x00" * (em_length - salt_length - HASH_LENGTH - 2)
    db = padding + b"\x01" + salt
    masked_db = bytearray(a ^ b for a, b in zip(db, mgf1_sha384(h, em_length - HASH_LENGTH - 1), strict=True))
    # The bits above em_bits are cleared so that EM, read as an integer, is below the modulus.
    masked_db[0] &= 0xFF >> (8 * em_length - em_bits)
    return bytes(masked_db) + h + b"\xbc"
