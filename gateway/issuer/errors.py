"""The issuer's errors: part of the gateway's hierarchy, answered as fixed `{"error": ...}` bodies."""

from __future__ import annotations

from gateway.errors import GatewayError


class IssuerConfigError(GatewayError):
    """The issuer's configuration file or key directory is unusable; the message says what to fix."""

    code = "issuer_config"


class AccountAuthError(GatewayError):
    """The request's account credential is missing, malformed, expired or signed by an unregistered key."""

    status = 401
    code = "unauthenticated"


class QuotaExceededError(GatewayError):
    """The account has used its tokens for this period."""

    status = 429
    code = "quota_exceeded"


class TokenRequestError(GatewayError):
    """The body is not a token request this issuer can answer (wrong type, length or key)."""

    status = 400
    code = "bad_token_request"
