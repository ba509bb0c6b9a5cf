"""The token type 2 wire structures: TokenChallenge (RFC 9577 §2.1), TokenRequest, TokenResponse, Token (RFC 9578 §6).

Decoding is strict: exact lengths, no trailing bytes, known token type only.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field

from .errors import MalformedError, UnsupportedTokenTypeError
from .token_key import TOKEN_KEY_ID_LENGTH

TOKEN_TYPE_BLIND_RSA = 0x0002
NONCE_LENGTH = 32
DIGEST_LENGTH = 32
AUTHENTICATOR_LENGTH = 256  # Nk for RSA 2048
REDEMPTION_CONTEXT_LENGTH = 32
TOKEN_INPUT_LENGTH = 2 + NONCE_LENGTH + DIGEST_LENGTH + TOKEN_KEY_ID_LENGTH
TOKEN_LENGTH = TOKEN_INPUT_LENGTH + AUTHENTICATOR_LENGTH


@dataclass(frozen=True, slots=True)
class TokenChallenge:
    """What a server asks a token to be bound to: its issuer, an optional context and the origins."""

    issuer_name: str
    origin_info: tuple[str, ...] = ()
    redemption_context: bytes = b""
    token_type: int = TOKEN_TYPE_BLIND_RSA

    def encode(self) -> bytes:
        issuer = _ascii(self.issuer_name, "issuer name")
        origins = _ascii(",".join(self.origin_info), "origin info")
        if not 1 <= len(issuer) <= 0xFFFF or len(origins) > 0xFFFF or any(not o for o in self.origin_info):
            raise MalformedError("the issuer name must be 1 to 65535 bytes and each origin name non-empty")
        if len(self.redemption_context) not in (0, REDEMPTION_CONTEXT_LENGTH):
            raise MalformedError("a redemption context must be empty or 32 bytes")
        return (
            struct.pack("!HH", self.token_type, len(issuer)) + issuer
            + bytes([len(self.redemption_context)]) + self.redemption_context
            + struct.pack("!H", len(origins)) + origins
        )

    def digest(self) -> bytes:
        """challenge_digest: SHA-256 of the encoded challenge."""
        return hashlib.sha256(self.encode()).digest()


def decode_token_challenge(data: bytes) -> TokenChallenge:
    reader = _Reader(data, "token challenge")
    token_type = reader.uint16()
    issuer = reader.take(reader.uint16())
    context = reader.take(reader.uint8())
    origins = reader.take(reader.uint16())
    reader.finish()
    if token_type != TOKEN_TYPE_BLIND_RSA:
        raise UnsupportedTokenTypeError("the challenge names a token type other than 0x0002")
    origin_names = tuple(origins.decode("ascii", "replace").split(",")) if origins else ()
    challenge = TokenChallenge(_text(issuer), origin_names, context, token_type)
    if challenge.encode() != data:
        raise MalformedError("the token challenge is not canonically encoded (empty issuer or origin, bad context)")
    return challenge


@dataclass(frozen=True, slots=True)
class TokenRequest:
    """The client's blinded message, naming the issuer key by the last byte of its id."""

    truncated_token_key_id: int
    blinded_msg: bytes = field(repr=False)
    token_type: int = TOKEN_TYPE_BLIND_RSA

    def encode(self) -> bytes:
        return struct.pack("!HB", self.token_type, self.truncated_token_key_id) + self.blinded_msg


def decode_token_request(data: bytes) -> TokenRequest:
    reader = _Reader(data, "token request")
    token_type = reader.uint16()
    if token_type != TOKEN_TYPE_BLIND_RSA:
        raise UnsupportedTokenTypeError("the token request names a token type other than 0x0002")
    key_id = reader.uint8()
    blinded_msg = reader.take(AUTHENTICATOR_LENGTH)
    reader.finish()
    return TokenRequest(key_id, blinded_msg, token_type)


def decode_token_response(data: bytes) -> bytes:
    """TokenResponse for type 2 is the blind signature alone; returns it after the length check."""
    if len(data) != AUTHENTICATOR_LENGTH:
        raise MalformedError(f"a token response must be {AUTHENTICATOR_LENGTH} bytes")
    return bytes(data)


@dataclass(frozen=True, slots=True)
class Token:
    """A redeemable token: the signed token_input and its authenticator. Its repr shows nothing."""

    nonce: bytes = field(repr=False)
    challenge_digest: bytes = field(repr=False)
    token_key_id: bytes = field(repr=False)
    authenticator: bytes = field(repr=False)
    token_type: int = TOKEN_TYPE_BLIND_RSA

    def token_input(self) -> bytes:
        """The message the authenticator signs (RFC 9578 §6.3)."""
        return struct.pack("!H", self.token_type) + self.nonce + self.challenge_digest + self.token_key_id

    def encode(self) -> bytes:
        return self.token_input() + self.authenticator


def decode_token(data: bytes) -> Token:
    reader = _Reader(data, "token")
    token_type = reader.uint16()
    if token_type != TOKEN_TYPE_BLIND_RSA:
        raise UnsupportedTokenTypeError("the token has a token type other than 0x0002")
    token = Token(
        nonce=reader.take(NONCE_LENGTH),
        challenge_digest=reader.take(DIGEST_LENGTH),
        token_key_id=reader.take(TOKEN_KEY_ID_LENGTH),
        authenticator=reader.take(AUTHENTICATOR_LENGTH),
        token_type=token_type,
    )
    reader.finish()
    return token


class _Reader:
    """Reads fields off a byte string; every shortfall or leftover is a MalformedError naming the structure."""

    def __init__(self, data: bytes, what: str) -> None:
        self._data = bytes(data)
        self._offset = 0
        self._what = what

    def take(self, length: int) -> bytes:
        end = self._offset + length
        if end > len(self._data):
            raise MalformedError(f"the {self._what} is truncated")
        chunk = self._data[self._offset : end]
        self._offset = end
        return chunk

    def uint8(self) -> int:
        return self.take(1)[0]

    def uint16(self) -> int:
        return int(struct.unpack("!H", self.take(2))[0])

    def finish(self) -> None:
        if self._offset != len(self._data):
            raise MalformedError(f"the {self._what} has trailing bytes")


def _ascii(text: str, what: str) -> bytes:
    try:
        return text.encode("ascii")
    except UnicodeEncodeError:
        raise MalformedError(f"the {what} must be ASCII") from None


def _text(data: bytes) -> str:
    try:
        return data.decode("ascii")
    except UnicodeDecodeError:
        raise MalformedError("the token challenge's issuer name must be ASCII") from None
