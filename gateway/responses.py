"""How the gateway answers: relayed node bytes, bounded request bodies, and fixed error bodies.

Every error becomes OpenAI's `{"error": {"message", "type", "param", "code"}}` with a fixed sentence,
including FastAPI's own validation errors (whose default answer would quote
the offending input) and Starlette's 404/405, so no answer ever reflects a
byte of its request.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from gateway.auth import TokenRequiredError
from gateway.errors import (
    GatewayError,
    MalformedRequestError,
    MethodNotAllowedError,
    NotFoundError,
    OverloadedError,
    RequestTooLargeError,
    SpentTokensError,
    UnknownKeyError,
)
from gateway.forwarding import RelayedAnswer
from ohttp.media_types import OHTTP_CHUNKED_RESPONSE
from protocol.constants import NODE_ID_HEADER
from protocol.errors import error_body


class RelayResponse(StreamingResponse):
    """Streams a node's answer and always closes the route, even if the client is gone before the start."""

    def __init__(self, answer: RelayedAnswer) -> None:
        headers = {NODE_ID_HEADER: answer.route.node_id, "cache-control": "no-store"}
        if answer.route.response_media_type == OHTTP_CHUNKED_RESPONSE:
            # Chunked OHTTP is only useful delivered as it comes: RFC 9842 asks every intermediary
            # (a relay, a load balancer) to forward this response incrementally, never to buffer it.
            headers["incremental"] = "?1"
        super().__init__(answer.chunks(), media_type=answer.route.response_media_type, headers=headers)
        self._answer = answer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._answer.close()


def relay_response(answer: RelayedAnswer) -> RelayResponse:
    """The streaming answer for a route that has started."""
    return RelayResponse(answer)


async def read_bounded(request: Request, max_bytes: int) -> bytes:
    """The request body, refusing (413) anything over `max_bytes` before or while reading it."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > max_bytes):
        raise RequestTooLargeError(f"the body must be at most {max_bytes} bytes")
    parts: list[bytes] = []
    received = 0
    try:
        async for part in request.stream():
            received += len(part)
            if received > max_bytes:
                raise RequestTooLargeError(f"the body must be at most {max_bytes} bytes")
            parts.append(part)
    except ClientDisconnect:
        # The body ended before its declared length: an ordinary bad request, not a server failure.
        raise MalformedRequestError("the request body ended early; send the whole body") from None
    return b"".join(parts)


# RFC 9458 section 5.3 and RFC 9457: the problem type for a request sealed to a key the resource does not hold.
OHTTP_KEY_PROBLEM = "https://iana.org/assignments/http-problem-types#ohttp-key"
PROBLEM_JSON = "application/problem+json"


def error_response(error: GatewayError) -> JSONResponse:
    """The JSON answer for `error`: its fixed code and message, plus Retry-After when overloaded or the
    spent-token store is out."""
    retry_after = isinstance(error, (OverloadedError, SpentTokensError))
    headers = {"retry-after": str(error.retry_after_s)} if retry_after else None
    if isinstance(error, TokenRequiredError):
        headers = {"www-authenticate": error.www_authenticate, "cache-control": "no-store"}
    body = error_body(error.status, error.code, error.message)  # OpenAI's shape; `param` is always null here
    if isinstance(error, UnknownKeyError):
        # RFC 9458 section 5.3: a problem detail any OHTTP client understands; `error` stays for the SDK.
        body = {"type": OHTTP_KEY_PROBLEM, "title": "key identifier unknown", "status": error.status, **body}
        return JSONResponse(body, status_code=error.status, headers=headers, media_type=PROBLEM_JSON)
    return JSONResponse(body, status_code=error.status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error with its fixed code and sentence."""

    @app.exception_handler(GatewayError)
    async def gateway_error(_: Request, error: GatewayError) -> JSONResponse:
        return error_response(error)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, __: RequestValidationError) -> JSONResponse:
        # FastAPI's default answer quotes the offending input; ours never does.
        return error_response(MalformedRequestError("the request does not follow the gateway's REST API"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
        if error.status_code == 405:
            return error_response(MethodNotAllowedError("this path does not accept that method"))
        if error.status_code == 404:
            return error_response(NotFoundError("no such path on this gateway"))
        return error_response(MalformedRequestError("the request does not follow the gateway's REST API"))

    @app.exception_handler(Exception)
    async def unexpected(_: Request, __: Exception) -> JSONResponse:
        failure = GatewayError("the gateway failed to handle the request; retry later")
        return error_response(failure)
