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
A Hermes call that names its function first is given out as it streams: its id and name as soon as
the name is read, then its arguments as the model writes them (the model's own text, which, as with
OpenAI's, may not parse). Any other call is given out whole once its text is complete and parses;
text that does not parse stays content. Each call's id is random, never derived from the call.
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


@dataclass(slots=True)
class ParsedCall:
    """One whole call, in OpenAI's terms: `arguments` is the arguments object's JSON text."""

    name: str
    arguments: str
    id: str

    def openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def __repr__(self) -> str:
        return f"ParsedCall({len(self.arguments)} characters of arguments)"


@dataclass(slots=True)
class CallPiece:
    """A part of one call as it streams: the first names it (id, name), every one adds to its arguments."""

    call: int  # which call of the answer, from 0
    arguments: str = ""
    name: str | None = None
    id: str | None = None

    def fragment(self) -> dict:
        """OpenAI's streamed `delta.tool_calls` entry."""
        if self.name is None:
            return {"index": self.call, "function": {"arguments": self.arguments}}
        return {"index": self.call, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}

    def __repr__(self) -> str:
        return f"CallPiece(call {self.call}, {len(self.arguments)} characters of arguments)"


def _new_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass(slots=True)
class Parsed:
    """What a piece of text turned into: content to show, and pieces of calls."""

    content: str = ""
    pieces: list[CallPiece] = field(default_factory=list)

    def extend(self, other: Parsed) -> None:
        self.content += other.content
        self.pieces.extend(other.pieces)

    @property
    def calls(self) -> list[ParsedCall]:
        """The calls the pieces make up (whole when the pieces are all of an answer's)."""
        calls: dict[int, ParsedCall] = {}
        for piece in self.pieces:
            call = calls.setdefault(piece.call, ParsedCall(piece.name or "", "", piece.id or ""))
            call.arguments += piece.arguments
        return [calls[index] for index in sorted(calls)]


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
    """One choice's tool calls: its parser, whether it has called, and `parallel_tool_calls: false`
    (only the first call is kept)."""

    def __init__(self, format: str, parallel: bool = True) -> None:
        self._parser = parser_for(format)
        self._parallel = parallel
        self.called = False

    def read(self, text: str, last: bool) -> Parsed:
        parsed = self._parser.feed(text)
        if last:
            parsed.extend(self._parser.finish())
        if not self._parallel:
            parsed.pieces = [piece for piece in parsed.pieces if piece.call == 0]
        self.called = self.called or bool(parsed.pieces)
        return parsed

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's "tool_calls" where the answer ended on its own after calling."""
        return "tool_calls" if self.called and reason == "stop" else reason


class ToolCallParser:
    """Reads one sample's text, piece by piece."""

    def __init__(self) -> None:
        self._calls = 0  # calls begun

    def feed(self, text: str) -> Parsed:
        raise NotImplementedError

    def finish(self) -> Parsed:
        """The end of the text: whatever was held back, as content or a last call."""
        raise NotImplementedError

    def _whole(self, call: ParsedCall) -> CallPiece:
        self._calls += 1
        return CallPiece(self._calls - 1, call.arguments, call.name, call.id)


# A Hermes call whose name comes first: its arguments stream as the model writes them.
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,\s*"arguments"\s*:\s*(?=\{)')


class HermesParser(ToolCallParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks among plain text.

    A block that begins `{"name": "...", "arguments": {` is a call from there on: its id and name are
    given out at once and its arguments' text as it comes, all but what may be the block's own closing
    brace; a block in any other shape is read whole at its end, and stays content if it is not a call.
    Whitespace next to a call is layout, not content: it waits until what follows it is known."""

    def __init__(self) -> None:
        super().__init__()
        self._pending = ""  # text not given out yet: a possible start of a tag, whitespace, an open block
        self._gap = ""  # the whitespace before the open block: dropped if the block is a call
        self._in_call = False
        self._called = False
        self._arguments_at: int | None = None  # where the open block's arguments begin, once its name is read
        self._sent = 0  # how far into the open block its arguments have been given out

    def feed(self, text: str) -> Parsed:
        self._pending += text
        parsed = Parsed()
        while self._advance(parsed):
            pass
        return parsed

    def finish(self) -> Parsed:
        if self._in_call:  # the model may stop right after its last call, without the closing tag
            body, self._pending, self._in_call = self._pending, "", False
            parsed = Parsed()
            self._begin(body, parsed)
            parsed.extend(self._end(body, ""))
            return parsed
        rest, self._pending = self._pending, ""
        return Parsed(rest.rstrip() if self._called else rest)

    def _advance(self, parsed: Parsed) -> bool:
        """Gives out what the pending text settles; True while there may be more to settle."""
        if self._in_call:
            end = self._pending.find(_CLOSE)
            body = self._pending if end < 0 else self._pending[:end]
            self._begin(body, parsed)
            if end < 0:
                self._stream(body, parsed)
                return False
            parsed.extend(self._end(body, _CLOSE))
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

    def _begin(self, body: str, parsed: Parsed) -> None:
        """Names the call as soon as the open block shows its name and the start of its arguments."""
        header = None if self._arguments_at is not None else _HEADER.match(body)
        if header is None:
            return
        self._arguments_at = self._sent = header.end()
        self._called = True
        parsed.pieces.append(self._whole(ParsedCall(header.group(1), "", _new_id())))

    def _stream(self, body: str, parsed: Parsed) -> None:
        if self._arguments_at is None:
            return
        end = self._arguments_end(body, final=False)
        if end > self._sent:
            parsed.pieces.append(CallPiece(self._calls - 1, body[self._sent:end]))
            self._sent = end

    def _arguments_end(self, body: str, final: bool) -> int:
        """Where the arguments end, as far as `body` tells: before its last "}" (perhaps the block's own),
        never on whitespace (perhaps before that brace) nor on a part of the closing tag."""
        brace = body.rfind("}", self._arguments_at)
        end = brace if brace >= 0 else (len(body) if final else _safe_end(body, _CLOSE))
        return self._arguments_at + len(body[self._arguments_at:end].rstrip())

    def _end(self, body: str, closing: str) -> Parsed:
        gap, self._gap = self._gap, ""
        if self._arguments_at is not None:  # named already: the rest of its arguments
            end = max(self._arguments_end(body, final=True), self._sent)
            rest = body[self._sent:end]
            self._arguments_at = None
            return Parsed("", [CallPiece(self._calls - 1, rest)] if rest else [])
        call = _call(body, "arguments")
        if call is None:
            return Parsed(gap + _OPEN + body + closing)
        self._called = True
        return Parsed("", [self._whole(call)])


class JsonAnswerParser(ToolCallParser):
    """An answer that is JSON calls as a whole, perhaps after a marker (Llama 3.1's `<|python_tag|>`,
    Mistral's `[TOOL_CALLS]` list, a forced list): decided at the end.

    Text that starts otherwise is content from its first character on, and streams as such."""

    def __init__(self, arguments_key: str, prefix: str = "", allow_list: bool = False) -> None:
        super().__init__()
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
        return Parsed("", [self._whole(call) for call in calls]) if calls else Parsed(held)


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
    return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False), _new_id())


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
