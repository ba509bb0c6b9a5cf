"""Account authentication: a short-lived JWT signed with the account's registered key.

    Authorization: Bearer <JWT>   header {"alg": "ES256" | "EdDSA", "kid": "<account>"}
                                  claims {"sub": "<account>", "aud": "<issuer_name>", "iat": ..., "exp": ...}

`kid` picks the registered key; `sub` must name the same account; `aud` binds
the credential to this issuer, and `exp` may be at most MAX_LIFETIME_S after
`iat`, so a leaked credential is worth little for long (and never more than the
account's quota).
"""

from __future__ import annotations

import jwt

from gateway.issuer.config import Account
from gateway.issuer.errors import AccountAuthError

MAX_LIFETIME_S = 300
MAX_CREDENTIAL_CHARS = 4096
_REFUSED = "send Authorization: Bearer with a current JWT signed by the account's registered key"


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
    if claims["sub"] != account.name or not 0 < claims["exp"] - claims["iat"] <= MAX_LIFETIME_S:
        raise AccountAuthError(f"the credential's subject or lifetime is wrong (at most {MAX_LIFETIME_S} s): {_REFUSED}")
    return account
