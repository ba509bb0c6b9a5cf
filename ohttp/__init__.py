"""Veil's wire protocol: Oblivious HTTP (RFC 9458), Binary HTTP (RFC 9292) and chunked OHTTP.

Every byte between a user and a node travels inside these formats. The package
knows nothing about models, nodes or routing; it seals and opens messages.
"""

from __future__ import annotations

from .bhttp import (
    InformationalResponse,
    Request,
    Response,
    decode_request,
    decode_response,
    encode_request,
    encode_response,
)
from .chunked import (
    DEFAULT_MAX_CHUNK_SIZE,
    ChunkedRequestOpener,
    ChunkedRequestSealer,
    ChunkedResponseOpener,
    ChunkedResponseSealer,
)
from .errors import (
    DecryptionError,
    MalformedError,
    OHTTPError,
    TruncatedError,
    UnknownKeyError,
    UnsupportedSuiteError,
)
from .keys import (
    DEFAULT_SUITES,
    SUITE_AES_128_GCM,
    SUITE_AES_256_GCM,
    SUITE_CHACHA20_POLY1305,
    KeyConfig,
    KeyPair,
    KeyRing,
    SymmetricSuite,
    generate_key_pair,
)
from .media_types import (
    BHTTP,
    OHTTP_CHUNKED_REQUEST,
    OHTTP_CHUNKED_RESPONSE,
    OHTTP_REQUEST,
    OHTTP_RESPONSE,
)
from .message import ClientContext, ClientRequest, ServerContext, decapsulate_request

__all__ = [
    "BHTTP",
    "DEFAULT_MAX_CHUNK_SIZE",
    "DEFAULT_SUITES",
    "OHTTP_CHUNKED_REQUEST",
    "OHTTP_CHUNKED_RESPONSE",
    "OHTTP_REQUEST",
    "OHTTP_RESPONSE",
    "SUITE_AES_128_GCM",
    "SUITE_AES_256_GCM",
    "SUITE_CHACHA20_POLY1305",
    "ChunkedRequestOpener",
    "ChunkedRequestSealer",
    "ChunkedResponseOpener",
    "ChunkedResponseSealer",
    "ClientContext",
    "ClientRequest",
    "DecryptionError",
    "InformationalResponse",
    "KeyConfig",
    "KeyPair",
    "KeyRing",
    "MalformedError",
    "OHTTPError",
    "Request",
    "Response",
    "ServerContext",
    "SymmetricSuite",
    "TruncatedError",
    "UnknownKeyError",
    "UnsupportedSuiteError",
    "decapsulate_request",
    "decode_request",
    "decode_response",
    "encode_request",
    "encode_response",
    "generate_key_pair",
]
