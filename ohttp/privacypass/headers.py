"""The PrivateToken HTTP authentication scheme (RFC 9577 §2): WWW-Authenticate challenges and Authorization.

    WWW-Authenticate: PrivateToken challenge="<b64url>", token-key="<b64url>"[, max-age=<n>]
    Authorization: PrivateToken token="<b64url>"

Parsing follows the auth-param grammar of RFC 9110 §11 but stays deliberately
narrow and bounded: a header longer than MAX_HEADER_LENGTH, more than
MAX_CHALLENGES challenges, a repeated parameter, a backslash escape or any
byte outside the grammar is a MalformedError. Messages never echo the value.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .encoding import b64url_decode, b64url_encode
from .errors import MalformedError
from .token_key import TokenKey, decode_token_key
from .wire import TOKEN_LENGTH, Token, TokenChallenge, decode_token, decode_token_challenge

SCHEME = "PrivateToken"
MAX_HEADER_LENGTH = 8192
MAX_CHALLENGES = 16
MAX_PARAMS = 8
_MAX_CHALLENGE_CHARS = 4 * ((2 + 2 + 0xFF + 1 + 32 + 2 + 1024) // 3 + 1)  # a challenge with generous origins
_MAX_KEY_CHARS = 1024
_MAX_TOKEN_CHARS = 4 * (TOKEN_LENGTH // 3 + 1)

_TOKEN = r"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
_SCHEME_START = re.compile(rf"[ \t]*({_TOKEN})(?:[ \t]+|$)")
_PARAM = re.compile(rf"[ \t]*({_TOKEN})[ \t]*=[ \t]*(?:\"([\x20\x21\x23-\x5b\x5d-\x7e]*)\"|({_TOKEN}))[ \t]*")


@dataclass(frozen=True, slots=True)
class Challenge:
    """One parsed PrivateToken challenge: the challenge bytes as sent (their digest binds tokens) and the key."""

    challenge: TokenChallenge
    challenge_bytes: bytes = field(repr=False)
    token_key: TokenKey
    max_age: int | None = None


def encode_www_authenticate(challenge: TokenChallenge, token_keys: list[TokenKey], max_age: int | None = None) -> str:
    """One PrivateToken challenge per key, comma-separated in one header value."""
    encoded = b64url_encode(challenge.encode())
    suffix = "" if max_age is None else f", max-age={int(max_age)}"
    return ", ".join(
        f'{SCHEME} challenge="{encoded}", token-key="{b64url_encode(key.spki)}"{suffix}' for key in token_keys
    )


def encode_authorization(token: Token) -> str:
    return f'{SCHEME} token="{b64url_encode(token.encode())}"'


def parse_www_authenticate(value: str) -> list[Challenge]:
    """The PrivateToken challenges in a WWW-Authenticate value; other schemes are skipped."""
    parsed = []
    for scheme, params in _parse_challenges(value, "WWW-Authenticate header"):
        if scheme.lower() == SCHEME.lower():
            parsed.append(_challenge_from(params))
    return parsed


def parse_authorization(value: str) -> Token:
    """The token in an `Authorization: PrivateToken token=...` value."""
    challenges = _parse_challenges(value, "Authorization header")
    if len(challenges) != 1 or challenges[0][0].lower() != SCHEME.lower():
        raise MalformedError("the Authorization header must carry exactly one PrivateToken credential")
    params = challenges[0][1]
    if set(params) != {"token"}:
        raise MalformedError("a PrivateToken credential has exactly one parameter, token")
    return decode_token(b64url_decode(params["token"], "token", _MAX_TOKEN_CHARS))


def _challenge_from(params: dict[str, str]) -> Challenge:
    if "challenge" not in params or "token-key" not in params:
        raise MalformedError("a PrivateToken challenge needs both challenge and token-key parameters")
    challenge_bytes = b64url_decode(params["challenge"], "challenge", _MAX_CHALLENGE_CHARS)
    token_key = decode_token_key(b64url_decode(params["token-key"], "token key", _MAX_KEY_CHARS))
    max_age = params.get("max-age")
    if max_age is not None and not (max_age.isdigit() and len(max_age) <= 10):
        raise MalformedError("max-age must be a non-negative integer of at most 10 digits")
    return Challenge(
        challenge=decode_token_challenge(challenge_bytes),
        challenge_bytes=challenge_bytes,
        token_key=token_key,
        max_age=None if max_age is None else int(max_age),
    )


def _parse_challenges(value: str, what: str) -> list[tuple[str, dict[str, str]]]:
    if len(value) > MAX_HEADER_LENGTH:
        raise MalformedError(f"the {what} is longer than {MAX_HEADER_LENGTH} characters")
    challenges: list[tuple[str, dict[str, str]]] = []
    position = 0
    while position < len(value):
        start = _SCHEME_START.match(value, position)
        if start is None:
            raise MalformedError(f"the {what} does not follow the auth-scheme grammar")
        params: dict[str, str] = {}
        challenges.append((start.group(1), params))
        if len(challenges) > MAX_CHALLENGES:
            raise MalformedError(f"the {what} has more than {MAX_CHALLENGES} challenges")
        position = _parse_params(value, start.end(), params, what)
    if not challenges:
        raise MalformedError(f"the {what} is empty")
    return challenges


def _parse_params(value: str, position: int, params: dict[str, str], what: str) -> int:
    """Read `name=value` pairs until a new scheme begins or the value ends; returns the new position."""
    while position < len(value):
        param = _PARAM.match(value, position)
        if param is None:
            break  # a new challenge starts here (or garbage, which the scheme match refuses)
        name = param.group(1).lower()
        if name in params or len(params) >= MAX_PARAMS:
            raise MalformedError(f"the {what} repeats a parameter or has too many")
        params[name] = param.group(2) if param.group(2) is not None else param.group(3)
        position = param.end()
        if position < len(value):
            if value[position] != ",":
                raise MalformedError(f"the {what} has parameters not separated by commas")
            position += 1
    return position
