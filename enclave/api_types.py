"""What the inner API's parts hand each other: its error, and the response a handler builds."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field

from engine import RequestMetrics


class ApiError(Exception):
    """Becomes an HTTP error response inside the encryption."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


@dataclass(slots=True)
class InnerResponse:
    status: int
    body: bytes = b""
    events: Iterator[bytes] | None = None  # server-sent events, when streaming
    on_close: list = field(default_factory=list)
    metrics: RequestMetrics | None = None  # sizes and timings, once the request has finished
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)  # beyond the content type

    @property
    def streaming(self) -> bool:
        return self.events is not None


def error_response(error: ApiError) -> InnerResponse:
    body = {"error": {"code": error.code, "message": error.message, "type": "invalid_request_error"}}
    return InnerResponse(error.status, json.dumps(body).encode())
