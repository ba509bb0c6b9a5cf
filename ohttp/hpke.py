"""HPKE (RFC 9180) in base mode, for Oblivious HTTP. The only module that touches pyhpke.

pyhpke is used (not pyca `cryptography`'s own HPKE) because OHTTP responses need
the HPKE secret exporter. Algorithms are looked up by their IANA identifiers:

- KEMs live in a registry keyed by `kem_id` (`kem_for`). Each entry knows its key
  and encapsulation sizes and sets up sender and recipient contexts. A hybrid
  post-quantum KEM (ML-KEM-768 + X25519) is added as another `Kem` entry of
  `_KEMS`; callers only ever pass identifiers and bytes, so they do not change.
- KDFs and AEADs are small records (`kdf_for`, `aead_for`) that OHTTP also uses
  directly to derive and apply its response keys.

Every failure that wire data can cause comes out as an `OHTTPError` subclass.
Nothing here stores, prints or puts key material into an error message.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, hmac
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDFExpand
from pyhpke import AEADId, CipherSuite, KDFId, KEMId, KEMKey, KEMKeyInterface, KEMKeyPair, PyHPKEError
from pyhpke import ContextInterface as _PyhpkeContext

from .errors import DecryptionError, MalformedError, UnsupportedSuiteError

KEM_X25519_HKDF_SHA256 = 0x0020
KDF_HKDF_SHA256 = 0x0001
AEAD_AES_128_GCM = 0x0001
AEAD_AES_256_GCM = 0x0002
AEAD_CHACHA20_POLY1305 = 0x0003


# --- KDF -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Kdf:
    """An HKDF variant: the plain Extract and Expand that OHTTP's response keys use."""

    kdf_id: int
    name: str
    hash_factory: Callable[[], hashes.HashAlgorithm]
    digest_length: int

    def extract(self, salt: bytes, ikm: bytes) -> bytes:
        """HKDF-Extract(salt, ikm)."""
        mac = hmac.HMAC(salt, self.hash_factory())
        mac.update(ikm)
        return mac.finalize()

    def expand(self, prk: bytes, info: bytes, length: int) -> bytes:
        """HKDF-Expand(prk, info, length)."""
        return HKDFExpand(self.hash_factory(), length, info).derive(prk)


_KDFS: dict[int, Kdf] = {
    KDF_HKDF_SHA256: Kdf(KDF_HKDF_SHA256, "HKDF-SHA256", hashes.SHA256, 32),
}


def kdf_for(kdf_id: int) -> Kdf:
    """The KDF with IANA identifier `kdf_id`; raises UnsupportedSuiteError if not implemented."""
    kdf = _KDFS.get(kdf_id)
    if kdf is None:
        raise UnsupportedSuiteError(f"KDF id 0x{kdf_id:04x} is not supported; use HKDF-SHA256 (0x0001)")
    return kdf


# --- AEAD ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AeadAlgorithm:
    """An AEAD's identifier and sizes (Nk, Nn, Nt in RFC 9180 terms)."""

    aead_id: int
    name: str
    key_length: int
    nonce_length: int
    tag_length: int
    cipher_factory: Callable[[bytes], AESGCM | ChaCha20Poly1305]

    def key(self, key: bytes) -> AeadKey:
        """An AEAD key ready to seal and open under explicit nonces."""
        return AeadKey(self, key)


_AEADS: dict[int, AeadAlgorithm] = {
    AEAD_AES_128_GCM: AeadAlgorithm(AEAD_AES_128_GCM, "AES-128-GCM", 16, 12, 16, AESGCM),
    AEAD_AES_256_GCM: AeadAlgorithm(AEAD_AES_256_GCM, "AES-256-GCM", 32, 12, 16, AESGCM),
    AEAD_CHACHA20_POLY1305: AeadAlgorithm(
        AEAD_CHACHA20_POLY1305, "ChaCha20-Poly1305", 32, 12, 16, ChaCha20Poly1305
    ),
}


def aead_for(aead_id: int) -> AeadAlgorithm:
    """The AEAD with IANA identifier `aead_id`; raises UnsupportedSuiteError if not implemented."""
    aead = _AEADS.get(aead_id)
    if aead is None:
        raise UnsupportedSuiteError(
            f"AEAD id 0x{aead_id:04x} is not supported; use AES-128-GCM, AES-256-GCM or ChaCha20-Poly1305"
        )
    return aead


class AeadKey:
    """A symmetric AEAD key with explicit nonces (OHTTP response protection)."""

    __slots__ = ("algorithm", "_cipher")

    def __init__(self, algorithm: AeadAlgorithm, key: bytes) -> None:
        if len(key) != algorithm.key_length:
            raise ValueError(f"{algorithm.name} needs a {algorithm.key_length}-byte key")
        self.algorithm = algorithm
        self._cipher = algorithm.cipher_factory(key)

    def __repr__(self) -> str:
        return f"AeadKey({self.algorithm.name})"

    def seal(self, nonce: bytes, plaintext: bytes, aad: bytes = b"") -> bytes:
        """Encrypt and authenticate `plaintext`."""
        return self._cipher.encrypt(nonce, plaintext, aad)

    def open(self, nonce: bytes, ciphertext: bytes, aad: bytes = b"") -> bytes:
        """Authenticate and decrypt; raises DecryptionError if anything was altered."""
        try:
            return self._cipher.decrypt(nonce, ciphertext, aad)
        except InvalidTag:
            raise DecryptionError(
                "response authentication failed: it was altered, reordered or sealed for another request"
            ) from None


# --- Private keys and contexts ---------------------------------------------------------


class PrivateKey:
    """A KEM private key (with its public half) held in memory. Never shown, pickled or exported."""

    __slots__ = ("kem_id", "_keypair")

    def __init__(self, kem_id: int, key: KEMKeyPair) -> None:
        self.kem_id = kem_id
        self._keypair = key

    def __repr__(self) -> str:
        return f"PrivateKey(kem_id=0x{self.kem_id:04x}, <redacted>)"

    def __reduce__(self) -> object:
        raise TypeError("private keys never leave memory; they cannot be pickled or copied")


class SenderContext:
    """The client's HPKE context: seals request data in sequence and exports secrets."""

    __slots__ = ("_ctx",)

    def __init__(self, ctx: _PyhpkeContext) -> None:
        self._ctx = ctx

    def seal(self, plaintext: bytes, aad: bytes = b"") -> bytes:
        """Seal the next message of the sequence."""
        return self._ctx.seal(plaintext, aad)

    def export(self, exporter_context: bytes, length: int) -> bytes:
        """HPKE Export(exporter_context, length)."""
        return self._ctx.export(exporter_context, length)


class RecipientContext:
    """The gateway's HPKE context: opens request data in sequence and exports secrets.

    After one failed open the context refuses further use, since its sequence
    number has moved past the message that failed.
    """

    __slots__ = ("_ctx", "_failed")

    def __init__(self, ctx: _PyhpkeContext) -> None:
        self._ctx = ctx
        self._failed = False

    def open(self, ciphertext: bytes, aad: bytes = b"") -> bytes:
        """Open the next message of the sequence; raises DecryptionError on any alteration."""
        if self._failed:
            raise DecryptionError("an earlier message of this request failed to open; discard the request")
        try:
            return self._ctx.open(ciphertext, aad)
        except PyHPKEError:
            self._failed = True
            raise DecryptionError(
                "request authentication failed: it was altered, reordered or sealed to another key"
            ) from None

    def export(self, exporter_context: bytes, length: int) -> bytes:
        """HPKE Export(exporter_context, length)."""
        return self._ctx.export(exporter_context, length)


# --- KEMs ------------------------------------------------------------------------------


class Kem(ABC):
    """A key encapsulation mechanism, with the HPKE context setup built on it."""

    kem_id: int
    name: str
    public_key_length: int  # Npk
    enc_length: int  # Nenc
    private_key_length: int  # Nsk

    @abstractmethod
    def generate_private_key(self) -> PrivateKey:
        """A fresh random private key."""

    @abstractmethod
    def private_key_from_bytes(self, data: bytes) -> PrivateKey:
        """Load a serialized private key (raises MalformedError if it is not one)."""

    @abstractmethod
    def public_key_bytes(self, private_key: PrivateKey) -> bytes:
        """The serialized public key matching `private_key`."""

    @abstractmethod
    def setup_sender(
        self,
        public_key: bytes,
        kdf_id: int,
        aead_id: int,
        info: bytes,
        ephemeral_private_key: PrivateKey | None = None,
    ) -> tuple[bytes, SenderContext]:
        """SetupBaseS: return (enc, context). `ephemeral_private_key` is for test vectors only."""

    @abstractmethod
    def setup_recipient(
        self, private_key: PrivateKey, enc: bytes, kdf_id: int, aead_id: int, info: bytes
    ) -> RecipientContext:
        """SetupBaseR: raises DecryptionError if `enc` cannot be decapsulated."""


class PyhpkeKem(Kem):
    """A DHKEM that pyhpke implements natively (X25519 is the one registered by default)."""

    def __init__(self, kem_id: int, name: str, public_key_length: int, private_key_length: int) -> None:
        self.kem_id = kem_id
        self.name = name
        self.public_key_length = public_key_length
        self.enc_length = public_key_length  # a DHKEM's enc is the ephemeral public key
        self.private_key_length = private_key_length

    def generate_private_key(self) -> PrivateKey:
        # RFC 9180 DeriveKeyPair over fresh randomness at least Nsk bytes long.
        keypair = self._suite().kem.derive_key_pair(os.urandom(self.private_key_length))
        return PrivateKey(self.kem_id, keypair)

    def private_key_from_bytes(self, data: bytes) -> PrivateKey:
        if len(data) != self.private_key_length:
            raise MalformedError(f"a {self.name} private key must be {self.private_key_length} bytes")
        try:
            secret = self._suite().kem.deserialize_private_key(bytes(data))
            public = KEMKey.from_pyca_cryptography_key(secret.raw.public_key())
        except (ValueError, PyHPKEError):
            raise MalformedError(f"the bytes are not a valid {self.name} private key") from None
        return PrivateKey(self.kem_id, KEMKeyPair(secret, public))

    def public_key_bytes(self, private_key: PrivateKey) -> bytes:
        self._check_owner(private_key)
        return private_key._keypair.public_key.to_public_bytes()

    def setup_sender(
        self,
        public_key: bytes,
        kdf_id: int,
        aead_id: int,
        info: bytes,
        ephemeral_private_key: PrivateKey | None = None,
    ) -> tuple[bytes, SenderContext]:
        suite = _cipher_suite(self.kem_id, kdf_id, aead_id)
        recipient_key = self._public_key(suite, public_key)
        ephemeral = None
        if ephemeral_private_key is not None:
            self._check_owner(ephemeral_private_key)
            ephemeral = ephemeral_private_key._keypair
        try:
            enc, ctx = suite.create_sender_context(recipient_key, info, eks=ephemeral)
        except (ValueError, PyHPKEError):
            # X25519 refuses low-order public keys (all-zero shared secret).
            raise MalformedError("the key configuration's public key is not usable; fetch fresh keys") from None
        return enc, SenderContext(ctx)

    def setup_recipient(
        self, private_key: PrivateKey, enc: bytes, kdf_id: int, aead_id: int, info: bytes
    ) -> RecipientContext:
        self._check_owner(private_key)
        if len(enc) != self.enc_length:
            raise MalformedError(f"the encapsulated key must be {self.enc_length} bytes for {self.name}")
        suite = _cipher_suite(self.kem_id, kdf_id, aead_id)
        try:
            ctx = suite.create_recipient_context(bytes(enc), private_key._keypair.private_key, info)
        except (ValueError, PyHPKEError):
            raise DecryptionError("the encapsulated key cannot be decapsulated; discard the request") from None
        return RecipientContext(ctx)

    def _suite(self) -> CipherSuite:
        return _cipher_suite(self.kem_id, KDF_HKDF_SHA256, AEAD_AES_128_GCM)

    def _public_key(self, suite: CipherSuite, public_key: bytes) -> KEMKeyInterface:
        if len(public_key) != self.public_key_length:
            raise MalformedError(f"a {self.name} public key must be {self.public_key_length} bytes")
        try:
            return suite.kem.deserialize_public_key(bytes(public_key))
        except (ValueError, PyHPKEError):
            raise MalformedError(f"the bytes are not a valid {self.name} public key") from None

    def _check_owner(self, private_key: PrivateKey) -> None:
        if private_key.kem_id != self.kem_id:
            raise ValueError(f"the private key belongs to KEM 0x{private_key.kem_id:04x}, not {self.name}")


@lru_cache(maxsize=None)
def _cipher_suite(kem_id: int, kdf_id: int, aead_id: int) -> CipherSuite:
    """pyhpke's stateless suite object; checks the KDF and AEAD first so errors stay ours."""
    kdf_for(kdf_id)
    aead_for(aead_id)
    return CipherSuite.new(KEMId(kem_id), KDFId(kdf_id), AEADId(aead_id))


_KEMS: dict[int, Kem] = {
    KEM_X25519_HKDF_SHA256: PyhpkeKem(KEM_X25519_HKDF_SHA256, "DHKEM(X25519, HKDF-SHA256)", 32, 32),
}


def kem_for(kem_id: int) -> Kem:
    """The KEM with IANA identifier `kem_id`; raises UnsupportedSuiteError if not implemented."""
    kem = _KEMS.get(kem_id)
    if kem is None:
        raise UnsupportedSuiteError(
            f"KEM id 0x{kem_id:04x} is not supported; use DHKEM(X25519, HKDF-SHA256) (0x0020)"
        )
    return kem


def is_supported_suite(kdf_id: int, aead_id: int) -> bool:
    """Whether this package implements the symmetric pair (kdf_id, aead_id)."""
    return kdf_id in _KDFS and aead_id in _AEADS
