"""The client's errors: one hierarchy, each message saying what went wrong and what to do.

No message ever holds a prompt, a completion or key material: only node identifiers, status codes,
error codes chosen by the node or gateway (checked to be short identifiers), the names of failed
verification checks, and a node's own reason for refusing a request (read inside the encryption from
an attested node, whose messages name fields and never echo content; kept only if it is one short
printable line).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

from protocol import codes
from protocol.constants import TASK_EMBED

_CODE = re.compile(r"[a-z0-9_.\-]{1,64}")


def safe_code(value: object, default: str = "unknown") -> str:
    """An error code fit to show: a short lower-case identifier, else `default`.

    Codes come from the other side of the wire; anything that is not a plain
    identifier is replaced so that no echoed content can reach a message.
    """
    return value if isinstance(value, str) and _CODE.fullmatch(value) else default


MAX_NODE_MESSAGE = 400


def safe_message(value: object) -> str | None:
    """A node's reason fit to show: one printable line of at most MAX_NODE_MESSAGE characters, else None."""
    if isinstance(value, str) and 0 < len(value) <= MAX_NODE_MESSAGE and value.isprintable():
        return value
    return None


class VeilClientError(Exception):
    """Base of every error the client raises."""


@dataclass(frozen=True, slots=True)
class CandidateFailure:
    """Why one candidate node was not used: the failed check and the verifier's explanation."""

    node_id: str
    check: str
    reason: str


class NoVerifiedNodeError(VeilClientError):
    """No candidate's evidence verified under the client's policy, so nothing was sent."""

    def __init__(self, failures: Sequence[CandidateFailure], detail: str | None = None) -> None:
        self.failures = tuple(failures)
        lines = [detail or "no candidate node passed verification; nothing was sent"]
        lines += [f"  node {f.node_id[:16]}: {f.check}: {f.reason}" for f in self.failures]
        lines.append("check the policy you verify with, or wait for the gateway to list verifiable nodes")
        super().__init__("\n".join(lines))


# The status of a GatewayError raised before any answer: the gateway was never reached.
UNREACHABLE = 0


class GatewayError(VeilClientError):
    """The gateway refused or failed the request (HTTP status and error code), or could not be reached
    (status UNREACHABLE: no answer came, so there is no status)."""

    def __init__(self, status: int, code: str, message: str, retry_after: float | None = None) -> None:
        self.status = status
        self.code = safe_code(code)
        self.retry_after = retry_after
        if status == UNREACHABLE:
            super().__init__(f"the gateway could not be reached: {message}")
        else:
            super().__init__(f"gateway answered {status} ({self.code}): {message}")


class NodeError(VeilClientError):
    """The node answered an error inside the encryption (so only this client can read it).

    As OpenAI's errors do, it keeps the node's `message`, the field it names (`param`) and its `type`."""

    def __init__(self, status: int, code: str, node_id: str, node_time: float | None = None,
                 message: str | None = None, param: str | None = None, kind: str | None = None) -> None:
        self.status = status
        self.code = safe_code(code)
        self.node_id = node_id
        self.node_time = node_time  # the node's clock, when it refused the request's Date
        self.message = safe_message(message)
        self.param = safe_code(param, default="") or None
        self.type = safe_code(kind, default="") or None
        reason = f": {self.message}" if self.message else ""
        super().__init__(f"node {node_id[:16]} refused the request with {status} ({self.code}){reason}; "
                         f"{_hint(status, self.code)}")

    @classmethod
    def from_body(cls, status: int, content: bytes, node_id: str, node_time: float | None = None) -> NodeError:
        """The error an OpenAI-shaped error body `{"error": {"message", "type", "param", "code"}}` stands for."""
        try:
            error = json.loads(content).get("error")
        except (ValueError, AttributeError, RecursionError):
            error = None
        if not isinstance(error, dict):
            return cls(status, "unknown", node_id, node_time)
        return cls(status, error.get("code"), node_id, node_time,  # type: ignore[arg-type]
                   message=error.get("message"), param=error.get("param"), kind=error.get("type"))


def _hint(status: int, code: str) -> str:
    if code == codes.DATE_OUT_OF_WINDOW:
        return "this computer's clock is too far from the node's; correct it (enable NTP) and send again"
    if status >= 500:
        return "the node failed while serving it; send it again (another node may be chosen)"
    return "fix the request's parameters or model name and send it again"


class ModelNotFoundError(VeilClientError):
    """No verified node lists the model asked for (OpenAI's 404 `model_not_found`)."""

    status = 404
    code = "model_not_found"

    def __init__(self) -> None:
        super().__init__("no verified node serves the requested model; list the models served and ask for one of them")


class ModelTaskError(VeilClientError):
    """The model asked for is listed only by nodes whose model does another task (an embeddings request
    to a generation model, or the reverse): refused before anything is sent, as the node would refuse it."""

    status = 400
    param = "model"

    def __init__(self, task: str) -> None:
        self.code = "model_not_embedding" if task == TASK_EMBED else "model_not_generation"
        wanted = "embeddings" if task == TASK_EMBED else "generation"
        super().__init__(f"no node lists the requested model for {wanted}: the directory lists it only for another "
                         "task; list the models served (each states its task) and ask for one that does this")


class StreamTruncatedError(VeilClientError):
    """The answer ended before its authenticated end: the node or the connection failed mid-answer."""

    def __init__(self, node_id: str | None, what: str = "the answer") -> None:
        self.node_id = node_id
        where = f"from node {node_id[:16]} " if node_id else ""
        super().__init__(
            f"{what} {where}was cut off before its authenticated end; "
            "discard the partial output and send the request again (another node will be chosen)"
        )


class ResponseIntegrityError(VeilClientError):
    """A response did not authenticate or did not parse: it was altered, or is not for this request."""

    def __init__(self, node_id: str | None, what: str) -> None:
        self.node_id = node_id
        super().__init__(f"{what}; the response was discarded. Send the request again")


class ReceiptRefusedError(ResponseIntegrityError):
    """The node's signed receipt for an answer is missing or does not prove this answer to this request.

    `receipt_error` is the verifier's refusal (`attestation.receipts`: MissingReceiptError,
    ReceiptFormatError, ReceiptKeyError, ReceiptSignatureError, ReceiptMismatchError, ReceiptTimeError)."""

    def __init__(self, node_id: str | None, receipt_error: Exception) -> None:
        self.receipt_error = receipt_error
        super().__init__(node_id, f"the node's receipt for this answer was refused ({receipt_error})")


class TokenPolicyError(VeilClientError):
    """A token wallet not bound to the client's policy: the policy lists no issuer key, or other keys."""


class TokenIssuanceError(VeilClientError):
    """No Privacy Pass token could be obtained: the issuer refused, is unreachable, or offers an unlisted key."""
