"""The one exception hierarchy of the OHTTP package.

Every error raised while decoding or opening data that came from the network is
an `OHTTPError`. Messages say what was wrong and what to do; they never contain
plaintext, ciphertext, key bytes or any other part of the input.
"""

from __future__ import annotations


class OHTTPError(Exception):
    """Base class of every error the package raises for bad wire data."""


class MalformedError(OHTTPError):
    """The bytes do not follow the wire format (bad length, bad field, trailing data)."""


class UnknownKeyError(OHTTPError):
    """The request names a key identifier this gateway does not hold (fetch fresh keys)."""


class UnsupportedSuiteError(OHTTPError):
    """The KEM, KDF or AEAD identifier is not one this package implements or the key accepts."""


class DecryptionError(OHTTPError):
    """Authentication failed: the data was altered, reordered, or sealed under another context."""


class TruncatedError(OHTTPError):
    """The stream ended before its final chunk: the message is incomplete and must be discarded."""
