"""Reading an inner request's JSON body: chat messages, the prompt, and the sampling settings as `SamplingParams`.

Every field of OpenAI's references is applied here or refused by name (`openai_fields` lists which and
why). Every check names the field that was wrong in the error's `param` and never echoes what it held.
"""

from __future__ import annotations

from engine import ChatMessage, SamplingParams
from enclave import structured_fields, tool_fields
from enclave.api_types import ApiError
from enclave.openai_fields import check_names

MAX_MESSAGES = 256
MAX_STOP_TOKEN_IDS = 64
MAX_USER_CHARS = 512
SERVICE_TIERS = ("auto", "default")  # one tier: asking for it, or for none in particular, changes nothing


def sampling_params(body: dict, chat: bool, max_tokens_limit: int) -> SamplingParams:
    """Every sampling setting the engine implements, under OpenAI's names (and vLLM's for the rest)."""
    check_names(body, chat)
    _inert_fields(body, chat)
    fields = {
        "max_tokens": _max_tokens(body, max_tokens_limit),
        "temperature": _number(body, "temperature", float, 1.0),
        "top_p": _number(body, "top_p", float, 1.0),
        "top_k": _top_k(body),
        "min_p": _number(body, "min_p", float, 0.0),
        "n": _samples(body),
        "seed": _number(body, "seed", int, None),
        "stop": _stop_strings(body.get("stop")),
        "stop_token_ids": _token_ids(body.get("stop_token_ids")),
        "ignore_eos": _flag(body, "ignore_eos"),
        "logprobs": _chat_logprobs(body) if chat else _number(body, "logprobs", int, None),
        **engine_fields(body),
    }
    return SamplingParams(**fields)


def _max_tokens(body: dict, limit: int) -> int | None:
    """`max_tokens`, or its newer name `max_completion_tokens` (chat); both given must agree. Neither: None,
    the rest of the context window (as vLLM does), which the engine works out from the prompt."""
    plain = _number(body, "max_tokens", int, None)
    alias = _number(body, "max_completion_tokens", int, None)
    if plain is not None and alias is not None and plain != alias:
        raise ApiError(400, "invalid_request", "'max_tokens' and 'max_completion_tokens' are one setting; "
                       "give one of them, or both equal", param="max_completion_tokens")
    name, value = ("max_completion_tokens", alias) if alias is not None else ("max_tokens", plain)
    if value is not None and value > limit:
        raise ApiError(400, "invalid_request", f"'{name}' may be at most {limit} on this node", param=name)
    return value


def _samples(body: dict) -> int:
    """`n`; `best_of` only as the same number, since every sample drawn is returned and none ranked away."""
    n = _number(body, "n", int, 1)
    best_of = _number(body, "best_of", int, None)
    if best_of is not None and best_of != n:
        raise ApiError(400, "unsupported_parameter", "'best_of' must equal 'n' (or be left out): the node returns "
                       "every sample it draws and ranks none away", param="best_of")
    return n


def _inert_fields(body: dict, chat: bool) -> None:
    """Fields accepted because the answer is exactly as asked with them; checked, then dropped.

    `user` and `safety_identifier` name the application's end user: never stored, logged or passed on."""
    for name in ("user", "safety_identifier"):
        value = body.get(name)
        if value is not None and not (isinstance(value, str) and len(value) <= MAX_USER_CHARS):
            raise ApiError(400, "invalid_request", f"'{name}' must be a string of at most {MAX_USER_CHARS} characters",
                           param=name)
    _flag(body, "stream")
    if body.get("store") not in (None, False):
        raise ApiError(400, "unsupported_parameter", "nodes never store completions; leave 'store' out or false",
                       param="store")
    if body.get("metadata") not in (None, {}):
        raise ApiError(400, "unsupported_parameter", "nodes store nothing, so 'metadata' would tag nothing",
                       param="metadata")
    if body.get("service_tier") not in (None, *SERVICE_TIERS):
        raise ApiError(400, "unsupported_parameter", "'service_tier' may only be 'auto' or 'default': nodes "
                       "serve one tier", param="service_tier")
    if chat and body.get("modalities") not in (None, ["text"]):
        raise ApiError(400, "unsupported_parameter", "'modalities' may only be [\"text\"]: nodes generate text only",
                       param="modalities")
    if not chat and body.get("suffix") not in (None, ""):
        raise ApiError(400, "unsupported_parameter", "'suffix' (fill in the middle) is not supported: the "
                       "served model's template has no fill-in-the-middle form", param="suffix")


# ===== Issue 20, engine part: the fields the engine applies. ===========================================
# logit_bias, the penalties and structured outputs (response_format, structured_outputs, guided_*) are
# read in `structured_fields` (tools in `tool_fields`), so that none is ever silently ignored.


def engine_fields(body: dict) -> dict:
    """The SamplingParams keywords for the engine's fields: bias, penalties, the output constraint."""
    return structured_fields.pick_fields(body)


# ===== End of the engine part. ==========================================================================


def _top_k(body: dict) -> int:
    """0 and, as vLLM spells it, -1 both mean no top-k filter."""
    top_k = _number(body, "top_k", int, 0)
    return 0 if top_k == -1 else top_k


def _flag(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is None:  # null is the field left out, as for every other field
        return False
    if not isinstance(value, bool):
        raise ApiError(400, "invalid_request", f"'{name}' must be true or false", param=name)
    return value


def _token_ids(raw: object) -> tuple[int, ...]:
    if raw is None:
        return ()
    if not (isinstance(raw, list) and len(raw) <= MAX_STOP_TOKEN_IDS
            and all(isinstance(t, int) and not isinstance(t, bool) for t in raw)):
        raise ApiError(400, "invalid_request", f"'stop_token_ids' must be a list of at most {MAX_STOP_TOKEN_IDS} token ids",
                       param="stop_token_ids")
    return tuple(raw)


def _chat_logprobs(body: dict) -> int | None:
    """Chat asks with `logprobs: true` and, for alternatives, `top_logprobs: N`; the engine counts the latter."""
    wanted = _flag(body, "logprobs")
    top = _number(body, "top_logprobs", int, None)
    if top is not None and not wanted:
        raise ApiError(400, "invalid_request", "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    return (top or 0) if wanted else None


def _stop_strings(stop: object) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stops: tuple = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    else:
        raise ApiError(400, "invalid_request", "'stop' must be a string or a list of strings", param="stop")
    for text in stops:
        check_unicode(text, "stop")
    return stops


def check_unicode(text: str, param: str | None = None) -> str:
    """JSON can carry lone surrogates, which are not text; the tokenizer must never see them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, "invalid_request", "text must be valid Unicode (no lone surrogates)", param=param) from None
    return text


def _number(body: dict, name: str, kind: type, default):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise ApiError(400, "invalid_request", f"'{name}' must be {'an integer' if kind is int else 'a number'}",
                       param=name)
    return kind(value)


def messages(raw: object) -> list[ChatMessage]:
    if not isinstance(raw, list) or not 0 < len(raw) <= MAX_MESSAGES:
        raise ApiError(400, "invalid_request", f"'messages' must be a list of 1-{MAX_MESSAGES} messages",
                       param="messages")
    return [_message(entry, index) for index, entry in enumerate(raw)]


def _message(entry: object, index: int) -> ChatMessage:
    """One message. An assistant's may call tools (`tool_calls`, content then optional); a tool's result
    names the call it answers (`tool_call_id`)."""
    if not isinstance(entry, dict) or not isinstance(entry.get("role"), str):
        raise _message_error(index, "needs a 'role' and a 'content'")
    role = check_unicode(entry["role"], "messages")
    calls = tool_fields.tool_calls(entry.get("tool_calls")) if role == "assistant" else ()
    if entry.get("content") is None and not calls:
        raise _message_error(index, "needs a 'content' (only an assistant message with 'tool_calls' may have none)")
    content = None if entry.get("content") is None else check_unicode(_text_content(entry["content"]), "messages")
    call_id = entry.get("tool_call_id") if role == "tool" else None
    if role == "tool" and not (isinstance(call_id, str) and call_id):
        raise _message_error(index, "is a 'tool' message without the 'tool_call_id' of the call it answers")
    name = entry.get("name")
    if name is not None and not isinstance(name, str):
        raise _message_error(index, "has a 'name' that is not a string")
    for text in (call_id, name, *(call.id for call in calls)):
        if text is not None:
            check_unicode(text, "messages")
    return ChatMessage(role, content, calls, call_id, name)


def _message_error(index: int, problem: str) -> ApiError:
    return ApiError(400, "invalid_request", f"messages[{index}] {problem}", param="messages")


def _text_content(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: only text parts are supported
        parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if len(parts) == len(content) and all(isinstance(p, str) for p in parts):
            return "".join(parts)
    raise ApiError(400, "invalid_request", "message content must be a string or a list of text parts",
                   param="messages")


def include_usage(body: dict) -> bool:
    """`stream_options.include_usage`, as OpenAI reads it: only with `stream`, a boolean."""
    options = body.get("stream_options")
    if options is None:
        return False
    if body.get("stream") is not True:
        raise ApiError(400, "invalid_request", "'stream_options' is only allowed when 'stream' is true",
                       param="stream_options")
    if not (isinstance(options, dict) and set(options) <= {"include_usage"}
            and isinstance(options.get("include_usage", False), bool)):
        raise ApiError(400, "invalid_request", "'stream_options' must be an object with a boolean 'include_usage'",
                       param="stream_options")
    return options.get("include_usage", False)


def prompt(body: dict) -> str | list[int]:
    """A completions prompt: text or token ids, alone or as a list of one; several prompts are refused."""
    raw = body.get("prompt")
    if isinstance(raw, list) and raw and all(isinstance(p, (str, list)) for p in raw):
        if len(raw) > 1:
            raise ApiError(400, "unsupported_parameter", "'prompt' holds several prompts; send one request per "
                           "prompt", param="prompt")
        raw = raw[0]
    if isinstance(raw, str):
        return check_unicode(raw, "prompt")
    if isinstance(raw, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
        return raw
    raise ApiError(400, "invalid_request", "'prompt' must be a string or a list of token ids", param="prompt")


def echo(body: dict) -> bool:
    """Completions' `echo`: the prompt's text before each completion. Its logprobs would be the prompt's
    too, which the engine does not compute, so the two together are refused."""
    wanted = _flag(body, "echo")
    if wanted and body.get("logprobs") is not None:
        raise ApiError(400, "unsupported_parameter", "'echo' with 'logprobs' is not supported: the node does not "
                       "compute the prompt's logprobs", param="echo")
    return wanted
