"""The one exception hierarchy of the Privacy Pass package.

Messages say what was wrong and what to do; they never contain a token, a
nonce, a blinded message, a signature, key bytes or any other part of the input.
"""

from __future__ import annotations


class PrivacyPassError(Exception):
    """Base class of every error the package raises."""


class MalformedError(PrivacyPassError):
    """The bytes, header or JSON do not follow the wire format (length, field, encoding, bound)."""


class UnsupportedTokenTypeError(PrivacyPassError):
    """The structure names a token type other than 0x0002 (publicly verifiable, blind RSA 2048)."""


class UnknownTokenKeyError(PrivacyPassError):
    """The token or request names a key this party does not hold or trust (fetch the issuer's directory)."""


class InvalidSignatureError(PrivacyPassError):
    """A signature or blind signature does not verify: the data was altered or signed under another key."""


class BlindingError(PrivacyPassError):
    """The message cannot be blinded under this key (not invertible modulo n): prepare it again."""


class ChallengeMismatchError(PrivacyPassError):
    """The token is bound to another challenge (origin, issuer or context): obtain one for this server."""
