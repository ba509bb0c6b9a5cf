"""Reading a chat request's `tools`, `tool_choice` and `parallel_tool_calls`, and the tool turns of its messages.

Tools reach the chat template as OpenAI sends them, {"type": "function", "function": {"name",
"description", "parameters", "strict"}}, which is the shape Hugging Face templates render. Every check
names the field that was wrong and never echoes what it held.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from enclave.api_types import ApiError
from enclave.schema_options import OPTIONS_REFUSAL, schema_sets_options
from enclave.tool_calls import FORCED_JSON, tool_format, valid_function_name
from enclave.tool_grammar import GRAMMAR_FORMATS, calls_in_format, forced_calls
from engine import StructuredOutput, ToolCall

MAX_TOOLS = 128
MAX_TOOL_CALLS = 128  # in one assistant message of the conversation
_FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """What the request asks of tools: those the template renders, and how the answer may call them."""

    tools: list[dict] | None = None  # None: no tools (the template renders none)
    choice: str = "none"  # "none", "auto", "required" or "function" (a named one)
    function: str | None = None  # the named function, when choice is "function"
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "function")

    @property
    def names(self) -> frozenset[str]:
        """The functions the request declares: the only names a call read from the answer may have."""
        return frozenset(tool["function"]["name"] for tool in self.tools or ())

    def call_format(self, template: str | None, named: str | None = None) -> str | None:
        """The format the answer's calls are read in; None: none are read. `template`: the chat template;
        `named`: the format the operator named for the model (`veil node --tool-call-format`), which wins."""
        if self.choice == "none":
            return None
        if self.forced:
            return FORCED_JSON
        format = named or tool_format(template)
        if format is None:
            raise ApiError(400, "unsupported_parameter", "this model's chat template shows it no tool-call format "
                           "this node reads, so \"auto\" cannot tell calls from text; use \"required\", a named "
                           "function or \"none\" (or the operator names one: --tool-call-format)", param="tool_choice")
        return format

    def grammar(self) -> StructuredOutput | None:
        """For "required" and a named function: the answer is a JSON list of calls to the given functions,
        each {"name", "parameters"} valid against the function's own schema (one call where only one may be)."""
        if not self.forced:
            return None
        chosen = self._constrained(lambda function: self.function in (None, function["name"]))
        return _nested_safely(lambda: forced_calls(chosen, one=self.function is not None or not self.parallel))

    def beside(self, answer: StructuredOutput, format: str, special: Mapping[str, int]) -> StructuredOutput:
        """For "auto" beside OpenAI's response format (`answer`): the answer is that, or calls in the model's
        `format` (`tool_grammar.calls_in_format`; `special`: the ids of its markers that are special tokens)."""
        if format not in GRAMMAR_FORMATS:
            raise ApiError(400, "unsupported_parameter", "'tool_choice' \"auto\" beside a 'response_format' needs "
                           "a tool-call format this node can constrain; use \"required\", a named function or \"none\"",
                           param="tool_choice")
        functions = self._constrained(lambda function: True)
        calls = _nested_safely(lambda: calls_in_format(functions, format, not self.parallel, special))
        return dataclasses.replace(answer, alternative=calls)

    def _constrained(self, chosen: Callable[[dict], bool]) -> list[dict]:
        """The `chosen` functions, whose parameters a grammar is built from: refused where they set llguidance's
        options (`schema_options`). Parameters no grammar reads are only shown to the model, and left as given."""
        indexed = [(index, tool["function"]) for index, tool in enumerate(self.tools) if chosen(tool["function"])]
        for index, function in indexed:
            if schema_sets_options(function.get("parameters")):
                raise ApiError(400, "invalid_request", f"the parameters of 'tools[{index}]' {OPTIONS_REFUSAL}",
                               param="tools")
        return [function for _, function in indexed]


def _nested_safely(build: Callable[[], StructuredOutput]) -> StructuredOutput:
    try:
        return build()
    except RecursionError:
        raise ApiError(400, "invalid_request", "a function's parameters in 'tools' are nested too deeply",
                       param="tools") from None


def tool_request(body: dict) -> ToolRequest:
    tools = _tools(body.get("tools"))
    parallel = body.get("parallel_tool_calls")
    parallel = True if parallel is None else parallel  # null is the default, as for every optional field
    if not isinstance(parallel, bool):
        raise ApiError(400, "invalid_request", "'parallel_tool_calls' must be true or false", param="parallel_tool_calls")
    choice, function = _choice(body.get("tool_choice"), tools)
    return ToolRequest(tools, choice, function, parallel)


def _tools(raw: object) -> list[dict] | None:
    if raw is None or raw == []:
        return None
    if not isinstance(raw, list) or len(raw) > MAX_TOOLS:
        raise ApiError(400, "invalid_request", f"'tools' must be a list of at most {MAX_TOOLS} tools", param="tools")
    tools = [_tool(entry) for entry in raw]
    names = [tool["function"]["name"] for tool in tools]
    if len(set(names)) != len(names):
        raise ApiError(400, "invalid_request", "'tools' names a function twice", param="tools")
    return tools


def _tool(entry: object) -> dict:
    if not (isinstance(entry, dict) and set(entry) == {"type", "function"} and entry["type"] == "function"
            and isinstance(entry["function"], dict)):
        raise ApiError(400, "invalid_request", "each of 'tools' must be {\"type\": \"function\", \"function\": {...}}",
                       param="tools")
    function = entry["function"]
    problem = _function_problem(function)
    if problem:
        raise ApiError(400, "invalid_request", f"a function in 'tools' {problem}", param="tools")
    return {"type": "function", "function": dict(function)}


def _function_problem(function: dict) -> str | None:
    if not set(function) <= _FUNCTION_KEYS:
        return "has a field other than name, description, parameters and strict"
    if not valid_function_name(function.get("name")):
        return "needs a name of 1-64 letters, digits, underscores or dashes"
    if not isinstance(function.get("description", ""), str):
        return "has a description that is not a string"
    if not isinstance(function.get("parameters", {}), dict):
        return "has parameters that are not a JSON schema object"
    if not isinstance(function.get("strict", False), (bool, type(None))):
        return "has a 'strict' that is not true or false"
    return None


def _choice(raw: object, tools: list[dict] | None) -> tuple[str, str | None]:
    if raw is None:
        return ("auto" if tools else "none"), None
    if raw == "none":
        return "none", None
    if tools is None:
        raise ApiError(400, "invalid_request", "'tool_choice' other than \"none\" needs 'tools'", param="tool_choice")
    if raw in ("auto", "required"):
        return raw, None
    if isinstance(raw, dict) and raw.get("type") == "function" and isinstance(raw.get("function"), dict):
        name = raw["function"].get("name")
        if name in {tool["function"]["name"] for tool in tools}:
            return "function", name
        raise ApiError(400, "invalid_request", "'tool_choice' names a function that is not in 'tools'",
                       param="tool_choice")
    raise ApiError(400, "invalid_request", "'tool_choice' must be \"none\", \"auto\", \"required\" or "
                   "{\"type\": \"function\", \"function\": {\"name\": ...}}", param="tool_choice")


# ----- the tool turns of a conversation ---------------------------------------------------------------

def tool_calls(raw: object) -> tuple[ToolCall, ...]:
    """An assistant message's `tool_calls`, as OpenAI sends them: arguments as JSON text of an object."""
    if raw is None:
        return ()
    if not isinstance(raw, list) or not 0 < len(raw) <= MAX_TOOL_CALLS:
        raise _message_error(f"an assistant message's 'tool_calls' must be a list of 1-{MAX_TOOL_CALLS} calls")
    return tuple(_tool_call(entry) for entry in raw)


def _tool_call(entry: object) -> ToolCall:
    if not (isinstance(entry, dict) and entry.get("type", "function") == "function"
            and isinstance(entry.get("id"), str) and isinstance(entry.get("function"), dict)):
        raise _message_error("each tool call needs an 'id', \"type\": \"function\" and a 'function'")
    function = entry["function"]
    if not valid_function_name(function.get("name")):
        raise _message_error("a tool call's function needs a name of 1-64 letters, digits, underscores or dashes")
    return ToolCall(entry["id"], function["name"], _arguments(function.get("arguments")))


def _arguments(raw: object) -> dict:
    """A replayed call's arguments as the template needs them, a mapping, read as vLLM reads them: JSON text
    of an object, the object itself, or none at all (missing, null or "", as a streamed call of a function
    without parameters leaves them: `{}`). Text that is no JSON object cannot be rendered as one: refused."""
    if raw is None or raw == "":
        return {}
    if isinstance(raw, dict):
        return raw
    try:
        parsed = json.loads(raw) if isinstance(raw, str) else None
    except (ValueError, RecursionError):
        parsed = None
    if not isinstance(parsed, dict):
        raise _message_error("a tool call's 'arguments' must be a JSON object written as a string")
    return parsed


def _message_error(message: str) -> ApiError:
    return ApiError(400, "invalid_request", message, param="messages")
