"""How every Veil server answers: bounded request bodies and fixed error bodies.

Every error becomes OpenAI's `{"error": {"message", "type", "param", "code"}}` with a fixed sentence,
including FastAPI's own validation errors (whose default answer would quote
the offending input) and Starlette's 404/405, so no answer ever reflects a
byte of its request.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from serving.errors import MalformedRequestError, MethodNotAllowedError, NotFoundError, RequestTooLargeError, ServingError


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


def error_response(error: ServingError) -> JSONResponse:
    """The JSON answer for `error`: its fixed code and message, and the headers it asks for (a Retry-After
    when overloaded, a token challenge)."""
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers(), media_type=error.media_type)


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error with its fixed code and sentence."""

    @app.exception_handler(ServingError)
    async def serving_error(_: Request, error: ServingError) -> JSONResponse:
        return error_response(error)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, __: RequestValidationError) -> JSONResponse:
        # FastAPI's default answer quotes the offending input; ours never does.
        return error_response(MalformedRequestError("the request does not follow this server's REST API"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
        if error.status_code == 405:
            return error_response(MethodNotAllowedError("this path does not accept that method"))
        if error.status_code == 404:
            return error_response(NotFoundError("no such path on this server"))
        return error_response(MalformedRequestError("the request does not follow this server's REST API"))

    @app.exception_handler(Exception)
    async def unexpected(_: Request, __: Exception) -> JSONResponse:
        failure = ServingError("the server failed to handle the request; retry later")
        return error_response(failure)
