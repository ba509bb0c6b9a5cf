"""Account authentication: a short-lived JWT signed with the account's registered key.

    Authorization: Bearer <JWT>   header {"alg": "ES256" | "EdDSA", "kid": "<account>"}
                                  claims {"sub": "<account>", "aud": "<issuer_name>", "iat": ..., "exp": ...}

`kid` picks the registered key; `sub` must name the same account; `aud` binds
the credential to this issuer, and `exp` may be at most MAX_LIFETIME_S after
`iat`, so a leaked credential is worth little for long (and never more than the
account's quota). Every registered claim (RFC 7519 section 4.1) present must
have its type: a NumericDate is a JSON number, the others strings (`aud` one
or a list of them). PyJWT reads a date with `int()`, so it lets "1700000000"
or `true` through, and checks no type of `iss`; such a credential is refused
like any other bad one (401), never left to fail later.
"""

from __future__ import annotations

import math
from typing import Any

import jwt

from issuer.config import Account
from issuer.errors import AccountAuthError

MAX_LIFETIME_S = 300
MAX_CREDENTIAL_CHARS = 4096
_REFUSED = "send Authorization: Bearer with a current JWT signed by the account's registered key"
_NUMERIC_DATES = ("exp", "iat", "nbf")
_STRINGS = ("iss", "sub", "jti")


def authenticate(authorization: str | None, accounts: dict[str, Account], audience: str) -> Account:
    """The account a request's credential proves, or AccountAuthError (whose message names no account)."""
    if authorization is None or len(authorization) > MAX_CREDENTIAL_CHARS:
        raise AccountAuthError(f"no usable account credential: {_REFUSED}")
    scheme, _, credential = authorization.partition(" ")
    if scheme.lower() != "bearer" or not credential:
        raise AccountAuthError(f"the credential is not a bearer JWT: {_REFUSED}")
    try:
        account = accounts.get(str(jwt.get_unverified_header(credential).get("kid")))
        if account is None:
            raise AccountAuthError(f"the credential names no registered account: {_REFUSED}")
        claims = jwt.decode(
            credential, account.public_key, algorithms=[account.algorithm], audience=audience,
            options={"require": ["exp", "iat", "sub", "aud"]},
        )
    except jwt.PyJWTError:
        raise AccountAuthError(f"the credential does not verify or has expired: {_REFUSED}") from None
    if not _registered_claims_typed(claims):
        raise AccountAuthError(f"a registered claim of the credential has the wrong type: {_REFUSED}")
    if claims["sub"] != account.name or not 0 < claims["exp"] - claims["iat"] <= MAX_LIFETIME_S:
        raise AccountAuthError(f"the credential's subject or lifetime is wrong (at most {MAX_LIFETIME_S} s): {_REFUSED}")
    return account


def _registered_claims_typed(claims: dict[str, Any]) -> bool:
    """Whether each registered claim present has its type (its value is checked by the caller and PyJWT)."""
    audience = claims.get("aud")
    audience_ok = isinstance(audience, str) or (
        isinstance(audience, list) and all(isinstance(item, str) for item in audience))
    return (audience_ok and all(_is_numeric_date(claims[name]) for name in _NUMERIC_DATES if name in claims)
            and all(isinstance(claims[name], str) for name in _STRINGS if name in claims))


def _is_numeric_date(value: object) -> bool:
    """A JSON number: an int (not a bool, which Python counts as one) or a finite float."""
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))
