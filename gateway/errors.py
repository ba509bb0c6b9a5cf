"""The gateway's exception hierarchy, below the errors every Veil server shares (`serving.errors`).

Every error that reaches a caller becomes OpenAI's `{"error": {"message", "type", "param", "code"}}`
with the status below. Messages are fixed sentences: they say what was wrong
and what to do, and never repeat anything the caller sent (a node id, a
header, a byte of ciphertext), so a response can never reflect its request.
"""

from __future__ import annotations

from protocol import codes
from protocol.errors import error_body
from serving.errors import ServingError, SettingsError

# RFC 9458 section 5.3 and RFC 9457: the problem type for a request sealed to a key the resource does not hold.
OHTTP_KEY_PROBLEM = "https://iana.org/assignments/http-problem-types#ohttp-key"
PROBLEM_JSON = "application/problem+json"


class GatewayError(ServingError):
    """Base of every error of the gateway's own; `status` and `code` are what the caller sees."""


class NoCandidateError(GatewayError):
    """None of the request's candidates is an admitted, healthy node."""

    status = 404
    code = codes.NO_CANDIDATE


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
    media_type = PROBLEM_JSON

    def body(self) -> dict[str, object]:
        # RFC 9458 section 5.3: a problem detail any OHTTP client understands; `error` stays for the SDK.
        return {"type": OHTTP_KEY_PROBLEM, "title": "key identifier unknown", "status": self.status,
                **error_body(self.status, self.code, self.message)}


class AcceptTimeoutError(FinalRefusalError):
    """The node neither refused nor accepted the request in time; it may hold it, so no other node gets it."""

    status = 504
    code = codes.NODE_TIMEOUT


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


class GatewaySettingsError(GatewayError, SettingsError):
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

    def headers(self) -> dict[str, str] | None:
        return {"retry-after": str(self.retry_after_s)}


class RelayOnlyError(GatewayError):
    """The gateway accepts inference only through its relays, and this caller is not one."""

    status = 403
    code = "relay_only"
