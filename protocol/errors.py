"""OpenAI's error shape, which the node, the gateway and the proxy all answer with.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "top_p", "code": "invalid_value"}}

`type` follows from the HTTP status as OpenAI's API uses it (a 404 is an `invalid_request_error` there
too); `param` names the request field that was wrong (None when no one field was). Messages are
written by the side that refuses and never hold any of the request's content.
"""

from __future__ import annotations

from typing import Any

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",  # as OpenAI answers an unknown model or path
    405: "invalid_request_error",
    408: "timeout_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    417: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


def error_type(status: int) -> str:
    """OpenAI's `type` for an error answered with HTTP `status`."""
    if status >= 500:
        return "server_error"
    return _TYPES.get(status, "invalid_request_error")


def error_body(status: int, code: str, message: str, param: str | None = None) -> dict[str, Any]:
    """The whole error body for `status`, in OpenAI's shape."""
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}
