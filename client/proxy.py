"""`veil proxy`: a local OpenAI-compatible server; every request goes out attested and encrypted.

Point any OpenAI client at `http://127.0.0.1:8080/v1`: each call is forwarded
through `Client`, which verifies the candidate nodes and encrypts end to end,
so the proxy is the only place (on the user's own machine) where the plaintext
exists outside the node. It keeps no access log and logs no content.

Every field of a request goes to the node as sent: the node applies it or refuses it by name, and its
refusal comes back in OpenAI's error shape (`message`, `type`, `param`, `code`), as every error here
does. A client that disconnects from a stream ends it: the proxy closes the answer, so the gateway
cancels the node's work.

The SDK verifies every answer's receipt before the proxy sees the answer. A whole answer's receipt
goes to the local application in the `veil-receipt` header (base64 of its JSON), which OpenAI clients
ignore; a streamed answer's receipt comes after its last event, once the headers are long sent, so it
is verified and dropped (a refused one ends the stream with an error event instead of [DONE]).
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio.to_thread
from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from client.errors import (GatewayError, ModelNotFoundError, ModelTaskError, NodeError, NoVerifiedNodeError,
                           VeilClientError)
from client.response_types import ResponseStreamEvent
from client.sdk import Client
from client.streaming import Stream
from protocol.constants import MAX_INNER_BODY_BYTES
from protocol.errors import error_body

RECEIPT_HEADER = "veil-receipt"  # a whole answer's verified receipt, for the local application


def create_proxy_app(client: Client) -> FastAPI:
    """The proxy's FastAPI app, forwarding through `client` (which the caller owns and closes)."""
    app = FastAPI(title="Veil local proxy", docs_url=None, redoc_url=None, openapi_url=None)
    _install_error_handlers(app)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        body = await _json_body(request)
        if isinstance(body, JSONResponse):
            return body
        return await _forward(lambda: client.chat.completions.create(**_arguments(body, "messages", [])),
                              include_usage=_include_usage(body))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await _json_body(request)
        if isinstance(body, JSONResponse):
            return body
        return await _forward(lambda: client.completions.create(**_arguments(body, "prompt", "")),
                              include_usage=_include_usage(body))

    @app.post("/v1/responses")
    async def responses(request: Request) -> Any:
        body = await _json_body(request)
        if isinstance(body, JSONResponse):
            return body
        return await _forward(lambda: client.responses.create(**_arguments(body, "input", "")))

    @app.api_route("/v1/responses/{response_id:path}", methods=["GET", "POST", "DELETE"])
    async def stored_response(response_id: str) -> Any:
        return _error(404, "not_found", "responses are never stored (no state outlives a request on a Veil node), "
                      "so there is none to retrieve, cancel or delete by id")

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Any:
        body = await _json_body(request)
        if isinstance(body, JSONResponse):
            return body
        rest = {name: value for name, value in body.items() if name not in ("model", "input")}
        return await _forward(lambda: client.embeddings.create(model=body.get("model", ""), input=body.get("input", ""),
                                                               extra_body=rest))

    @app.get("/v1/models")
    async def models() -> Any:
        return await _forward(client.models.list)

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Any:
        return await _forward(lambda: client.models.retrieve(model_id))

    return app


def _arguments(body: dict[str, Any], main: str, missing: Any) -> dict[str, Any]:
    """`create`'s keywords: the model, the messages or prompt, and every other field as sent."""
    rest = {name: value for name, value in body.items() if name not in ("model", main)}
    return {"model": body.get("model", ""), main: body.get(main, missing), "stream": body.get("stream") is True,
            "extra_body": rest}


def _install_error_handlers(app: FastAPI) -> None:
    """FastAPI's own 404, 405 and 422 answers (`{"detail": ...}`) in OpenAI's shape, quoting nothing sent."""

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
        if error.status_code == 404:
            return _error(404, "not_found", "no such path; use /v1/chat/completions, /v1/completions, "
                          "/v1/responses, /v1/embeddings or /v1/models")
        if error.status_code == 405:
            return _error(405, "method_not_allowed", "this path does not accept that method")
        return _error(error.status_code, "invalid_request", "the request does not follow OpenAI's API")

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, __: RequestValidationError) -> JSONResponse:
        return _error(422, "invalid_request", "the request does not follow OpenAI's API")


async def _json_body(request: Request) -> dict[str, Any] | JSONResponse:
    raw = await request.body()
    if len(raw) > MAX_INNER_BODY_BYTES:
        return _error(413, "too_large", f"the request body exceeds {MAX_INNER_BODY_BYTES} bytes")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return _error(400, "invalid_json", "the request body is not valid JSON")
    if not isinstance(body, dict):
        return _error(400, "invalid_request", "the request body must be a JSON object")
    return body


def _include_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


async def _forward(call: Any, include_usage: bool = False) -> Any:
    try:
        result = await run_in_threadpool(call)
    except VeilClientError as error:
        return _client_error(error)
    except (ValueError, TypeError):
        return _error(400, "invalid_request", "the request is malformed; check model, messages or prompt, and the sampling values")
    if isinstance(result, Stream):
        return StreamingResponse(_until_disconnect(result, include_usage), media_type="text/event-stream",
                                 headers={"cache-control": "no-store"})
    receipt = getattr(result, "receipt", None)
    headers = None if receipt is None else {RECEIPT_HEADER: base64.b64encode(receipt.encode()).decode("ascii")}
    return JSONResponse(result.to_dict(), headers=headers)


async def _until_disconnect(stream: Stream, include_usage: bool) -> AsyncIterator[bytes]:
    """`_sse`'s events; when the client goes away (Starlette cancels this), the stream is closed at once.

    Each event is read on a worker thread that a cancellation abandons instead of awaiting, so a
    disconnect closes the answer now, not after the node's next token; closing it ends that read too."""
    events = _sse(stream, include_usage)
    try:
        while (event := await anyio.to_thread.run_sync(next, events, None, abandon_on_cancel=True)) is not None:
            yield event
    finally:
        stream.close()


def _sse(stream: Stream, include_usage: bool) -> Iterator[bytes]:
    """OpenAI's event stream; a failure mid-stream ends it with an error event instead of [DONE].

    With `include_usage`, every chunk has a `usage` field, null but in the last (which has no choices).
    A Responses stream's events are named (`event: response.created`) and end with its last event, as
    OpenAI's do, without [DONE].
    """
    named = False
    try:
        for chunk in stream:
            data = chunk.to_dict()
            if include_usage:
                data.setdefault("usage", None)
            named = isinstance(chunk, ResponseStreamEvent)
            event = f"event: {chunk.type}\n" if named else ""
            yield f"{event}data: {json.dumps(data, separators=(',', ':'))}\n\n".encode()
    except VeilClientError as error:
        status = getattr(error, "status", 0)
        payload = error_body(status if status >= 400 else 502, _code(error), str(error), getattr(error, "param", None))
        yield f"data: {json.dumps(payload)}\n\n".encode()
        return
    finally:
        stream.close()
    if not named:
        yield b"data: [DONE]\n\n"


def _client_error(error: VeilClientError) -> JSONResponse:
    if isinstance(error, (ModelNotFoundError, ModelTaskError)):
        return _error(error.status, error.code, str(error), param="model")
    if isinstance(error, NodeError):  # the node's own reason and the field it names, as OpenAI answers
        status = error.status if 400 <= error.status <= 599 else 502
        return _error(status, error.code, error.message or str(error), param=error.param)
    if isinstance(error, NoVerifiedNodeError):
        return _error(503, "no_verified_node", str(error))
    if isinstance(error, GatewayError):
        status = error.status if error.status in (400, 404, 413, 429, 503) else 502
        response = _error(status, error.code, str(error))
        if error.retry_after is not None:
            response.headers["retry-after"] = f"{error.retry_after:g}"
        return response
    return _error(502, _code(error), str(error))


def _code(error: VeilClientError) -> str:
    return getattr(error, "code", None) or _CODES.get(type(error).__name__, "client_error")


_CODES = {"StreamTruncatedError": "stream_truncated", "ResponseIntegrityError": "response_integrity"}


def _error(status: int, code: str, message: str, param: str | None = None) -> JSONResponse:
    """OpenAI's error shape: message, type, param and code."""
    return JSONResponse(error_body(status, code, message, param), status_code=status)
