"""The request fields that reach the chat template: `chat_template_kwargs` and `reasoning_effort`.

`chat_template_kwargs` passes named settings to the template as vLLM does (Qwen3's `enable_thinking`),
but only the keys listed here, each of a known type: a template is code, and any other variable it
reads could change how it renders the conversation in ways no one reviewed. Another key is refused
by name. `reasoning_effort` reaches the template where the template reads it (gpt-oss style), and is
refused by name where it does not, since it would otherwise change nothing.
"""

from __future__ import annotations

import re

from enclave.api_types import ApiError

# The template variables a request may set, and the type each must have.
TEMPLATE_KWARGS: dict[str, type] = {"enable_thinking": bool, "thinking": bool}
REASONING_EFFORTS = ("low", "medium", "high")
_PLAIN_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


def template_kwargs(body: dict, template: str | None) -> dict:
    """The variables the chat template renders with, beyond the conversation and the tools."""
    kwargs = _chat_template_kwargs(body.get("chat_template_kwargs"))
    effort = body.get("reasoning_effort")
    if effort is not None:
        kwargs["reasoning_effort"] = _reasoning_effort(effort, template)
    return kwargs


def _chat_template_kwargs(raw: object) -> dict:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ApiError(400, "invalid_request", "'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    for name, value in raw.items():
        if name not in TEMPLATE_KWARGS:
            shown = f"'{name}' " if _PLAIN_NAME.fullmatch(name) else ""  # anything else could be content
            raise ApiError(400, "unsupported_parameter", f"'chat_template_kwargs' key {shown}is not one this node "
                           f"passes to templates; allowed: {', '.join(TEMPLATE_KWARGS)}", param="chat_template_kwargs")
        if not isinstance(value, TEMPLATE_KWARGS[name]):
            raise ApiError(400, "invalid_request", f"'chat_template_kwargs.{name}' must be true or false",
                           param="chat_template_kwargs")
    return dict(raw)


def _reasoning_effort(effort: object, template: str | None) -> str:
    if effort not in REASONING_EFFORTS:
        raise ApiError(400, "invalid_request", f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}",
                       param="reasoning_effort")
    if not template or "reasoning_effort" not in template:
        raise ApiError(400, "unsupported_parameter", "this model's chat template has no reasoning-effort setting",
                       param="reasoning_effort")
    return effort
