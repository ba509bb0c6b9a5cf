"""Reading an inner request's JSON body: chat messages, and the sampling settings as `SamplingParams`.

Every check names the field that was wrong and never echoes what it held.
"""

from __future__ import annotations

from engine import DEFAULT_MAX_TOKENS, ChatMessage, SamplingParams
from enclave.api_types import ApiError

MAX_MESSAGES = 256
MAX_STOP_TOKEN_IDS = 64


def sampling_params(body: dict, chat: bool, max_tokens_limit: int) -> SamplingParams:
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
    if fields["max_tokens"] > max_tokens_limit:
        raise ApiError(400, "invalid_request", f"'max_tokens' may be at most {max_tokens_limit} on this node")
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
        check_unicode(text)
    return stops


def check_unicode(text: str) -> str:
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


def messages(raw: object) -> list[ChatMessage]:
    if not isinstance(raw, list) or not 0 < len(raw) <= MAX_MESSAGES:
        raise ApiError(400, "invalid_request", f"'messages' must be a list of 1-{MAX_MESSAGES} messages")
    messages = []
    for entry in raw:
        if not isinstance(entry, dict) or not isinstance(entry.get("role"), str):
            raise ApiError(400, "invalid_request", "each message needs a 'role' and a 'content'")
        messages.append(ChatMessage(check_unicode(entry["role"]), check_unicode(_text_content(entry.get("content")))))
    return messages


def _text_content(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: only text parts are supported
        parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if len(parts) == len(content) and all(isinstance(p, str) for p in parts):
            return "".join(parts)
    raise ApiError(400, "invalid_request", "message content must be a string or a list of text parts")


def include_usage(body: dict) -> bool:
    """`stream_options.include_usage`, as OpenAI reads it: only with `stream`, a boolean."""
    options = body.get("stream_options")
    if options is None:
        return False
    if body.get("stream") is not True:
        raise ApiError(400, "invalid_request", "'stream_options' is only allowed when 'stream' is true")
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise ApiError(400, "invalid_request", "'stream_options' must be an object with a boolean 'include_usage'")
    return options.get("include_usage", False)
