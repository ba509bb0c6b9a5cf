"""RSA blind signatures, RFC 9474: RSABSSA-SHA384-PSS and -PSSZERO, randomized and deterministic.

The client prepares and blinds a message, the signer signs the blinded message
without seeing it, and the client unblinds the answer into an ordinary
RSASSA-PSS signature that anyone holding the public key can verify.

Side channels. The signer's private operation runs in OpenSSL (`openssl_rsa`: its constant-time,
internally blinded CRT exponentiation), or, where no OpenSSL 3 library is found, in GMP (the `gmpy2`
binding) with `mpz_powm_sec`, whose time and memory accesses do not depend on the exponent or the
base; Python's own big integers are not constant-time and were 25 times slower than GMP.
What this module does about side channels:
- the signer multiplies each blinded message by a fresh random r_s^e before the
  private-key operation and divides r_s out afterwards, so the operands of the
  exponentiation are uniformly random and unrelated to the (already blinded) input;
- the private exponentiation runs with CRT over the key's own private numbers (read once, into a
  `BlindSigner`) and its result is checked with the public exponent before it leaves
  (RFC 9474 §4.3), so a fault cannot leak a factor of n;
- the client's blinding factor is drawn from the OS random generator and only its
  inverse is kept, in an object whose repr hides it.
What it cannot promise: the client's side (blinding, unblinding) still uses Python's integers,
whose timing depends on their operands; an attacker with a precise local timer on the client's
or the signer's host is outside this threat model.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

import gmpy2
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa

from . import openssl_rsa
from .errors import BlindingError, InvalidSignatureError, MalformedError
from .pss import HASH_LENGTH, emsa_pss_encode, i2osp, os2ip

MESSAGE_PREFIX_LENGTH = 32


@dataclass(frozen=True, slots=True)
class Variant:
    """One of the four RFC 9474 suites: the PSS salt length and whether a random prefix is added."""

    name: str
    salt_length: int
    randomized: bool


PSS_RANDOMIZED = Variant("RSABSSA-SHA384-PSS-Randomized", HASH_LENGTH, True)
PSSZERO_RANDOMIZED = Variant("RSABSSA-SHA384-PSSZERO-Randomized", 0, True)
PSS_DETERMINISTIC = Variant("RSABSSA-SHA384-PSS-Deterministic", HASH_LENGTH, False)
PSSZERO_DETERMINISTIC = Variant("RSABSSA-SHA384-PSSZERO-Deterministic", 0, False)
VARIANTS = (PSS_RANDOMIZED, PSSZERO_RANDOMIZED, PSS_DETERMINISTIC, PSSZERO_DETERMINISTIC)


@dataclass(frozen=True, slots=True)
class Blinding:
    """What the client keeps between Blind and Finalize; the inverse never appears in a repr."""

    blinded_msg: bytes
    inverse: int = field(repr=False)


def modulus_length(public_key: rsa.RSAPublicKey) -> int:
    """k, the modulus length in bytes."""
    return (public_key.key_size + 7) // 8


def prepare(variant: Variant, msg: bytes, *, _msg_prefix_for_tests: bytes | None = None) -> bytes:
    """Prepare (RFC 9474 §4.1): a random 32-byte prefix for the randomized suites, the message as is otherwise."""
    if not variant.randomized:
        return msg
    prefix = os.urandom(MESSAGE_PREFIX_LENGTH) if _msg_prefix_for_tests is None else _msg_prefix_for_tests
    if len(prefix) != MESSAGE_PREFIX_LENGTH:
        raise ValueError(f"the message prefix must be {MESSAGE_PREFIX_LENGTH} bytes")
    return prefix + msg


def blind(
    public_key: rsa.RSAPublicKey,
    variant: Variant,
    prepared_msg: bytes,
    *,
    _salt_for_tests: bytes | None = None,
    _blind_for_tests: int | None = None,
) -> Blinding:
    """Blind (RFC 9474 §4.2): EMSA-PSS-encode, then multiply by r^e mod n for a fresh random r."""
    numbers = public_key.public_numbers()
    n, e = numbers.n, numbers.e
    encoded = emsa_pss_encode(prepared_msg, n.bit_length() - 1, variant.salt_length, salt=_salt_for_tests)
    m = os2ip(encoded)
    if math.gcd(m, n) != 1:
        raise BlindingError("the encoded message is not invertible modulo n: prepare the message again")
    r = _random_unit(n) if _blind_for_tests is None else _blind_for_tests
    inverse = _inverse(r, n)
    blinded = (m * pow(r, e, n)) % n
    return Blinding(blinded_msg=i2osp(blinded, modulus_length(public_key)), inverse=inverse)


@dataclass(frozen=True, slots=True)
class GmpCrt:
    """RSASP1 by the Chinese remainder theorem in GMP, each half in constant time (`mpz_powm_sec`):
    the private operation where no OpenSSL 3 library is found."""

    p: Any = field(repr=False)
    q: Any = field(repr=False)
    dp: Any = field(repr=False)
    dq: Any = field(repr=False)
    qinv: Any = field(repr=False)
    name: str = "gmp"

    @classmethod
    def of(cls, private_key: rsa.RSAPrivateKey) -> GmpCrt:
        numbers = private_key.private_numbers()
        mpz = gmpy2.mpz
        return cls(mpz(numbers.p), mpz(numbers.q), mpz(numbers.dmp1), mpz(numbers.dmq1), mpz(numbers.iqmp))

    def rsasp1(self, m: Any) -> Any:
        s_p = gmpy2.powmod_sec(m % self.p, self.dp, self.p)
        s_q = gmpy2.powmod_sec(m % self.q, self.dq, self.q)
        h = self.qinv * (s_p - s_q) % self.p
        return s_q + h * self.q


@dataclass(frozen=True, slots=True)
class OpenSSLCrt:
    """RSASP1 by OpenSSL's own private operation (constant-time CRT, blinded and fault-checked inside)."""

    signer: openssl_rsa.OpenSSLRawSigner = field(repr=False)
    name: str = "openssl"

    def rsasp1(self, m: Any) -> Any:
        return gmpy2.mpz(os2ip(self.signer.sign(i2osp(int(m), self.signer.length))))


def private_operation(private_key: rsa.RSAPrivateKey) -> OpenSSLCrt | GmpCrt:
    """OpenSSL's private operation where libcrypto 3 is found (~3x faster than GMP's), else GMP's."""
    lib = openssl_rsa.load()
    if lib is None:
        return GmpCrt.of(private_key)
    return OpenSSLCrt(openssl_rsa.OpenSSLRawSigner.of(lib, private_key))


@dataclass(frozen=True, slots=True)
class BlindSigner:
    """The signer's side of RFC 9474 for one RSA key: its public numbers as GMP integers and its
    private operation, both made once."""

    n: Any = field(repr=False)
    e: Any = field(repr=False)
    private: OpenSSLCrt | GmpCrt = field(repr=False)
    k: int

    @classmethod
    def of(cls, private_key: rsa.RSAPrivateKey) -> BlindSigner:
        public = private_key.public_key()
        numbers = public.public_numbers()
        return cls(gmpy2.mpz(numbers.n), gmpy2.mpz(numbers.e), private_operation(private_key),
                   modulus_length(public))

    def sign(self, blinded_msg: bytes) -> bytes:
        """BlindSign (RFC 9474 §4.3): the raw RSA signature of a blinded message, checked before release."""
        if len(blinded_msg) != self.k:
            raise MalformedError(f"a blinded message must be {self.k} bytes for this key")
        m = gmpy2.mpz(os2ip(blinded_msg))
        n = self.n
        if m >= n:
            raise MalformedError("the blinded message is not below the modulus: blind it again under this key")
        mask = gmpy2.mpz(_random_unit(int(n)))
        s = self.private.rsasp1(m * gmpy2.powmod(mask, self.e, n) % n) * gmpy2.invert(mask, n) % n
        if gmpy2.powmod(s, self.e, n) != m:
            raise InvalidSignatureError("the private-key operation produced a wrong result: the key is damaged")
        return i2osp(int(s), self.k)


def blind_sign(private_key: rsa.RSAPrivateKey, blinded_msg: bytes) -> bytes:
    """BlindSign (RFC 9474 §4.3) once; a signer answering many requests keeps a `BlindSigner`."""
    return BlindSigner.of(private_key).sign(blinded_msg)


def finalize(
    public_key: rsa.RSAPublicKey, variant: Variant, prepared_msg: bytes, blind_sig: bytes, blinding: Blinding
) -> bytes:
    """Finalize (RFC 9474 §4.4): check the blind signature, unblind it and verify the result."""
    numbers = public_key.public_numbers()
    n, e = numbers.n, numbers.e
    k = modulus_length(public_key)
    if len(blind_sig) != k:
        raise MalformedError(f"a blind signature must be {k} bytes for this key")
    z = os2ip(blind_sig)
    if z >= n or pow(z, e, n) != os2ip(blinding.blinded_msg):
        raise InvalidSignatureError("the blind signature does not verify under the signer's public key")
    signature = i2osp((z * blinding.inverse) % n, k)
    verify(public_key, variant, prepared_msg, signature)
    return signature


def verify(public_key: rsa.RSAPublicKey, variant: Variant, prepared_msg: bytes, signature: bytes) -> None:
    """RSASSA-PSS-VERIFY with SHA-384, by `cryptography`; raises InvalidSignatureError."""
    pss = padding.PSS(mgf=padding.MGF1(hashes.SHA384()), salt_length=variant.salt_length)
    try:
        public_key.verify(signature, prepared_msg, pss, hashes.SHA384())
    except InvalidSignature:
        raise InvalidSignatureError("the signature does not verify under this public key") from None


def _random_unit(n: int) -> int:
    """A uniformly random integer in [1, n) that is invertible modulo n."""
    length = (n.bit_length() + 7) // 8
    excess_bits = 8 * length - n.bit_length()
    while True:  # rejection sampling: a reduction modulo n would favour small values
        candidate = os2ip(os.urandom(length)) >> excess_bits
        if 0 < candidate < n and math.gcd(candidate, n) == 1:
            return candidate


def _inverse(value: int, n: int) -> int:
    try:
        return pow(value, -1, n)
    except ValueError:
        raise BlindingError("the blinding factor is not invertible modulo n: blind again") from None
