"""OpenAI's Responses API request (`POST /v1/responses`), read into the chat request it asks for.

A Responses request is served as the chat completion it describes: `input` and `instructions` become
the messages, function tools and `tool_choice` their chat forms, `text.format` the `response_format`,
`max_output_tokens` the `max_tokens`. The chat path then applies every field or refuses it by name, so
each guarantee of chat (structured outputs, tools, receipts, no content in any error) holds here too;
`renamed` puts the Responses name of the field into the `param` of a refusal.

Veil keeps nothing past a request, so the API's stateful parts are refused by name and say why:
`store: true`, `previous_response_id`, `conversation`, `background`, stored `prompt` templates and
retrieval by id. Hosted tools (web search, file search, code interpreter, ...) are refused by name:
a node reaches no network and runs no code on a request's behalf.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from enclave.api_types import ApiError

NO_STATE = "no state outlives a request on a Veil node"

# Fields a Responses request may set, and the chat field each becomes (or None: read here).
_CHAT_NAMES = {"max_output_tokens": "max_tokens"}
_PASSED = frozenset({
    "model", "stream", "temperature", "top_p", "parallel_tool_calls", "user", "safety_identifier", "service_tier",
    "max_output_tokens",
    # vLLM's sampling extras, which vLLM's Responses API takes too
    "seed", "stop", "top_k", "min_p", "ignore_eos", "stop_token_ids", "logit_bias", "presence_penalty",
    "frequency_penalty", "repetition_penalty",
})
_READ_HERE = frozenset({"input", "instructions", "tools", "tool_choice", "text", "store", "metadata", "include",
                        "stream_options", "truncation"})

# Set (not null, not false), these are refused: the reason says why.
_STATEFUL = {
    "previous_response_id": f"'previous_response_id' needs the earlier response stored, and {NO_STATE}; "
                            "send the whole conversation in 'input'",
    "conversation": f"'conversation' needs a stored conversation, and {NO_STATE}; send the whole conversation in 'input'",
    "background": f"'background' responses are retrieved later by id, and {NO_STATE}; leave it out or false",
    "prompt": f"stored prompt templates need stored state, and {NO_STATE}; send the text in 'input'",
    "prompt_cache_key": "nodes keep no cache across requests, so there is no cache to key",
    "prompt_cache_retention": "nodes keep no cache across requests, so there is nothing to retain",
    "reasoning": "the served models have no reasoning settings",
    "max_tool_calls": "'max_tool_calls' bounds hosted tool calls, and nodes run no hosted tools",
    "top_logprobs": "/v1/responses does not return logprobs on this node; use /v1/chat/completions",
}
HOSTED_TOOLS = ("web_search", "web_search_preview", "web_search_2025_08_26", "web_search_preview_2025_03_11",
                "file_search", "code_interpreter", "computer_use_preview", "computer", "image_generation", "mcp",
                "local_shell", "shell", "apply_patch", "custom")
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text", "text")
_PARAMS = (("response_format.json_schema", "text.format"), ("response_format", "text.format"),
           ("messages", "input"), ("max_completion_tokens", "max_output_tokens"), ("max_tokens", "max_output_tokens"))


@dataclass(slots=True)
class ResponsesCall:
    """The chat body a Responses request asks for, and what its answer repeats of the request."""

    chat: dict
    echo: dict = field(default_factory=dict)  # the request's settings as the Response object states them
    stream: bool = False


def translate(body: dict) -> ResponsesCall:
    """The chat request for a Responses `body`; refuses by name what the node cannot serve as asked."""
    _check_names(body)
    _refuse_state(body)
    chat = {_CHAT_NAMES.get(name, name): value for name, value in body.items() if name in _PASSED}
    chat["messages"] = _instructions(body.get("instructions")) + input_messages(body.get("input"))
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    text_format = _text_format(body.get("text"))
    if text_format is not None:
        chat["response_format"] = text_format
    stream = body.get("stream") is True
    if stream:
        _check_stream_options(body.get("stream_options"))
        chat["stream_options"] = {"include_usage": True}  # the last event, response.completed, states the usage
    return ResponsesCall(chat, _echo(body), stream)


def renamed(error: ApiError) -> ApiError:
    """A chat refusal with the Responses name of its field in `param`."""
    for chat_name, responses_name in _PARAMS:
        if error.param is not None and (error.param == chat_name or error.param.startswith(chat_name + ".")):
            error.param = responses_name + error.param[len(chat_name):]
            break
    return error


def _check_names(body: dict) -> None:
    for name in body:
        if name in _PASSED or name in _READ_HERE or name in _STATEFUL:
            continue
        if name.isidentifier() and name.isascii() and name.islower() and len(name) <= 64:
            raise ApiError(400, "unknown_parameter", f"unrecognized request argument '{name}': not a Responses "
                           "field this node knows", param=name)
        raise ApiError(400, "unknown_parameter", "the request has a field that is not a Responses field "
                       "(its name is not shown: it is not a plain field name)")


def _refuse_state(body: dict) -> None:
    if body.get("store") not in (None, False):
        raise ApiError(400, "unsupported_parameter", f"'store' must be false or left out: {NO_STATE}, so a "
                       "response cannot be stored or retrieved later", param="store")
    for name, reason in _STATEFUL.items():
        if body.get(name) not in (None, False):
            raise ApiError(400, "unsupported_parameter", reason, param=name)
    if body.get("metadata") not in (None, {}):
        raise ApiError(400, "unsupported_parameter", "nodes store nothing, so 'metadata' would tag nothing",
                       param="metadata")
    if body.get("include") not in (None, []):
        raise ApiError(400, "unsupported_parameter", "'include' asks for extra outputs (logprobs, hosted tools' "
                       "results) this node does not return", param="include")
    if body.get("truncation") not in (None, "disabled"):
        raise ApiError(400, "unsupported_parameter", "'truncation' may only be \"disabled\": the node never drops "
                       "part of the input", param="truncation")


def _check_stream_options(options: object) -> None:
    if options is None:
        return
    if not (isinstance(options, dict) and set(options) <= {"include_obfuscation"}
            and options.get("include_obfuscation") in (None, False)):
        raise ApiError(400, "unsupported_parameter", "'stream_options' may only set include_obfuscation to false: "
                       "the node does not pad stream events", param="stream_options")


# ----- input and instructions --------------------------------------------------------------------

def _instructions(raw: object) -> list[dict]:
    if raw is None:
        return []
    if not isinstance(raw, str):
        raise ApiError(400, "invalid_request", "'instructions' must be a string", param="instructions")
    return [{"role": "system", "content": raw}]


def input_messages(raw: object) -> list[dict]:
    """`input` as chat messages: a string is one user message; a list holds messages and function
    calls with their outputs (consecutive calls become one assistant message, as chat sends them)."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise _input_error("'input' must be a string or a non-empty list of items")
    messages: list[dict] = []
    for item in raw:
        if not isinstance(item, dict):
            raise _input_error("each item of 'input' must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item))
        elif kind == "function_call":
            _add_call(messages, _call(item))
        elif kind == "function_call_output":
            messages.append(_call_output(item))
        else:
            raise _input_error("an item of 'input' has a type this node does not take: only message, "
                               "function_call and function_call_output items")
    return messages


def _message(item: dict) -> dict:
    role = _ROLES.get(item.get("role"))
    if role is None:
        raise _input_error("a message of 'input' needs a role: user, assistant, system or developer")
    return {"role": role, "content": _text(item.get("content"))}


def _text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") in _TEXT_PARTS]
        if len(texts) == len(content) and all(isinstance(t, str) for t in texts):
            return "".join(texts)
    raise _input_error("a message's content must be a string or a list of input_text/output_text parts "
                       "(nodes read text only)")


def _call(item: dict) -> dict:
    call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
    if not (isinstance(call_id, str) and call_id and isinstance(name, str) and isinstance(arguments, str)):
        raise _input_error("a function_call item needs a 'call_id', a 'name' and 'arguments' as a string")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _add_call(messages: list[dict], call: dict) -> None:
    """A call joins the assistant turn just before it (its text, or the calls before it), as chat's
    assistant message holds content and tool_calls together."""
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
        return
    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _call_output(item: dict) -> dict:
    call_id = item.get("call_id")
    if not (isinstance(call_id, str) and call_id):
        raise _input_error("a function_call_output item needs the 'call_id' of the call it answers")
    return {"role": "tool", "tool_call_id": call_id, "content": _text(item.get("output"))}


def _input_error(message: str) -> ApiError:
    return ApiError(400, "invalid_request", message, param="input")


# ----- tools, tool_choice, text.format -----------------------------------------------------------

def _tools(raw: object) -> list[dict]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ApiError(400, "invalid_request", "'tools' must be a list of function tools", param="tools")
    return [_tool(entry) for entry in raw]


def _tool(entry: object) -> dict:
    kind = entry.get("type") if isinstance(entry, dict) else None
    if kind in HOSTED_TOOLS:
        raise ApiError(400, "unsupported_parameter", f"the hosted tool '{kind}' is not supported: a node reaches no "
                       "network and runs no code on a request's behalf; use function tools", param="tools")
    if kind != "function":
        raise ApiError(400, "invalid_request", "each of 'tools' must be a function tool: {\"type\": \"function\", "
                       "\"name\": ..., \"parameters\": {...}}", param="tools")
    function = {key: value for key, value in entry.items() if key != "type" and value is not None}
    return {"type": "function", "function": function}


def _tool_choice(raw: object) -> object:
    if raw in ("none", "auto", "required"):
        return raw
    if isinstance(raw, dict) and raw.get("type") == "function" and set(raw) <= {"type", "name"}:
        return {"type": "function", "function": {"name": raw.get("name")}}
    if isinstance(raw, dict) and raw.get("type") in HOSTED_TOOLS:
        raise ApiError(400, "unsupported_parameter", f"'tool_choice' names the hosted tool '{raw['type']}', which "
                       "nodes do not run", param="tool_choice")
    raise ApiError(400, "invalid_request", "'tool_choice' must be \"none\", \"auto\", \"required\" or "
                   "{\"type\": \"function\", \"name\": ...}", param="tool_choice")


def _text_format(raw: object) -> dict | None:
    """`text.format` as chat's `response_format`: json_schema's fields sit beside its type here."""
    if raw is None:
        return None
    if not (isinstance(raw, dict) and set(raw) <= {"format", "verbosity"}):
        raise ApiError(400, "invalid_request", "'text' must be an object with a 'format'", param="text")
    if raw.get("verbosity") is not None:
        raise ApiError(400, "unsupported_parameter", "the served models have no verbosity setting",
                       param="text.verbosity")
    form = raw.get("format")
    if form is None:
        return None
    if isinstance(form, dict) and form.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: v for k, v in form.items() if k != "type"}}
    return form  # text and json_object have the same shape in both APIs; chat refuses anything else


def _echo(body: dict) -> dict:
    """What the Response object repeats of its request (OpenAI's defaults where it was left out)."""
    tools = [dict(tool) for tool in body.get("tools") or []]
    default_choice = "auto" if tools else "none"
    text = body.get("text") or {}
    return {
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
        "temperature": body.get("temperature") if body.get("temperature") is not None else 1.0,
        "top_p": body.get("top_p") if body.get("top_p") is not None else 1.0,
        "tool_choice": body.get("tool_choice") or default_choice,
        "tools": tools,
        "text": {"format": text.get("format") or {"type": "text"}},
        "store": False,
        "background": False,
        "previous_response_id": None,
        "reasoning": None,
        "truncation": "disabled",
        "metadata": {},
        "service_tier": "default",
        "user": body.get("user"),
    }
