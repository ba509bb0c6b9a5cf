"""The OpenAI-shaped surface of `Client`: `chat.completions`, `completions`, `responses` and `models`.

Each resource turns OpenAI's keyword arguments into the inner request's JSON body, sends it
through the client (which verifies, seals and retries) and parses the node's answer into the typed
results of `client.types`. The node decides which fields it applies: `extra_body` (as in OpenAI's SDK)
carries any other field to it, and a field it does not apply comes back as a NodeError naming it. An answer that does not have the expected shape is discarded as a
`ResponseIntegrityError`; nothing of it is shown.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, TypeVar

from client.errors import ModelNotFoundError, ResponseIntegrityError
from client.response_types import Response, ResponseStreamEvent
from client.streaming import AnswerHandle, Stream
from client.types import ChatCompletion, ChatCompletionChunk, Completion, Model, ModelList, Route

T = TypeVar("T")
W = TypeVar("W")

# Sampling settings beyond OpenAI's that nodes take (vLLM's names), passed as keywords to `create`.
SAMPLING_EXTRAS = ("top_k", "min_p", "stop_token_ids", "ignore_eos")


class Sender(Protocol):
    """What the resources need of `Client`: one whole and one streamed inner request."""

    def request(self, method: str, path: str, body: dict[str, Any] | None = None,
                model: str | None = None) -> tuple[Any, Route]: ...

    def listed_models(self) -> list[str]: ...

    def stream(self, path: str, body: dict[str, Any]) -> tuple[Iterator[Any], Route, AnswerHandle]: ...


class ChatCompletions:
    """`client.chat.completions`."""

    def __init__(self, client: Sender) -> None:
        self._client = client

    def create(
        self,
        *,
        model: str,
        messages: Sequence[Any],
        stream: bool = False,
        n: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        max_tokens: int | None = None,
        stop: str | list[str] | None = None,
        seed: int | None = None,
        stream_options: dict[str, Any] | None = None,
        logprobs: bool | None = None,
        top_logprobs: int | None = None,
        extra_body: dict[str, Any] | None = None,
        **sampling: Any,
    ) -> ChatCompletion | Stream[ChatCompletionChunk]:
        """A chat answer, or with `stream=True` an iterator of `ChatCompletionChunk`.

        `stream_options={"include_usage": True}` ends a stream with a chunk without choices that
        carries the request's usage, as OpenAI does. `logprobs=True` (with `top_logprobs=N` alternatives)
        returns each token's log probability in `choices[i].logprobs`; `top_k`, `min_p`, `stop_token_ids`
        and `ignore_eos` are taken as keywords too (see `SAMPLING_EXTRAS`)."""
        body = _body(model=model, messages=_messages(messages), stream=stream, n=n, temperature=temperature,
                     top_p=top_p, max_tokens=max_tokens, stop=stop, seed=seed, stream_options=stream_options,
                     logprobs=logprobs, top_logprobs=top_logprobs, **_extras(sampling)) | (extra_body or {})
        return _create(self._client, "/v1/chat/completions", body, stream,
                       ChatCompletionChunk.from_dict, ChatCompletion.from_dict)


class Chat:
    """`client.chat`."""

    def __init__(self, client: Sender) -> None:
        self.completions = ChatCompletions(client)


class Completions:
    """`client.completions`: text completions."""

    def __init__(self, client: Sender) -> None:
        self._client = client

    def create(
        self,
        *,
        model: str,
        prompt: str | list[int] | list[str] | list[list[int]],
        stream: bool = False,
        n: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        max_tokens: int | None = None,
        stop: str | list[str] | None = None,
        seed: int | None = None,
        stream_options: dict[str, Any] | None = None,
        logprobs: int | None = None,
        extra_body: dict[str, Any] | None = None,
        **sampling: Any,
    ) -> Completion | Stream[Completion]:
        """A text completion, or with `stream=True` an iterator of `Completion` pieces (`stream_options`
        and the sampling keywords as for chat; `logprobs=N` as OpenAI's text completions take it). The prompt
        is text or token ids; the node says which other forms it takes."""
        if not isinstance(prompt, (str, list)):
            raise ValueError("prompt must be a string or a list of token ids")
        body = _body(model=model, prompt=prompt, stream=stream, n=n, temperature=temperature,
                     top_p=top_p, max_tokens=max_tokens, stop=stop, seed=seed, stream_options=stream_options,
                     logprobs=logprobs, **_extras(sampling)) | (extra_body or {})
        return _create(self._client, "/v1/completions", body, stream, Completion.from_dict, Completion.from_dict)


class Responses:
    """`client.responses`: OpenAI's Responses API, served statelessly (`store` is always false)."""

    def __init__(self, client: Sender) -> None:
        self._client = client

    def create(
        self,
        *,
        model: str,
        input: str | Sequence[Any],  # noqa: A002 - OpenAI's name for it
        stream: bool = False,
        extra_body: dict[str, Any] | None = None,
        **fields: Any,
    ) -> Response | Stream[ResponseStreamEvent]:
        """A Response, or with `stream=True` an iterator of its events (`response.created` ... `response.completed`).

        Every other keyword is sent as the Responses field of that name (`instructions`, `tools`, `tool_choice`,
        `text`, `max_output_tokens`, `temperature`, ...): the node applies it or refuses it by name. Nodes keep no
        state, so `store=True` and `previous_response_id` are refused; send the whole conversation in `input`."""
        if not isinstance(input, (str, list, tuple)):
            raise ValueError("input must be a string or a list of items")
        body = _body(model=model, input=input if isinstance(input, str) else list(input), stream=stream or None,
                     **fields) | (extra_body or {})
        return _create(self._client, "/v1/responses", body, stream, ResponseStreamEvent.from_dict, Response.from_dict)


class Models:
    """`client.models`: what the verified nodes serve."""

    def __init__(self, client: Sender) -> None:
        self._client = client

    def list(self) -> ModelList:
        """Every model the fleet serves: each model's listing from a verified node of its own pool."""
        names = self._client.listed_models()
        if not names:  # a directory that names no models: one node's own listing
            data, route = self._client.request("GET", "/v1/models")
            return _parsed(lambda d: ModelList.from_dict(d, route), route.node_id)(data)
        models: dict[str, Model] = {}
        for name in names:
            data, route = self._client.request("GET", "/v1/models", model=name)
            for model in _parsed(lambda d: ModelList.from_dict(d, route), route.node_id)(data).data:
                models.setdefault(model.id, model)
        return ModelList("list", tuple(models.values()), route)

    def retrieve(self, model: str) -> Model:
        """One model a verified node serves, as OpenAI's `models.retrieve`; ModelNotFoundError if none does."""
        for listed in self.list().data:
            if listed.id == model:
                return listed
        raise ModelNotFoundError()


def _create(client: Sender, path: str, body: dict[str, Any], stream: bool,
            chunk: Callable[[Any], T], whole: Callable[[Any, Route], W]) -> W | Stream[T]:
    """POST `body` to `path`: a typed whole answer, or with `stream` a Stream of typed chunks."""
    if stream:
        return _stream_of(client, path, body, chunk)
    data, route = client.request("POST", path, body)
    return _parsed(lambda d: whole(d, route), route.node_id)(data)


def _stream_of(client: Sender, path: str, body: dict[str, Any], parse: Callable[[Any], T]) -> Stream[T]:
    payloads, route, answer = client.stream(path, body)
    typed = _parsed(parse, route.node_id)
    return Stream((typed(p) for p in payloads), route, answer)


def _extras(sampling: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(sampling) - set(SAMPLING_EXTRAS))
    if unknown:
        raise TypeError(f"create() got unexpected keyword arguments {unknown}; sampling extras are {list(SAMPLING_EXTRAS)}")
    return sampling


def _body(**fields: Any) -> dict[str, Any]:
    """The request's JSON: only the parameters the caller set."""
    return {name: value for name, value in fields.items() if value is not None}


def _messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """The messages as JSON objects: dicts as given (the node checks their fields), objects by role and content."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError("messages must be a list of {role, content} messages")
    out = []
    for message in messages:
        if isinstance(message, dict):
            out.append(dict(message))
            continue
        role, content = getattr(message, "role", None), getattr(message, "content", None)
        if not isinstance(role, str) or not isinstance(content, str):
            raise ValueError("each message needs a string role and string content")
        out.append({"role": role, "content": content})
    return out


def _parsed(parse: Callable[[Any], T], node_id: str | None) -> Callable[[Any], T]:
    """`parse`, with a malformed answer raised as ResponseIntegrityError (its content never shown)."""
    def run(payload: Any) -> T:
        try:
            return parse(payload)
        except (ValueError, TypeError):
            raise ResponseIntegrityError(node_id, "the node's answer does not have the expected shape") from None
    return run
