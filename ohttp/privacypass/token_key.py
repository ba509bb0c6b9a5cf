"""Issuer public keys for token type 2 (RFC 9578 §6.5): SPKI with the RSASSA-PSS OID, and token_key_id.

token_key_id is SHA-256 of the SPKI bytes exactly as the issuer publishes them.
`cryptography` reads such a key but writes it back as an rsaEncryption SPKI,
whose hash differs, so a `TokenKey` keeps the published bytes and derives the
id from them; a key is accepted only if those bytes are the canonical encoding
this module writes, so one key has one id.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from .errors import MalformedError

TOKEN_KEY_BITS = 2048
TOKEN_KEY_ID_LENGTH = 32

# AlgorithmIdentifier { id-RSASSA-PSS, RSASSA-PSS-params { SHA-384, MGF1(SHA-384), saltLength 48 } }
_PSS_SHA384_ALGORITHM = bytes.fromhex(
    "303d06092a864886f70d01010a3030a00d300b0609608648016503040202a11a3018"
    "06092a864886f70d010108300b0609608648016503040202a203020130"
)


@dataclass(frozen=True, slots=True)
class TokenKey:
    """An issuer's public key as published: the SPKI bytes, the key they hold and their id."""

    spki: bytes = field(repr=False)
    public_key: rsa.RSAPublicKey = field(repr=False, compare=False)
    key_id: bytes

    @property
    def truncated_key_id(self) -> int:
        """The last byte of the key id, as a TokenRequest names its key."""
        return self.key_id[-1]


def token_key_from_public_key(public_key: rsa.RSAPublicKey) -> TokenKey:
    """The token key for an RSA public key, encoded with the RSASSA-PSS OID."""
    spki = encode_pss_spki(public_key)
    return TokenKey(spki=spki, public_key=public_key, key_id=hashlib.sha256(spki).digest())


def decode_token_key(spki: bytes) -> TokenKey:
    """Read a published SPKI; refuse anything but a canonical 2048-bit RSASSA-PSS (SHA-384) key."""
    try:
        public_key = serialization.load_der_public_key(spki)
    except (ValueError, TypeError):
        raise MalformedError("the token key is not a DER SubjectPublicKeyInfo") from None
    if not isinstance(public_key, rsa.RSAPublicKey) or public_key.key_size != TOKEN_KEY_BITS:
        raise MalformedError("a token type 2 key must be a 2048-bit RSA key")
    if encode_pss_spki(public_key) != spki:
        raise MalformedError("the token key must use the RSASSA-PSS OID with SHA-384, MGF1-SHA-384, salt 48")
    return TokenKey(spki=spki, public_key=public_key, key_id=hashlib.sha256(spki).digest())


def encode_pss_spki(public_key: rsa.RSAPublicKey) -> bytes:
    """SubjectPublicKeyInfo { RSASSA-PSS parameters, BIT STRING { RSAPublicKey } } in DER."""
    rsa_public_key = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.PKCS1)
    bit_string = b"\x03" + _der_length(len(rsa_public_key) + 1) + b"\x00" + rsa_public_key
    body = _PSS_SHA384_ALGORITHM + bit_string
    return b"\x30" + _der_length(len(body)) + body


def _der_length(length: int) -> bytes:
    if length < 0x80:
        return bytes([length])
    encoded = length.to_bytes((length.bit_length() + 7) // 8, "big")
    return bytes([0x80 | len(encoded)]) + encoded
