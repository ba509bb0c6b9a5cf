"""OHTTP key configurations (RFC 9458 section 3), key pairs and the rotation key ring.

Wire format of one key configuration:

    Key Config {
      Key Identifier (8),
      HPKE KEM ID (16),
      HPKE Public Key (Npk * 8),
      HPKE Symmetric Algorithms Length (16) = 4..65532,
      HPKE Symmetric Algorithms (32) { KDF ID (16), AEAD ID (16) } ...,
    }

Veil publishes each node's configuration in its attested evidence, one at a
time, so no `application/ohttp-keys` list is served.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

from . import hpke
from .errors import MalformedError, UnknownKeyError, UnsupportedSuiteError

_MAX_SUITES = 65532 // 4


@dataclass(frozen=True, slots=True)
class SymmetricSuite:
    """An HPKE KDF and AEAD pair, by IANA identifier."""

    kdf_id: int
    aead_id: int

    def __post_init__(self) -> None:
        if not (0 <= self.kdf_id <= 0xFFFF and 0 <= self.aead_id <= 0xFFFF):
            raise ValueError("KDF and AEAD identifiers are 16-bit unsigned integers")

    @property
    def is_supported(self) -> bool:
        """Whether this package implements the pair."""
        return hpke.is_supported_suite(self.kdf_id, self.aead_id)


SUITE_AES_128_GCM = SymmetricSuite(hpke.KDF_HKDF_SHA256, hpke.AEAD_AES_128_GCM)
SUITE_AES_256_GCM = SymmetricSuite(hpke.KDF_HKDF_SHA256, hpke.AEAD_AES_256_GCM)
SUITE_CHACHA20_POLY1305 = SymmetricSuite(hpke.KDF_HKDF_SHA256, hpke.AEAD_CHACHA20_POLY1305)
DEFAULT_SUITES: tuple[SymmetricSuite, ...] = (SUITE_AES_128_GCM, SUITE_AES_256_GCM, SUITE_CHACHA20_POLY1305)
DEFAULT_KEM_ID = hpke.KEM_X25519_HKDF_SHA256


@dataclass(frozen=True, slots=True)
class KeyConfig:
    """One gateway public key with the symmetric suites it accepts, in order of preference."""

    key_id: int
    kem_id: int
    public_key: bytes
    suites: tuple[SymmetricSuite, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "public_key", bytes(self.public_key))
        object.__setattr__(self, "suites", tuple(self.suites))
        if not 0 <= self.key_id <= 0xFF:
            raise ValueError("a key identifier is one byte (0..255)")
        if not self.suites or len(self.suites) > _MAX_SUITES:
            raise ValueError(f"a key configuration lists 1..{_MAX_SUITES} symmetric suites")
        kem = hpke.kem_for(self.kem_id)
        if len(self.public_key) != kem.public_key_length:
            raise ValueError(f"a {kem.name} public key is {kem.public_key_length} bytes")

    def encode(self) -> bytes:
        """The RFC 9458 section 3.1 encoding."""
        suites = b"".join(struct.pack(">HH", s.kdf_id, s.aead_id) for s in self.suites)
        return struct.pack(">BH", self.key_id, self.kem_id) + self.public_key + struct.pack(">H", len(suites)) + suites

    @classmethod
    def decode(cls, data: bytes) -> KeyConfig:
        """Parse exactly one key configuration.

        Raises MalformedError for a bad layout (short, trailing bytes, wrong key
        length, empty or ragged suite list) and UnsupportedSuiteError for an
        unknown KEM or a configuration none of whose suites this package implements.
        """
        data = bytes(data)
        if len(data) < 3:
            raise MalformedError("a key configuration is at least 3 bytes; it is cut short")
        key_id, kem_id = struct.unpack_from(">BH", data)
        kem = hpke.kem_for(kem_id)
        suites_at = 3 + kem.public_key_length
        if len(data) < suites_at + 2:
            raise MalformedError(f"the key configuration is too short for a {kem.name} public key")
        (suites_length,) = struct.unpack_from(">H", data, suites_at)
        suites = _decode_suites(data[suites_at + 2 :], suites_length)
        if not any(suite.is_supported for suite in suites):
            raise UnsupportedSuiteError("the key configuration offers no symmetric suite this package implements")
        return cls(key_id, kem_id, data[3:suites_at], suites)

    def supported_suites(self) -> tuple[SymmetricSuite, ...]:
        """The offered suites this package implements, in the configuration's order."""
        return tuple(suite for suite in self.suites if suite.is_supported)


def _decode_suites(data: bytes, declared_length: int) -> tuple[SymmetricSuite, ...]:
    if declared_length == 0 or declared_length % 4:
        raise MalformedError("the symmetric suite list must be a non-empty multiple of 4 bytes")
    if len(data) != declared_length:
        raise MalformedError("the symmetric suite list length does not match the configuration's size")
    return tuple(SymmetricSuite(*struct.unpack_from(">HH", data, at)) for at in range(0, declared_length, 4))


class KeyPair:
    """A gateway key: its public configuration and its private key, held only in memory.

    The private key never appears in repr/str and the object cannot be pickled.
    """

    __slots__ = ("config", "_private_key")

    def __init__(self, config: KeyConfig, private_key: hpke.PrivateKey) -> None:
        kem = hpke.kem_for(config.kem_id)
        if private_key.kem_id != config.kem_id or kem.public_key_bytes(private_key) != config.public_key:
            raise ValueError("the private key does not match the key configuration's public key")
        self.config = config
        self._private_key = private_key

    @classmethod
    def from_private_bytes(
        cls,
        key_id: int,
        private_key: bytes,
        suites: Sequence[SymmetricSuite] = DEFAULT_SUITES,
        *,
        kem_id: int = DEFAULT_KEM_ID,
    ) -> KeyPair:
        """Load a serialized private key (tests inject the RFC's fixed key this way)."""
        kem = hpke.kem_for(kem_id)
        secret = kem.private_key_from_bytes(private_key)
        return cls(KeyConfig(key_id, kem_id, kem.public_key_bytes(secret), tuple(suites)), secret)

    @property
    def key_id(self) -> int:
        """The one-byte identifier that requests name."""
        return self.config.key_id

    @property
    def private_key(self) -> hpke.PrivateKey:
        """The opaque private key handle (it exposes no bytes)."""
        return self._private_key

    def __repr__(self) -> str:
        return f"KeyPair(key_id={self.config.key_id}, kem_id=0x{self.config.kem_id:04x}, private_key=<redacted>)"

    def __reduce__(self) -> object:
        raise TypeError("key pairs never leave memory; they cannot be pickled or copied")


def generate_key_pair(
    key_id: int,
    suites: Sequence[SymmetricSuite] = DEFAULT_SUITES,
    *,
    kem_id: int = DEFAULT_KEM_ID,
) -> KeyPair:
    """A fresh random key pair with identifier `key_id` accepting `suites`."""
    kem = hpke.kem_for(kem_id)
    secret = kem.generate_private_key()
    return KeyPair(KeyConfig(key_id, kem_id, kem.public_key_bytes(secret), tuple(suites)), secret)


class KeyRing:
    """The gateway's current key and, during rotation, the previous one.

    Clients holding a configuration fetched just before a rotation keep working
    until `drop_previous()`. The pair is swapped as one tuple so that a lookup
    running beside `rotate` sees either the old or the new state, never a mix.
    """

    __slots__ = ("_pairs",)

    def __init__(self, current: KeyPair, previous: KeyPair | None = None) -> None:
        if previous is not None and previous.key_id == current.key_id:
            raise ValueError("the current and previous keys need different key identifiers")
        self._pairs: tuple[KeyPair, KeyPair | None] = (current, previous)

    @property
    def current(self) -> KeyPair:
        """The key new clients should use."""
        return self._pairs[0]

    def rotate(self, new: KeyPair) -> None:
        """Make `new` current; the old current key becomes the previous one."""
        current = self._pairs[0]
        if new.key_id == current.key_id:
            raise ValueError("a rotated-in key needs a key identifier different from the current one")
        self._pairs = (new, current)

    def drop_previous(self) -> None:
        """Forget the previous key: requests sealed to it are refused from now on."""
        self._pairs = (self._pairs[0], None)

    def lookup(self, key_id: int) -> KeyPair:
        """The key pair with identifier `key_id`; raises UnknownKeyError if none."""
        for pair in self._pairs:
            if pair is not None and pair.key_id == key_id:
                return pair
        raise UnknownKeyError("the request names a key this gateway does not hold; fetch fresh key configurations")

    def __repr__(self) -> str:
        return f"KeyRing(key_ids={[pair.key_id for pair in self._pairs if pair is not None]})"
