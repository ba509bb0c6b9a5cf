"""OpenAI-shaped result types, as frozen dataclasses parsed from the node's JSON.

Parsing keeps only the fields named here and checks their types, so a
malformed answer raises `ValueError` (turned into `ResponseIntegrityError` by
the SDK) instead of surfacing half-filled objects. `to_dict` gives back the
OpenAI wire shape, which the local proxy serves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from attestation.receipts import Receipt
from attestation.verifier import VerifiedNode
from protocol.constants import TASK_GENERATE


def _get(data: Any, key: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
    if not isinstance(data, dict):
        raise ValueError("expected a JSON object")
    if key not in data or data[key] is None:
        if default is ...:
            raise ValueError(f"field {key!r} is missing")
        return default
    value = data[key]
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise ValueError(f"field {key!r} has the wrong type")
    if not isinstance(value, kind):
        raise ValueError(f"field {key!r} has the wrong type")
    return value


def _list(data: Any, key: str) -> list[Any]:
    return _get(data, key, list)


# --- which node served, and what was verified --------------------------------------------


@dataclass(frozen=True, slots=True)
class CandidateRecord:
    """One candidate the client considered: its verification outcome (never trusted from the gateway)."""

    node_id: str
    capacity: int
    verified: VerifiedNode | None
    failed_check: str | None = None
    failure: str | None = None

    @property
    def ok(self) -> bool:
        return self.verified is not None


@dataclass(frozen=True, slots=True)
class Route:
    """Where one request went: the node that served it, every candidate's verification record and, for
    a whole answer, the serving node's verified receipt for it (`attestation.receipts`)."""

    node_id: str | None
    candidates: tuple[CandidateRecord, ...]
    policy_name: str
    receipt: Receipt | None = None

    @property
    def served_by(self) -> CandidateRecord | None:
        return next((c for c in self.candidates if c.node_id == self.node_id), None)


# --- shared pieces ------------------------------------------------------------------------


class _Receipted:
    """A whole answer's `receipt`: the serving node's signed word for it, verified by the SDK."""

    __slots__ = ()
    route: Route | None

    @property
    def receipt(self) -> Receipt | None:
        return None if self.route is None else self.route.receipt


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def from_dict(cls, data: Any) -> Usage:
        prompt = _get(data, "prompt_tokens", int)
        completion = _get(data, "completion_tokens", int)
        return cls(prompt, completion, _get(data, "total_tokens", int, prompt + completion))


def _usage(data: Any) -> Usage | None:
    raw = _get(data, "usage", dict, None)
    return None if raw is None else Usage.from_dict(raw)


def _header(data: Any, expected_object: str) -> tuple[str, str, int, str]:
    obj = _get(data, "object", str, expected_object)
    return _get(data, "id", str, ""), obj, _get(data, "created", int, 0), _get(data, "model", str, "")


# --- chat ----------------------------------------------------------------------------------


# Left out of the wire shape when None, as OpenAI leaves them out of answers that have none.
_OPTIONAL = {"omit_if_none": True}


@dataclass(frozen=True, slots=True)
class FunctionCall:
    """A streamed fragment carries a part of these (a name once, the arguments' JSON text in pieces)."""

    name: str | None = field(default=None, metadata=_OPTIONAL)
    arguments: str | None = field(default=None, metadata=_OPTIONAL)

    @classmethod
    def from_dict(cls, data: Any) -> FunctionCall:
        return cls(_get(data, "name", str, None), _get(data, "arguments", str, None))


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A function call in an answer; streamed, `index` says which call of the choice a fragment extends."""

    function: FunctionCall
    id: str | None = field(default=None, metadata=_OPTIONAL)
    type: str | None = field(default=None, metadata=_OPTIONAL)
    index: int | None = field(default=None, metadata=_OPTIONAL)

    @classmethod
    def from_dict(cls, data: Any) -> ToolCall:
        return cls(FunctionCall.from_dict(_get(data, "function", dict, {})), _get(data, "id", str, None),
                   _get(data, "type", str, None), _get(data, "index", int, None))


def _tool_calls(data: Any) -> tuple[ToolCall, ...] | None:
    raw = _get(data, "tool_calls", list, None)
    return None if raw is None else tuple(ToolCall.from_dict(call) for call in raw)


@dataclass(frozen=True, slots=True)
class ChatCompletionMessage:
    role: str
    content: str | None  # None only beside tool_calls, as OpenAI sends it
    tool_calls: tuple[ToolCall, ...] | None = field(default=None, metadata=_OPTIONAL)

    @classmethod
    def from_dict(cls, data: Any) -> ChatCompletionMessage:
        calls = _tool_calls(data)
        content = None if calls and _get(data, "content", str, None) is None else _get(data, "content", str, "")
        return cls(_get(data, "role", str, "assistant"), content, calls)


@dataclass(frozen=True, slots=True)
class ChatChoice:
    index: int
    message: ChatCompletionMessage
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None  # OpenAI's shape, when the request asked for them

    @classmethod
    def from_dict(cls, data: Any) -> ChatChoice:
        message = _get(data, "message", dict)
        return cls(
            _get(data, "index", int),
            ChatCompletionMessage.from_dict(message),
            _get(data, "finish_reason", str, None),
            _get(data, "logprobs", dict, None),
        )


@dataclass(frozen=True, slots=True)
class ChatCompletion(_Receipted):
    """A whole chat answer (`object == "chat.completion"`)."""

    id: str
    object: str
    created: int
    model: str
    choices: tuple[ChatChoice, ...]
    usage: Usage | None
    route: Route | None = field(default=None, compare=False)

    @classmethod
    def from_dict(cls, data: Any, route: Route | None = None) -> ChatCompletion:
        ident, obj, created, model = _header(data, "chat.completion")
        choices = tuple(ChatChoice.from_dict(c) for c in _list(data, "choices"))
        return cls(ident, obj, created, model, choices, _usage(data), route)

    def to_dict(self) -> dict[str, Any]:
        return _wire(self)


@dataclass(frozen=True, slots=True)
class ChoiceDelta:
    role: str | None
    content: str | None
    tool_calls: tuple[ToolCall, ...] | None = field(default=None, metadata=_OPTIONAL)


@dataclass(frozen=True, slots=True)
class ChatChunkChoice:
    index: int
    delta: ChoiceDelta
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None

    @classmethod
    def from_dict(cls, data: Any) -> ChatChunkChoice:
        delta = _get(data, "delta", dict, {})
        return cls(
            _get(data, "index", int),
            ChoiceDelta(_get(delta, "role", str, None), _get(delta, "content", str, None), _tool_calls(delta)),
            _get(data, "finish_reason", str, None),
            _get(data, "logprobs", dict, None),
        )


@dataclass(frozen=True, slots=True)
class ChatCompletionChunk:
    """One streamed piece of a chat answer (`object == "chat.completion.chunk"`)."""

    id: str
    object: str
    created: int
    model: str
    choices: tuple[ChatChunkChoice, ...]
    usage: Usage | None = None

    @classmethod
    def from_dict(cls, data: Any) -> ChatCompletionChunk:
        ident, obj, created, model = _header(data, "chat.completion.chunk")
        choices = tuple(ChatChunkChoice.from_dict(c) for c in _list(data, "choices"))
        return cls(ident, obj, created, model, choices, _usage(data))

    def to_dict(self) -> dict[str, Any]:
        return _wire(self)


# --- plain completions -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CompletionChoice:
    index: int
    text: str
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None

    @classmethod
    def from_dict(cls, data: Any) -> CompletionChoice:
        return cls(_get(data, "index", int), _get(data, "text", str, ""), _get(data, "finish_reason", str, None),
                   _get(data, "logprobs", dict, None))


@dataclass(frozen=True, slots=True)
class Completion(_Receipted):
    """A text completion, whole or (when streamed) one piece of it (`object == "text_completion"`)."""

    id: str
    object: str
    created: int
    model: str
    choices: tuple[CompletionChoice, ...]
    usage: Usage | None
    route: Route | None = field(default=None, compare=False)

    @classmethod
    def from_dict(cls, data: Any, route: Route | None = None) -> Completion:
        ident, obj, created, model = _header(data, "text_completion")
        choices = tuple(CompletionChoice.from_dict(c) for c in _list(data, "choices"))
        return cls(ident, obj, created, model, choices, _usage(data), route)

    def to_dict(self) -> dict[str, Any]:
        return _wire(self)


# --- models --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Model:
    id: str
    object: str
    created: int  # when the node listing it began serving (Unix seconds)
    owned_by: str
    task: str = TASK_GENERATE  # "generate" or "embed" (/v1/embeddings only), as the node lists it; absent: generate

    @classmethod
    def from_dict(cls, data: Any) -> Model:
        return cls(_get(data, "id", str), _get(data, "object", str, "model"), _get(data, "created", int, 0),
                   _get(data, "owned_by", str, ""), _get(data, "task", str, TASK_GENERATE))

    def to_dict(self) -> dict[str, Any]:
        return _wire(self)


@dataclass(frozen=True, slots=True)
class ModelList(_Receipted):
    object: str
    data: tuple[Model, ...]
    route: Route | None = field(default=None, compare=False)

    @classmethod
    def from_dict(cls, data: Any, route: Route | None = None) -> ModelList:
        return cls(_get(data, "object", str, "list"), tuple(Model.from_dict(m) for m in _list(data, "data")), route)

    def to_dict(self) -> dict[str, Any]:
        return _wire(self)


def _wire(result: Any) -> dict[str, Any]:
    """The OpenAI JSON shape: every field but the client-side route record (and usage when absent)."""
    data = {name: _to_plain(getattr(result, name)) for name in result.__dataclass_fields__ if name != "route"}
    if data.get("usage") is None:
        data.pop("usage", None)
    return data


def _to_plain(value: Any) -> Any:
    if hasattr(value, "__dataclass_fields__"):
        return {name: _to_plain(getattr(value, name)) for name, spec in value.__dataclass_fields__.items()
                if not (spec.metadata.get("omit_if_none") and getattr(value, name) is None)}
    if isinstance(value, tuple):
        return [_to_plain(item) for item in value]
    return value
