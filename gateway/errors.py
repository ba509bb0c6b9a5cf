"""The gateway's exception hierarchy.

Every error that reaches a caller becomes OpenAI's `{"error": {"message", "type", "param", "code"}}`
with the status below. Messages are fixed sentences: they say what was wrong
and what to do, and never repeat anything the caller sent (a node id, a
header, a byte of ciphertext), so a response can never reflect its request.
"""

from __future__ import annotations

from protocol import codes


class GatewayError(Exception):
    """Base of every gateway error; `status` and `code` are what the caller sees."""

    status: int = 500
    code: str = "gateway_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class MalformedRequestError(GatewayError):
    """The request body does not follow the gateway's REST API."""

    status = 400
    code = "malformed"


class NoCandidateError(GatewayError):
    """None of the request's candidates is an admitted, healthy node."""

    status = 404
    code = codes.NO_CANDIDATE


class NotFoundError(GatewayError):
    """The path names nothing this gateway serves."""

    status = 404
    code = "not_found"


class MethodNotAllowedError(GatewayError):
    """The path exists, but not for this HTTP method."""

    status = 405
    code = "method_not_allowed"


class RequestTooLargeError(GatewayError):
    """The request body is over the gateway's size bound."""

    status = 413
    code = "too_large"


class RequestTimeoutError(GatewayError):
    """A request's head or body did not arrive within the gateway's timeouts."""

    status = 408
    code = "request_timeout"


class UnsupportedMediaTypeError(GatewayError):
    """A forwarded OHTTP request does not declare an OHTTP request media type."""

    status = 415
    code = "unsupported_media_type"


class ExpectationFailedError(GatewayError):
    """An OHTTP request carried `Expect` (RFC 9458 section 5.1 forbids 100-continue): send it without one."""

    status = 417
    code = "expectation_failed"


class NodeFailedError(GatewayError):
    """Every node tried failed before sending its first byte."""

    status = 502
    code = codes.NODE_FAILED


class FinalRefusalError(GatewayError):
    """The chosen node's answer ends routing: the request must not be sent to another candidate."""


class UndecryptableError(FinalRefusalError):
    """The node could not decapsulate the request (RFC 9458 section 5.2: a 4xx); it is not the node's fault."""

    status = 400
    code = codes.UNDECRYPTABLE


class UnknownKeyError(UndecryptableError):
    """The request names a key configuration the node does not hold (rotated away, or never its own)."""

    code = codes.UNKNOWN_KEY


class AcceptTimeoutError(FinalRefusalError):
    """The node neither refused nor accepted the request in time; it may hold it, so no other node gets it."""

    status = 504
    code = codes.NODE_TIMEOUT


class OverloadedError(GatewayError):
    """The gateway or the chosen node is at its in-flight bound; retry after `retry_after_s`."""

    status = 503
    code = "overloaded"

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RegistrationError(GatewayError):
    """A node asked to register and could not be admitted."""

    status = 422
    code = "registration_failed"


class AdmissionError(GatewayError):
    """A node's evidence or answers did not let it join the pool (never shown to clients)."""

    code = "admission_failed"

    def __init__(self, message: str, *, check: str = "admission") -> None:
        super().__init__(message)
        self.check = check


class NodeUnreachableError(GatewayError):
    """A node did not answer a call (attestation, health or inference)."""

    status = 502
    code = "node_unreachable"


class GatewaySettingsError(GatewayError):
    """The gateway's configuration is invalid (a bad address, bound or policy)."""

    code = "settings"


class NodeBusyError(NodeUnreachableError):
    """The node is at its own capacity and refused the request."""

    code = "node_busy"


class SpentTokensError(GatewayError):
    """The spent-token store could not record a spend: the token is refused, never admitted unrecorded.

    Nothing was spent, so the client keeps its token and sends it again after `retry_after_s`."""

    status = 503
    code = "token_store_unavailable"

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class GatewayUnreachableError(GatewayError):
    """A relay could not reach the gateway it forwards to, or lost it before its answer began."""

    status = 502
    code = "gateway_unreachable"


class RelayOnlyError(GatewayError):
    """The gateway accepts inference only through its relays, and this caller is not one."""

    status = 403
    code = "relay_only"
