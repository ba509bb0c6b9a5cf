"""Every field of OpenAI's chat and completions requests: applied, or refused by name, and why.

A field this node does not apply is never silently dropped: it is refused with a 400 whose `param`
names it, as OpenAI refuses a field it does not know. `request_fields` applies the rest. A value that
changes nothing (`store: false`, `modalities: ["text"]`, `service_tier: "auto"`) is accepted, since the
answer is then exactly what was asked for.
"""

from __future__ import annotations

import re

from enclave.api_types import ApiError

# Applied by `request_fields` on both endpoints: OpenAI's names, then vLLM's sampling extras.
_COMMON = frozenset({
    "model", "stream", "stream_options", "n", "temperature", "top_p", "max_tokens", "stop", "seed", "logprobs",
    "user", "service_tier", "store", "metadata",
    "top_k", "min_p", "stop_token_ids", "ignore_eos",
})
CHAT_ONLY = frozenset({"messages", "top_logprobs", "max_completion_tokens", "modalities", "safety_identifier",
                       "tools", "tool_choice", "parallel_tool_calls",  # `tool_fields` reads these three
                       "chat_template_kwargs", "reasoning_effort"})  # `template_fields` reads these two
COMPLETIONS_ONLY = frozenset({"prompt", "echo", "best_of", "suffix"})

# The engine part of issue 20 applies these; `request_fields.engine_fields` reads them (one place).
ENGINE_FIELDS = frozenset({
    "logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
})

# Fields OpenAI defines that this node refuses whenever they are set (not null), and why.
REFUSED = {
    "audio": "audio output is not supported: nodes generate text only",
    "prediction": "predicted outputs are not supported",
    "verbosity": "the served models have no verbosity setting",
    "web_search_options": "web search is not supported: a node reaches no network on a request's behalf",
    "functions": "'functions' is deprecated and not supported; use 'tools'",
    "function_call": "'function_call' is deprecated and not supported; use 'tool_choice'",
    "prompt_cache_key": "nodes keep no cache across requests, so there is no cache to key",
}

# An unknown field's name is shown only if it looks like a field name: anything else could be content.
_FIELD_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")


def check_names(body: dict, chat: bool) -> None:
    """Refuses the first field that is unknown, belongs to the other endpoint, or is set and refused."""
    own = _COMMON | (CHAT_ONLY if chat else COMPLETIONS_ONLY)
    for name, value in body.items():
        if name in own or name in ENGINE_FIELDS:
            continue
        if name in REFUSED:
            if value is not None:
                raise ApiError(400, "unsupported_parameter", REFUSED[name], param=name)
            continue
        raise _unknown(name, chat)


def _unknown(name: str, chat: bool) -> ApiError:
    endpoint = "chat completions" if chat else "completions"
    if not _FIELD_NAME.fullmatch(name):
        return ApiError(400, "unknown_parameter", f"the request has a field that is not a {endpoint} field "
                        "(its name is not shown: it is not a plain field name)")
    return ApiError(400, "unknown_parameter", f"unrecognized request argument '{name}': not a {endpoint} field "
                    "this node knows", param=name)
