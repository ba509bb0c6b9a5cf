"""What the inner API's parts hand each other: its error, and the response a handler builds."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field

from engine import RequestMetrics
from protocol.errors import error_body


class ApiError(Exception):
    """Becomes an HTTP error response inside the encryption."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
        self.param = param  # the request field that was wrong, as OpenAI's `error.param` names it


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
    body = error_body(error.status, error.code, error.message, error.param)
    return InnerResponse(error.status, json.dumps(body).encode())
