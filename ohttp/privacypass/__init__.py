"""Privacy Pass (RFC 9576–9578): anonymous tokens that authorize a request without identifying its sender.

Token type 0x0002 only: publicly verifiable tokens from RSA blind signatures
(RFC 9474, RSABSSA-SHA384-PSS-Deterministic, 2048-bit keys). The issuer signs
a blinded token it never sees; the gateway verifies the unblinded token under
the issuer's public key and cannot link it to its issuance. This package sits
beside the OHTTP code because both clients and the gateway use it and it, like
OHTTP, knows nothing about models, nodes or accounts.
"""

from __future__ import annotations

from .directory import WELL_KNOWN_PATH, DirectoryKey, IssuerDirectory, decode_directory, encode_directory
from .errors import (
    BlindingError,
    ChallengeMismatchError,
    InvalidSignatureError,
    MalformedError,
    PrivacyPassError,
    UnknownTokenKeyError,
    UnsupportedTokenTypeError,
)
from .headers import (
    SCHEME,
    Challenge,
    encode_authorization,
    encode_www_authenticate,
    parse_authorization,
    parse_www_authenticate,
)
from .issuance import (
    IssuerKey,
    PendingToken,
    answer_token_request,
    begin_issuance,
    finish_issuance,
    issuer_key,
    require_challenge,
    verify_token,
)
from .token_key import TokenKey, decode_token_key, token_key_from_public_key
from .wire import (
    TOKEN_TYPE_BLIND_RSA,
    Token,
    TokenChallenge,
    TokenRequest,
    decode_token,
    decode_token_challenge,
    decode_token_request,
)

TOKEN_REQUEST_MEDIA_TYPE = "application/private-token-request"
TOKEN_RESPONSE_MEDIA_TYPE = "application/private-token-response"

__all__ = [
    "SCHEME",
    "TOKEN_REQUEST_MEDIA_TYPE",
    "TOKEN_RESPONSE_MEDIA_TYPE",
    "TOKEN_TYPE_BLIND_RSA",
    "WELL_KNOWN_PATH",
    "BlindingError",
    "Challenge",
    "ChallengeMismatchError",
    "DirectoryKey",
    "InvalidSignatureError",
    "IssuerDirectory",
    "IssuerKey",
    "MalformedError",
    "PendingToken",
    "PrivacyPassError",
    "Token",
    "TokenChallenge",
    "TokenKey",
    "TokenRequest",
    "UnknownTokenKeyError",
    "UnsupportedTokenTypeError",
    "answer_token_request",
    "begin_issuance",
    "decode_directory",
    "decode_token",
    "decode_token_challenge",
    "decode_token_key",
    "decode_token_request",
    "encode_authorization",
    "encode_directory",
    "encode_www_authenticate",
    "finish_issuance",
    "issuer_key",
    "parse_authorization",
    "parse_www_authenticate",
    "require_challenge",
    "token_key_from_public_key",
    "verify_token",
]
