"""Steps of RFC 9458 section 4 shared by whole (message.py) and chunked (chunked.py) messages.

    Encapsulated Request {
      Key Identifier (8), HPKE KEM ID (16), HPKE KDF ID (16), HPKE AEAD ID (16),
      Encapsulated KEM Shared Secret (8 * Nenc),
      HPKE-Protected Request (..),
    }

The HPKE info string is `label || 0x00 || header`; the response key is derived
from an HPKE export under a response label, salted with `enc || response_nonce`.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

from . import hpke
from .errors import MalformedError, UnsupportedSuiteError
from .keys import KeyConfig, KeyPair, KeyRing, SymmetricSuite

REQUEST_HEADER_LENGTH = 7


@dataclass(frozen=True, slots=True)
class RequestHeader:
    """The algorithm identifiers that open an encapsulated request."""

    key_id: int
    kem_id: int
    kdf_id: int
    aead_id: int

    def encode(self) -> bytes:
        """The 7-byte wire form."""
        return struct.pack(">BHHH", self.key_id, self.kem_id, self.kdf_id, self.aead_id)

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> RequestHeader:
        """Parse the first 7 bytes of `data` (MalformedError if shorter)."""
        if len(data) < REQUEST_HEADER_LENGTH:
            raise MalformedError("an encapsulated request starts with a 7-byte header; it is cut short")
        return cls(*struct.unpack_from(">BHHH", data))

    @property
    def suite(self) -> SymmetricSuite:
        """The symmetric suite the request was sealed with."""
        return SymmetricSuite(self.kdf_id, self.aead_id)

    def hpke_info(self, label: bytes) -> bytes:
        """The HPKE info string binding the label and this header."""
        return label + b"\x00" + self.encode()


@dataclass(frozen=True, slots=True)
class ClientSetup:
    """What the client keeps after sealing the request header: the context and its inputs."""

    prefix: bytes  # header || enc: the first bytes on the wire
    enc: bytes
    suite: SymmetricSuite
    context: hpke.SenderContext


@dataclass(frozen=True, slots=True)
class GatewaySetup:
    """What the gateway has after opening the request header."""

    header: RequestHeader
    enc: bytes
    context: hpke.RecipientContext


def choose_suite(config: KeyConfig, suite: SymmetricSuite | None) -> SymmetricSuite:
    """`suite` if the configuration offers it and it is implemented, else the first usable one."""
    if suite is None:
        usable = config.supported_suites()
        if not usable:
            raise UnsupportedSuiteError("the key configuration offers no symmetric suite this package implements")
        return usable[0]
    if suite not in config.suites or not suite.is_supported:
        raise UnsupportedSuiteError("the requested symmetric suite is not offered by the key configuration")
    return suite


def client_setup(
    config: KeyConfig,
    suite: SymmetricSuite | None,
    label: bytes,
    ephemeral_private_key: bytes | None,
) -> ClientSetup:
    """Encapsulate to `config`: a fresh HPKE context (fixed ephemeral key only in tests)."""
    chosen = choose_suite(config, suite)
    kem = hpke.kem_for(config.kem_id)
    header = RequestHeader(config.key_id, config.kem_id, chosen.kdf_id, chosen.aead_id)
    ephemeral = None if ephemeral_private_key is None else kem.private_key_from_bytes(ephemeral_private_key)
    enc, context = kem.setup_sender(
        config.public_key, chosen.kdf_id, chosen.aead_id, header.hpke_info(label), ephemeral
    )
    return ClientSetup(header.encode() + enc, enc, chosen, context)


def gateway_key(keyring: KeyRing, header: RequestHeader) -> KeyPair:
    """The key pair the header names, after checking it accepts the header's algorithms."""
    pair = keyring.lookup(header.key_id)
    if header.kem_id != pair.config.kem_id:
        raise UnsupportedSuiteError("the request's KEM does not match the key it names; fetch fresh keys")
    if header.suite not in pair.config.suites or not header.suite.is_supported:
        raise UnsupportedSuiteError("the request's symmetric suite is not accepted by the key it names")
    return pair


def enc_length(kem_id: int) -> int:
    """Nenc of the KEM `kem_id`."""
    return hpke.kem_for(kem_id).enc_length


def gateway_setup(pair: KeyPair, header: RequestHeader, enc: bytes, label: bytes) -> GatewaySetup:
    """Decapsulate `enc` with the named key: a fresh HPKE context per request."""
    kem = hpke.kem_for(header.kem_id)
    context = kem.setup_recipient(pair.private_key, enc, header.kdf_id, header.aead_id, header.hpke_info(label))
    return GatewaySetup(header, bytes(enc), context)


def response_nonce_length(suite: SymmetricSuite) -> int:
    """max(Nn, Nk): the size of the response nonce and of the exported secret."""
    aead = hpke.aead_for(suite.aead_id)
    return max(aead.nonce_length, aead.key_length)


def fresh_response_nonce(suite: SymmetricSuite, nonce_for_tests: bytes | None) -> bytes:
    """A random response nonce (or the fixed one a test vector needs)."""
    length = response_nonce_length(suite)
    if nonce_for_tests is None:
        return os.urandom(length)
    if len(nonce_for_tests) != length:
        raise ValueError(f"the response nonce must be {length} bytes for this suite")
    return bytes(nonce_for_tests)


@dataclass(frozen=True, slots=True)
class ResponseKey:
    """The AEAD key and base nonce protecting one response."""

    key: hpke.AeadKey
    nonce: bytes


def derive_response_key(
    context: hpke.SenderContext | hpke.RecipientContext,
    suite: SymmetricSuite,
    enc: bytes,
    response_nonce: bytes,
    label: bytes,
) -> ResponseKey:
    """RFC 9458 section 4.4: export, extract with salt enc || nonce, expand to key and nonce."""
    aead = hpke.aead_for(suite.aead_id)
    kdf = hpke.kdf_for(suite.kdf_id)
    secret = context.export(label, max(aead.nonce_length, aead.key_length))
    prk = kdf.extract(enc + response_nonce, secret)
    key = kdf.expand(prk, b"key", aead.key_length)
    nonce = kdf.expand(prk, b"nonce", aead.nonce_length)
    return ResponseKey(aead.key(key), nonce)
