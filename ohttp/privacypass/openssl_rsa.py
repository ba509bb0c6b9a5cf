"""OpenSSL's raw RSA private operation (RSASP1 without padding), reached through its C API.

Blind signing (RFC 9474 §4.3) is the bare RSA private operation on a blinded message. The
`cryptography` package wraps the same OpenSSL but offers the operation only with PKCS#1 or PSS
padding, so this module calls `libcrypto` directly: `EVP_PKEY_sign` with `RSA_NO_PADDING`, which
runs OpenSSL's constant-time, internally blinded CRT exponentiation and checks its own CRT result
against the public exponent. It needs OpenSSL 3 (`EVP_PKEY_CTX_set_rsa_padding` is a function
there, a macro before); `load()` answers None where no such library is found, and the caller
falls back to another backend.

The key's DER bytes are handed to OpenSSL once, when a signer is made, and never kept in Python.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import weakref
from dataclasses import dataclass

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

RSA_NO_PADDING = 3
OPENSSL_3 = 0x30000000
_LIBRARY_NAMES = ("libcrypto.so.3", "libcrypto.3.dylib")


class OpenSSLError(RuntimeError):
    """OpenSSL refused an operation (its error queue is cleared; its text names no key material)."""


@functools.cache
def load() -> ctypes.CDLL | None:
    """libcrypto of OpenSSL 3 or newer, with the signatures this module calls, or None where there is none."""
    for name in (*_LIBRARY_NAMES, ctypes.util.find_library("crypto")):
        if not name:
            continue
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        lib.OpenSSL_version_num.restype = ctypes.c_ulong
        if lib.OpenSSL_version_num() >= OPENSSL_3:
            _declare(lib)
            return lib
    return None


def _declare(lib: ctypes.CDLL) -> None:
    pointer, size = ctypes.c_void_p, ctypes.c_size_t
    lib.d2i_AutoPrivateKey.restype = pointer
    lib.d2i_AutoPrivateKey.argtypes = [pointer, ctypes.POINTER(ctypes.c_char_p), ctypes.c_long]
    lib.EVP_PKEY_free.argtypes = [pointer]
    lib.EVP_PKEY_CTX_new.restype = pointer
    lib.EVP_PKEY_CTX_new.argtypes = [pointer, pointer]
    lib.EVP_PKEY_CTX_free.argtypes = [pointer]
    lib.EVP_PKEY_sign_init.argtypes = [pointer]
    lib.EVP_PKEY_CTX_set_rsa_padding.argtypes = [pointer, ctypes.c_int]
    lib.EVP_PKEY_sign.argtypes = [pointer, ctypes.c_char_p, ctypes.POINTER(size), ctypes.c_char_p, size]
    lib.ERR_clear_error.argtypes = []


@dataclass(frozen=True, slots=True, eq=False, weakref_slot=True)
class OpenSSLRawSigner:
    """One RSA private key held by OpenSSL; `sign` is RSASP1 on a modulus-length message below n."""

    lib: ctypes.CDLL
    pkey: int
    length: int

    @classmethod
    def of(cls, lib: ctypes.CDLL, private_key: rsa.RSAPrivateKey) -> OpenSSLRawSigner:
        der = private_key.private_bytes(serialization.Encoding.DER, serialization.PrivateFormat.PKCS8,
                                        serialization.NoEncryption())
        cursor = ctypes.c_char_p(der)
        pkey = lib.d2i_AutoPrivateKey(None, ctypes.byref(cursor), len(der))
        if not pkey:
            lib.ERR_clear_error()
            raise OpenSSLError("OpenSSL could not read the issuer's RSA key")
        signer = cls(lib, pkey, (private_key.key_size + 7) // 8)
        weakref.finalize(signer, lib.EVP_PKEY_free, pkey)
        return signer

    def sign(self, message: bytes) -> bytes:
        """message^d mod n; the caller checks the length and the bound first, OpenSSL checks them again."""
        lib = self.lib
        context = lib.EVP_PKEY_CTX_new(self.pkey, None)  # one a call: a context is not safe across threads
        if not context:
            raise OpenSSLError("OpenSSL could not make a signing context")
        try:
            signature = ctypes.create_string_buffer(self.length)
            written = ctypes.c_size_t(self.length)
            if (lib.EVP_PKEY_sign_init(context) != 1
                    or lib.EVP_PKEY_CTX_set_rsa_padding(context, RSA_NO_PADDING) != 1
                    or lib.EVP_PKEY_sign(context, signature, ctypes.byref(written), message, len(message)) != 1
                    or written.value != self.length):
                lib.ERR_clear_error()
                raise OpenSSLError("OpenSSL refused the raw RSA operation")
            return signature.raw
        finally:
            lib.EVP_PKEY_CTX_free(context)
