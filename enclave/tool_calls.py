"""Tool calls read out of a model's text in its family's own format, as OpenAI's `tool_calls`.

Which format a model writes is read from its chat template (`tool_format`): a template that shows the
model `<tool_call>` tags gets the Hermes parser (Qwen2.5, Qwen3 and other Hermes-style models: each
call a `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` block); a template with Llama 3.1's
ipython environment and `"parameters"` gets the Llama JSON parser (the whole answer one JSON object
`{"name": ..., "parameters": {...}}`, or several joined by ";"); a template with Mistral's
`[TOOL_CALLS]` gets the Mistral parser (a JSON list of `{"name", "arguments"}` after that marker). Any
other template has no format this node reads, so `tool_choice: "auto"` is refused for it.

One parser per sample reads the text as it streams (`ToolCallParser.feed`, then `finish`); a whole
answer is the same parser fed at once, so a streamed answer's pieces always add up to the whole one.
A call is given out when its text is complete and parses; text that does not parse stays content.
Each call's id is random, never derived from what the call says.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field

HERMES, LLAMA_JSON, MISTRAL_JSON, FORCED_JSON = "hermes", "llama3_json", "mistral_json", "forced_json"
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG, _MISTRAL_CALLS = "<|python_tag|>", "[TOOL_CALLS]"


def tool_format(template: str | None) -> str | None:
    """The call format a chat template teaches its model; None when it teaches none this node reads."""
    if not template:
        return None
    if _OPEN in template:
        return HERMES
    if _MISTRAL_CALLS in template:
        return MISTRAL_JSON
    if '"parameters"' in template and (_PYTHON_TAG in template or "ipython" in template):
        return LLAMA_JSON
    return None


@dataclass(frozen=True, slots=True)
class ParsedCall:
    """One call, in OpenAI's terms: `arguments` is the arguments object as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))

    def openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def __repr__(self) -> str:
        return f"ParsedCall({len(self.arguments)} characters of arguments)"


@dataclass(slots=True)
class Parsed:
    """What a piece of text turned into: content to show, and the calls completed within it."""

    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)

    def extend(self, other: Parsed) -> None:
        self.content += other.content
        self.calls.extend(other.calls)


def parser_for(format: str | None) -> ToolCallParser | None:
    if format == HERMES:
        return HermesParser()
    if format == LLAMA_JSON:
        return JsonAnswerParser("parameters", prefix=_PYTHON_TAG)
    if format == MISTRAL_JSON:
        return JsonAnswerParser("arguments", prefix=_MISTRAL_CALLS, allow_list=True)
    if format == FORCED_JSON:
        return JsonAnswerParser("parameters", allow_list=True)
    return None


def parse_whole(format: str, text: str) -> Parsed:
    parser = parser_for(format)
    parsed = parser.feed(text)
    parsed.extend(parser.finish())
    return parsed


class ChoiceCalls:
    """One choice's tool calls: its parser, the calls given out so far, and `parallel_tool_calls: false`
    (only the first call is kept)."""

    def __init__(self, format: str, parallel: bool = True) -> None:
        self._parser = parser_for(format)
        self._parallel = parallel
        self.count = 0  # calls given out: the next one's index within the choice

    def read(self, text: str, last: bool) -> Parsed:
        parsed = self._parser.feed(text)
        if last:
            parsed.extend(self._parser.finish())
        if not self._parallel:
            parsed.calls = parsed.calls[: max(0, 1 - self.count)]
        self.count += len(parsed.calls)
        return parsed

    def fragments(self, calls: list[ParsedCall]) -> list[dict]:
        """The calls as streamed `delta.tool_calls` entries, numbered within the choice (after `read`)."""
        first = self.count - len(calls)
        return [{"index": first + k, **call.openai()} for k, call in enumerate(calls)]

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's "tool_calls" where the answer ended on its own after calling."""
        return "tool_calls" if self.count and reason == "stop" else reason


class ToolCallParser:
    """Reads one sample's text, piece by piece."""

    def feed(self, text: str) -> Parsed:
        raise NotImplementedError

    def finish(self) -> Parsed:
        """The end of the text: whatever was held back, as content or a last call."""
        raise NotImplementedError


class HermesParser(ToolCallParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks among plain text.

    Whitespace next to a call is layout, not content: it waits until what follows it is known."""

    def __init__(self) -> None:
        self._pending = ""  # text not given out yet: a possible start of a tag, whitespace, an open block
        self._gap = ""  # the whitespace before the open block: dropped if the block is a call
        self._in_call = False
        self._called = False

    def feed(self, text: str) -> Parsed:
        self._pending += text
        parsed = Parsed()
        while self._advance(parsed):
            pass
        return parsed

    def finish(self) -> Parsed:
        if self._in_call:  # the model may stop right after its last call, without the closing tag
            body, self._pending, self._in_call = self._pending, "", False
            return self._block(body, "")
        rest, self._pending = self._pending, ""
        return Parsed(rest.rstrip() if self._called else rest)

    def _advance(self, parsed: Parsed) -> bool:
        """Gives out what the pending text settles; True while there may be more to settle."""
        if self._in_call:
            end = self._pending.find(_CLOSE)
            if end < 0:
                return False
            parsed.extend(self._block(self._pending[:end], _CLOSE))
            self._pending, self._in_call = self._pending[end + len(_CLOSE):], False
            return True
        start = self._pending.find(_OPEN)
        settled = self._pending[:_safe_end(self._pending, _OPEN) if start < 0 else start]
        content = settled.rstrip()
        parsed.content += content
        if start < 0:
            self._pending = self._pending[len(content):]
            return False
        self._gap = settled[len(content):]
        self._pending, self._in_call = self._pending[start + len(_OPEN):], True
        return True

    def _block(self, body: str, closing: str) -> Parsed:
        call = _call(body, "arguments")
        gap, self._gap = self._gap, ""
        if call is None:
            return Parsed(gap + _OPEN + body + closing)
        self._called = True
        return Parsed("", [call])


class JsonAnswerParser(ToolCallParser):
    """An answer that is JSON calls as a whole, perhaps after a marker (Llama 3.1's `<|python_tag|>`,
    Mistral's `[TOOL_CALLS]` list, a forced list): decided at the end.

    Text that starts otherwise is content from its first character on, and streams as such."""

    def __init__(self, arguments_key: str, prefix: str = "", allow_list: bool = False) -> None:
        self._key, self._prefix, self._allow_list = arguments_key, prefix, allow_list
        self._held = ""
        self._mode: str | None = None  # None: undecided; "content" or "json"

    def feed(self, text: str) -> Parsed:
        if self._mode == "content":
            return Parsed(text)
        self._held += text
        if self._mode == "json":
            return Parsed()
        body = _unmarked(self._held, self._prefix)
        if not body or (self._prefix.startswith(body) and body[0] not in "{["):
            return Parsed()  # nothing tells yet
        if body[0] in "{[":
            self._mode = "json"
            return Parsed()
        self._mode = "content"
        held, self._held = self._held, ""
        return Parsed(held)

    def finish(self) -> Parsed:
        held, self._held = self._held, ""
        body = _unmarked(held, self._prefix).rstrip()
        calls = _json_calls(body, self._key, self._allow_list) if self._mode == "json" else None
        return Parsed("", calls) if calls else Parsed(held)


def _unmarked(text: str, prefix: str) -> str:
    body = text.lstrip()
    return body[len(prefix):].lstrip() if prefix and body.startswith(prefix) else body


def _json_calls(body: str, key: str, allow_list: bool) -> list[ParsedCall] | None:
    value = _json(body)
    if isinstance(value, list) and allow_list:
        calls = [_call_of(entry, key) for entry in value]
    elif isinstance(value, dict):
        calls = [_call_of(value, key)]
    else:  # Llama writes several calls joined by ";"
        calls = [_call(part, key) for part in body.split(";")] if ";" in body else [None]
    return calls if calls and all(c is not None for c in calls) else None


def _call(body: str, key: str) -> ParsedCall | None:
    value = _json(body.strip())
    return _call_of(value, key) if isinstance(value, dict) else None


def _call_of(value: object, key: str) -> ParsedCall | None:
    """{"name": str, key: object} as a call; "arguments" and "parameters" are both read, as models mix them."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get(key, value.get("arguments" if key == "parameters" else "parameters", {}))
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _json(text: str) -> object:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _safe_end(text: str, tag: str) -> int:
    """How much of `text` cannot be the start of `tag`: the rest is held until the next piece tells."""
    for keep in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-keep:]):
            return len(text) - keep
    return len(text)


_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def valid_function_name(name: object) -> bool:
    """OpenAI's rule for a function's name."""
    return isinstance(name, str) and _NAME.fullmatch(name) is not None
