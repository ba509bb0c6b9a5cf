"""The OpenAI-style API that runs inside the encryption: chat and text completions, model listing.

Handlers turn a decrypted Binary HTTP request into an `InnerResponse`: a JSON body, or a stream of
server-sent events with one event per engine delta. Error bodies name what was wrong, never what
the request said.

A request that carries a `Date` field (the SDK always sends one) is refused when that date is
further than the window from the node's clock (RFC 9458 section 6.5): a captured ciphertext can
then be replayed only within the window, and the node still keeps no state about requests.
"""

from __future__ import annotations

import itertools
import json
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from engine import (
    DEFAULT_MAX_TOKENS,
    ChatMessage,
    EngineCoreClient,
    EngineError,
    RequestMetrics,
    RequestOutput,
    RequestRejected,
    SamplingParams,
    StreamDelta,
    TokenLogprob,
    Tokenizer,
)
from ohttp.bhttp import Request
from ohttp.dates import date_fields, format_http_date, parse_http_date
from protocol.codes import DATE_OUT_OF_WINDOW
from protocol.constants import MAX_INNER_BODY_BYTES

MAX_MESSAGES = 256
MAX_STOP_TOKEN_IDS = 64
REQUEST_DATE_WINDOW_S = 60.0


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


@dataclass(slots=True)
class InnerApi:
    engine: EngineCoreClient
    tokenizer: Tokenizer
    model_name: str
    date_window_s: float = REQUEST_DATE_WINDOW_S
    clock: Callable[[], float] = time.time

    @property
    def max_tokens_limit(self) -> int:
        return self.engine.max_model_len

    def handle(self, request: Request) -> InnerResponse:
        try:
            self._check_date(request)
            return self._route(request)
        except _DateOutOfWindow as error:
            response = error_response(error)
            # The node's own time, so that a client can tell how far off its clock is.
            response.headers.append((b"date", format_http_date(self.clock())))
            return response
        except ApiError as error:
            return error_response(error)
        except RequestRejected as error:
            return error_response(ApiError(400, error.reason, str(error)))
        except EngineError:
            return error_response(ApiError(500, "engine_error", "the engine failed this request"))
        except Exception:  # noqa: BLE001 - an unforeseen bug answers inside the encryption, saying nothing
            return error_response(ApiError(500, "engine_error", "the node failed this request"))

    def _check_date(self, request: Request) -> None:
        dates = date_fields(request.headers)
        if not dates:
            return  # plain OHTTP clients may not send one; they get no replay window
        if len(dates) > 1:
            raise ApiError(400, "invalid_date", "send at most one Date field")
        try:
            sent = parse_http_date(dates[0])
        except ValueError:
            raise ApiError(400, "invalid_date", "the Date field is not an HTTP date") from None
        if abs(self.clock() - sent) > self.date_window_s:
            raise _DateOutOfWindow(self.date_window_s)

    def _route(self, request: Request) -> InnerResponse:
        path = request.path.split(b"?", 1)[0]
        routes = {
            b"/v1/models": (b"GET", self._models),
            b"/v1/chat/completions": (b"POST", self._chat),
            b"/v1/completions": (b"POST", self._completions),
        }
        if path not in routes:
            raise ApiError(404, "not_found", "no such endpoint; use /v1/chat/completions, /v1/completions or /v1/models")
        method, handler = routes[path]
        if request.method.upper() != method:
            raise ApiError(405, "method_not_allowed", f"use {method.decode()} for this endpoint")
        return handler(request)

    def _models(self, request: Request) -> InnerResponse:
        body = {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "veil"}]}
        return InnerResponse(200, json.dumps(body).encode())

    def _chat(self, request: Request) -> InnerResponse:
        body = self._json_body(request)
        messages = _messages(body.get("messages"))
        prompt = self.tokenizer.encode_chat(messages)
        return self._generate(body, prompt, chat=True)

    def _completions(self, request: Request) -> InnerResponse:
        body = self._json_body(request)
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            _check_unicode(prompt)
        elif not (
            isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            raise ApiError(400, "invalid_request", "'prompt' must be a string or a list of token ids")
        return self._generate(body, prompt, chat=False)

    def _json_body(self, request: Request) -> dict:
        if len(request.content) > MAX_INNER_BODY_BYTES:
            raise ApiError(413, "too_large", f"the request body exceeds {MAX_INNER_BODY_BYTES} bytes")
        try:
            body = json.loads(request.content)
        except (ValueError, RecursionError):  # also nesting too deep, integers too long, bad UTF-8
            raise ApiError(400, "invalid_json", "the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise ApiError(400, "invalid_request", "the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise ApiError(404, "model_not_found", "this node does not serve the requested model; see /v1/models")
        return body

    def _generate(self, body: dict, prompt: str | list[int], chat: bool) -> InnerResponse:
        params = self._sampling_params(body, chat)
        handle = self.engine.submit(prompt, params)
        completion_id = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        shape = _Shape(completion_id, self.model_name, chat, int(time.time()),
                       logprobs=params.logprobs is not None, token_text=self._token_text)
        include_usage = _include_usage(body)
        if body.get("stream") is True:
            batches = handle.delta_batches()
            first = _first_batch(batches, handle)  # surfaces a refusal as an HTTP error, not a broken stream
            response = InnerResponse(200, on_close=[handle.close])
            response.events = shape.events(first, batches, handle, response, include_usage)
            return response
        try:
            output = RequestOutput(handle.request_id, [])
            for delta in handle.deltas():
                output.add(delta)
        finally:
            handle.close()
        return InnerResponse(200, json.dumps(shape.whole(output)).encode(), metrics=output.metrics)

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _sampling_params(self, body: dict, chat: bool) -> SamplingParams:
        """Every sampling setting the engine implements, under OpenAI's names (and vLLM's for the rest)."""
        fields = {
            "max_tokens": _number(body, "max_tokens", int, DEFAULT_MAX_TOKENS),
            "temperature": _number(body, "temperature", float, 1.0),
            "top_p": _number(body, "top_p", float, 1.0),
            "top_k": _top_k(body),
            "min_p": _number(body, "min_p", float, 0.0),
            "n": _number(body, "n", int, 1),
            "seed": _number(body, "seed", int, None),
            "stop": _stop_strings(body.get("stop")),
            "stop_token_ids": _token_ids(body.get("stop_token_ids")),
            "ignore_eos": _flag(body, "ignore_eos"),
            "logprobs": _chat_logprobs(body) if chat else _number(body, "logprobs", int, None),
        }
        if fields["max_tokens"] is not None and fields["max_tokens"] > self.max_tokens_limit:
            raise ApiError(400, "invalid_request", f"'max_tokens' may be at most {self.max_tokens_limit} on this node")
        return SamplingParams(**fields)


def _top_k(body: dict) -> int:
    """0 and, as vLLM spells it, -1 both mean no top-k filter."""
    top_k = _number(body, "top_k", int, 0)
    return 0 if top_k == -1 else top_k


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise ApiError(400, "invalid_request", f"'{name}' must be true or false")
    return value


def _token_ids(raw: object) -> tuple[int, ...]:
    if raw is None:
        return ()
    if not (isinstance(raw, list) and len(raw) <= MAX_STOP_TOKEN_IDS
            and all(isinstance(t, int) and not isinstance(t, bool) for t in raw)):
        raise ApiError(400, "invalid_request", f"'stop_token_ids' must be a list of at most {MAX_STOP_TOKEN_IDS} token ids")
    return tuple(raw)


def _chat_logprobs(body: dict) -> int | None:
    """Chat asks with `logprobs: true` and, for alternatives, `top_logprobs: N`; the engine counts the latter."""
    wanted = _flag(body, "logprobs")
    top = _number(body, "top_logprobs", int, None)
    if top is not None and not wanted:
        raise ApiError(400, "invalid_request", "'top_logprobs' needs 'logprobs': true")
    return (top or 0) if wanted else None


def _stop_strings(stop: object) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stops: tuple = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    else:
        raise ApiError(400, "invalid_request", "'stop' must be a string or a list of strings")
    for text in stops:
        _check_unicode(text)
    return stops


def _check_unicode(text: str) -> str:
    """JSON can carry lone surrogates, which are not text; the tokenizer must never see them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, "invalid_request", "text must be valid Unicode (no lone surrogates)") from None
    return text


def _number(body: dict, name: str, kind: type, default):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise ApiError(400, "invalid_request", f"'{name}' must be {'an integer' if kind is int else 'a number'}")
    return kind(value)


def _messages(raw: object) -> list[ChatMessage]:
    if not isinstance(raw, list) or not 0 < len(raw) <= MAX_MESSAGES:
        raise ApiError(400, "invalid_request", f"'messages' must be a list of 1-{MAX_MESSAGES} messages")
    messages = []
    for entry in raw:
        if not isinstance(entry, dict) or not isinstance(entry.get("role"), str):
            raise ApiError(400, "invalid_request", "each message needs a 'role' and a 'content'")
        messages.append(ChatMessage(_check_unicode(entry["role"]), _check_unicode(_text_content(entry.get("content")))))
    return messages


def _text_content(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: only text parts are supported
        parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if len(parts) == len(content) and all(isinstance(p, str) for p in parts):
            return "".join(parts)
    raise ApiError(400, "invalid_request", "message content must be a string or a list of text parts")


class _DateOutOfWindow(ApiError):
    def __init__(self, window_s: float) -> None:
        super().__init__(400, DATE_OUT_OF_WINDOW,
                         f"the request's Date differs from the node's clock by more than {window_s:g} s; "
                         "correct the sender's clock and send the request again")


def _first_batch(batches: Iterator[list[StreamDelta]], handle) -> list[StreamDelta]:
    try:
        return next(batches, [])
    except RequestRejected:
        handle.close()
        raise


@dataclass(frozen=True, slots=True)
class _Shape:
    """OpenAI response shapes for one completion."""

    completion_id: str
    model: str
    chat: bool
    created: int
    logprobs: bool = False  # whether the request asked for them
    token_text: Callable[[int], str] = str

    def whole(self, output: RequestOutput) -> dict:
        choices = [self._choice(o.index, o.text, _reason(o.finish_reason), o.logprobs) for o in output.outputs]
        return {
            "id": self.completion_id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": _usage(output.metrics),
        }

    def usage_chunk(self, metrics: RequestMetrics | None) -> dict:
        """The last chunk OpenAI streams when asked to include usage: no choices, the whole request's usage."""
        return {
            "id": self.completion_id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": _usage(metrics),
        }

    def _choice(self, index: int, text: str, finish_reason: str | None, logprobs: list[TokenLogprob]) -> dict:
        if self.chat:
            return {"index": index, "message": {"role": "assistant", "content": text},
                    "logprobs": self._logprobs(logprobs), "finish_reason": finish_reason}
        return {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": self._logprobs(logprobs)}

    def chunk(self, delta: StreamDelta, first_of_choice: bool) -> dict:
        finish = _reason(delta.finish_reason)
        logprobs = self._logprobs(list(delta.logprobs))
        if self.chat:
            content = {"role": "assistant", "content": delta.text} if first_of_choice else {"content": delta.text}
            choice = {"index": delta.index, "delta": content, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": delta.index, "text": delta.text, "finish_reason": finish, "logprobs": logprobs}
        return {
            "id": self.completion_id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }

    def events(
        self, first: list[StreamDelta], rest: Iterator[list[StreamDelta]], handle, response: InnerResponse,
        include_usage: bool = False,
    ) -> Iterator[bytes]:
        """Server-sent events, one piece per batch of deltas (one event per delta within it)."""
        started: set[int] = set()
        try:
            for batch in itertools.chain([first], rest):
                for delta in batch:
                    response.metrics = delta.metrics or response.metrics
                if batch:
                    yield b"".join(self._event(delta, started) for delta in batch)
            if include_usage:
                yield b"data: " + json.dumps(self.usage_chunk(response.metrics)).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"
        finally:
            handle.close()

    def _event(self, delta: StreamDelta, started: set[int]) -> bytes:
        first_of_choice = delta.index not in started
        started.add(delta.index)
        return b"data: " + json.dumps(self.chunk(delta, first_of_choice)).encode() + b"\n\n"


    def _logprobs(self, entries: list[TokenLogprob]) -> dict | None:
        """OpenAI's shapes: chat lists one object per token; text completions keep parallel lists."""
        if not self.logprobs:
            return None
        if self.chat:
            return {"content": [dict(self._token(e.token_id, e.logprob),
                                     top_logprobs=[self._token(t, lp) for t, lp in e.top]) for e in entries]}
        return {
            "tokens": [self.token_text(e.token_id) for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{self.token_text(t): lp for t, lp in e.top} for e in entries],
        }

    def _token(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        # A token holding part of a character has no text of its own; OpenAI then gives no bytes either.
        raw = None if "\ufffd" in text else list(text.encode("utf-8"))
        return {"token": text, "logprob": logprob, "bytes": raw}


def _usage(metrics: RequestMetrics | None) -> dict:
    prompt_tokens = metrics.prompt_tokens if metrics else 0
    completion_tokens = metrics.output_tokens if metrics else 0
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _include_usage(body: dict) -> bool:
    """`stream_options.include_usage`, as OpenAI reads it: only with `stream`, a boolean."""
    options = body.get("stream_options")
    if options is None:
        return False
    if body.get("stream") is not True:
        raise ApiError(400, "invalid_request", "'stream_options' is only allowed when 'stream' is true")
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise ApiError(400, "invalid_request", "'stream_options' must be an object with a boolean 'include_usage'")
    return options.get("include_usage", False)


def _reason(reason) -> str | None:
    return None if reason is None else reason.value
