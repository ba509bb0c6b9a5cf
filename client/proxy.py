"""`veil proxy`: a local OpenAI-compatible server; every request goes out attested and encrypted.

Point any OpenAI client at `http://127.0.0.1:8080/v1`: each call is forwarded
through `Client`, which verifies the candidate nodes and encrypts end to end,
so the proxy is the only place (on the user's own machine) where the plaintext
exists outside the node. It keeps no access log and logs no content.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, StreamingResponse

from client.errors import GatewayError, ModelNotFoundError, NodeError, NoVerifiedNodeError, VeilClientError
from client.resources import SAMPLING_EXTRAS
from client.sdk import Client
from client.streaming import Stream
from protocol.constants import MAX_INNER_BODY_BYTES

_PARAMETERS = ("n", "temperature", "top_p", "max_tokens", "stop", "seed", "stream_options", "logprobs",
               *SAMPLING_EXTRAS)


def create_proxy_app(client: Client) -> FastAPI:
    """The proxy's FastAPI app, forwarding through `client` (which the caller owns and closes)."""
    app = FastAPI(title="Veil local proxy", docs_url=None, redoc_url=None, openapi_url=None)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        body = await _json_body(request)
        if isinstance(body, JSONResponse):
            return body
        return await _forward(lambda: client.chat.completions.create(
            model=body.get("model", ""), messages=body.get("messages", []), stream=body.get("stream") is True,
            **_parameters(body, chat=True)), include_usage=_include_usage(body))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await _json_body(request)
        if isinstance(body, JSONResponse):
            return body
        return await _forward(lambda: client.completions.create(
            model=body.get("model", ""), prompt=body.get("prompt", ""), stream=body.get("stream") is True,
            **_parameters(body)), include_usage=_include_usage(body))

    @app.get("/v1/models")
    async def models() -> Any:
        return await _forward(client.models.list)

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Any:
        return await _forward(lambda: client.models.retrieve(model_id))

    return app


def _parameters(body: dict[str, Any], chat: bool = False) -> dict[str, Any]:
    names = (*_PARAMETERS, "top_logprobs") if chat else _PARAMETERS
    return {name: body[name] for name in names if body.get(name) is not None}


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
        return StreamingResponse(_sse(result, include_usage), media_type="text/event-stream",
                                 headers={"cache-control": "no-store"})
    return JSONResponse(result.to_dict())


def _sse(stream: Stream, include_usage: bool) -> Iterator[bytes]:
    """OpenAI's event stream; a failure mid-stream ends it with an error event instead of [DONE].

    With `include_usage`, every chunk has a `usage` field, null but in the last (which has no choices).
    """
    try:
        for chunk in stream:
            data = chunk.to_dict()
            if include_usage:
                data.setdefault("usage", None)
            yield f"data: {json.dumps(data, separators=(',', ':'))}\n\n".encode()
    except VeilClientError as error:
        payload = {"error": {"code": _code(error), "message": str(error), "type": "veil_error"}}
        yield f"data: {json.dumps(payload)}\n\n".encode()
        return
    finally:
        stream.close()
    yield b"data: [DONE]\n\n"


def _client_error(error: VeilClientError) -> JSONResponse:
    if isinstance(error, ModelNotFoundError):
        return _error(404, error.code, str(error), kind="invalid_request_error", param="model")
    if isinstance(error, NodeError):
        return _error(error.status if 400 <= error.status <= 599 else 502, error.code, str(error))
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


def _error(status: int, code: str, message: str, kind: str = "veil_error", param: str | None = None) -> JSONResponse:
    """OpenAI's error shape: message, type, param and code."""
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status)
