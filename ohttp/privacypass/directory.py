"""The issuer directory (RFC 9578 §4), served at /.well-known/private-token-issuer-directory.

    {"issuer-request-uri": "https://issuer.example/token-request",
     "token-keys": [{"token-type": 2, "token-key": "<b64url SPKI>", "not-before": 1700000000}]}

Keys of other token types are skipped, as the RFC asks of clients; unknown
members are ignored. Everything else that does not fit is a MalformedError.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from .encoding import b64url_decode, b64url_encode
from .errors import MalformedError
from .token_key import TokenKey, decode_token_key
from .wire import TOKEN_TYPE_BLIND_RSA

WELL_KNOWN_PATH = "/.well-known/private-token-issuer-directory"
MEDIA_TYPE = "application/private-token-issuer-directory"
MAX_DIRECTORY_BYTES = 64 * 1024
MAX_KEYS = 16


@dataclass(frozen=True, slots=True)
class DirectoryKey:
    token_key: TokenKey
    not_before: int | None = None
    token_type: int = TOKEN_TYPE_BLIND_RSA


@dataclass(frozen=True, slots=True)
class IssuerDirectory:
    request_uri: str
    keys: tuple[DirectoryKey, ...]

    def usable_keys(self, now: float) -> tuple[DirectoryKey, ...]:
        """The keys whose not-before has passed, newest first (the one a client should use is first)."""
        current = [key for key in self.keys if key.not_before is None or key.not_before <= now]
        return tuple(sorted(current, key=lambda key: key.not_before or 0, reverse=True))


def encode_directory(directory: IssuerDirectory) -> bytes:
    keys = [_encode_key(key) for key in directory.keys]
    return json.dumps({"issuer-request-uri": directory.request_uri, "token-keys": keys}).encode()


def decode_directory(body: bytes) -> IssuerDirectory:
    if len(body) > MAX_DIRECTORY_BYTES:
        raise MalformedError(f"the issuer directory is larger than {MAX_DIRECTORY_BYTES} bytes")
    try:
        document = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise MalformedError("the issuer directory is not JSON") from None
    if not isinstance(document, dict):
        raise MalformedError("the issuer directory must be a JSON object")
    request_uri = document.get("issuer-request-uri")
    entries = document.get("token-keys")
    if not isinstance(request_uri, str) or not request_uri or not isinstance(entries, list):
        raise MalformedError("the issuer directory needs issuer-request-uri (a string) and token-keys (a list)")
    if len(entries) > MAX_KEYS:
        raise MalformedError(f"the issuer directory lists more than {MAX_KEYS} keys")
    keys = tuple(key for key in (_decode_key(entry) for entry in entries) if key is not None)
    return IssuerDirectory(request_uri=request_uri, keys=keys)


def _encode_key(key: DirectoryKey) -> dict[str, object]:
    entry: dict[str, object] = {"token-type": key.token_type, "token-key": b64url_encode(key.token_key.spki)}
    if key.not_before is not None:
        entry["not-before"] = key.not_before
    return entry


def _decode_key(entry: object) -> DirectoryKey | None:
    if not isinstance(entry, dict) or not _is_int(entry.get("token-type")):
        raise MalformedError("each token-keys entry must be an object with an integer token-type")
    if entry["token-type"] != TOKEN_TYPE_BLIND_RSA:
        return None
    encoded = entry.get("token-key")
    not_before = entry.get("not-before")
    if not isinstance(encoded, str) or (not_before is not None and not _is_int(not_before)):
        raise MalformedError("a token-keys entry needs token-key (base64url) and an integer not-before if any")
    token_key = decode_token_key(b64url_decode(encoded, "token key", 1024))
    return DirectoryKey(token_key=token_key, not_before=not_before)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
