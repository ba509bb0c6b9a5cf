"""The issuer's errors: every Veil server's (`serving.errors`), answered as fixed `{"error": ...}` bodies."""

from __future__ import annotations

from serving.errors import ServingError


class IssuerError(ServingError):
    """Base of the issuer's own errors."""


class IssuerConfigError(IssuerError):
    """The issuer's configuration file or key directory is unusable; the message says what to fix."""

    code = "issuer_config"


class AccountAuthError(IssuerError):
    """The request's account credential is missing, malformed, expired or signed by an unregistered key."""

    status = 401
    code = "unauthenticated"


class QuotaExceededError(IssuerError):
    """The account has used its tokens for this period."""

    status = 429
    code = "quota_exceeded"


class TokenRequestError(IssuerError):
    """The body is not a token request this issuer can answer (wrong type, length or key)."""

    status = 400
    code = "bad_token_request"
