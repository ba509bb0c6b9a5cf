"""The errors every Veil HTTP server answers with (gateway, relay, issuer, log, witness).

Each becomes OpenAI's `{"error": {"message", "type", "param", "code"}}` with the status below
(`serving.responses`). Messages are fixed sentences: they say what was wrong and what to do, and
never repeat anything the caller sent, so a response can never reflect its request. Each party
subclasses `ServingError` for its own errors (`gateway.errors`, `relay.errors`, `issuer.errors`).
"""

from __future__ import annotations

from protocol.errors import error_body


class ServingError(Exception):
    """Base of every error a Veil server answers; `status` and `code` are what the caller sees."""

    status: int = 500
    code: str = "gateway_error"
    media_type: str = "application/json"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def body(self) -> dict[str, object]:
        """The answer's JSON body: OpenAI's shape, its `param` always null here."""
        return error_body(self.status, self.code, self.message)

    def headers(self) -> dict[str, str] | None:
        """Headers the answer carries besides its body (a Retry-After, a challenge), or None."""
        return None


class SettingsError(ServingError):
    """A server's configuration is invalid (a bad address or bound)."""

    code = "settings"


class MalformedRequestError(ServingError):
    """The request does not follow the server's REST API."""

    status = 400
    code = "malformed"


class NotFoundError(ServingError):
    """The path names nothing this server serves."""

    status = 404
    code = "not_found"


class MethodNotAllowedError(ServingError):
    """The path exists, but not for this HTTP method."""

    status = 405
    code = "method_not_allowed"


class RequestTooLargeError(ServingError):
    """The request body is over the server's size bound."""

    status = 413
    code = "too_large"


class RequestTimeoutError(ServingError):
    """A request's head or body did not arrive within the server's timeouts."""

    status = 408
    code = "request_timeout"


class UnsupportedMediaTypeError(ServingError):
    """A forwarded OHTTP request does not declare an OHTTP request media type."""

    status = 415
    code = "unsupported_media_type"


class ExpectationFailedError(ServingError):
    """An OHTTP request carried `Expect` (RFC 9458 section 5.1 forbids 100-continue): send it without one."""

    status = 417
    code = "expectation_failed"


class OverloadedError(ServingError):
    """The server (or, behind the gateway, the chosen node) is at its in-flight bound; retry after `retry_after_s`."""

    status = 503
    code = "overloaded"

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str] | None:
        return {"retry-after": str(self.retry_after_s)}
