"""Tool calls read out of a model's text in its family's own format, as OpenAI's `tool_calls`.

Which format a model writes is read from its chat template (`tool_format`), or named by the operator
(`veil node --tool-call-format`, one of `FORMATS`): a template that shows the model `<tool_call>` tags
gets the Hermes parser (Qwen2.5, Qwen3 and other Hermes-style models: each call a
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` block); a template with Llama 3.1's ipython
environment and `"parameters"` gets the Llama JSON parser (the whole answer one JSON object
`{"name": ..., "parameters": {...}}`, or several joined by ";"); a template with Mistral's
`[TOOL_CALLS]` gets the Mistral parser: `[TOOL_CALLS]name[ARGS]{...}` per call where the template
writes `[ARGS]` (Mistral Small 3.x), else the older JSON list of `{"name", "arguments"}` after that
marker (Mistral 7B v0.3, Nemo). Any other template has no format this node reads, so
`tool_choice: "auto"` is refused for it unless the operator names one.

One parser per sample reads the text as it streams (`ToolCallParser.feed`, then `finish`); a whole
answer is the same parser fed at once, so a streamed answer's pieces always add up to the whole one.
A call the model chose to write is given out once its text is complete and parses (text that does not
parse stays content, as vLLM keeps it), so every call's arguments are a JSON object. A call a forced
`tool_choice` wrote always parses (its grammar says so), so it is given out as it is written: its name
first, then its arguments piece by piece, as OpenAI streams them. Each call's id is random, never
derived from the call.

A call is one only to a function the request declared in `tools` (`ChoiceCalls(declared=...)`): text naming
any other is not a call, and stays content as written, as text that does not parse does. A client is never
handed a `tool_calls` entry for a function it did not offer (which agent frameworks dispatch wrongly or fail
on), and an answer whose only "calls" are such text ends "stop", not "tool_calls". Where one answer must be
all calls (Llama JSON, Mistral), one undeclared name makes the whole answer content.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass, field

HERMES, LLAMA_JSON, MISTRAL_JSON, MISTRAL_ARGS = "hermes", "llama3_json", "mistral_json", "mistral_args"
FORCED_JSON = "forced_json"
FORMATS = (HERMES, LLAMA_JSON, MISTRAL_JSON, MISTRAL_ARGS)  # the formats an operator may name for a model
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_ID_CHARACTERS = string.ascii_letters + string.digits
_PYTHON_TAG, _MISTRAL_CALLS, _MISTRAL_ARGS, _MISTRAL_CALL_ID = "<|python_tag|>", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"


def markers(format: str | None) -> tuple[str, ...]:
    """The tokens a format's calls are read by: kept in the text its parser reads, where special tokens
    are otherwise left out (`[TOOL_CALLS]` and `<|python_tag|>` are special in their vocabularies)."""
    return {HERMES: (_OPEN, _CLOSE), LLAMA_JSON: (_PYTHON_TAG,), MISTRAL_JSON: (_MISTRAL_CALLS,),
            MISTRAL_ARGS: (_MISTRAL_CALLS, _MISTRAL_ARGS, _MISTRAL_CALL_ID)}.get(format, ())


def tool_format(template: str | None) -> str | None:
    """The call format a chat template teaches its model; None when it teaches none this node reads."""
    if not template:
        return None
    if _OPEN in template:
        return HERMES
    if _MISTRAL_CALLS in template:
        return MISTRAL_ARGS if _MISTRAL_ARGS in template else MISTRAL_JSON
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


def _new_id(family: str | None = None) -> str:
    """A new call's random id, in the form the family's template reads back in the next turn: Mistral's
    templates refuse any id but 9 letters and digits (vLLM's Mistral ids too); others, OpenAI's form."""
    if family in (MISTRAL_JSON, MISTRAL_ARGS):
        return "".join(secrets.choice(_ID_CHARACTERS) for _ in range(9))
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
    if format == MISTRAL_ARGS:
        return MistralArgsParser()
    if format == FORCED_JSON:
        return ForcedCallsParser()
    return None


def parse_whole(format: str, text: str) -> Parsed:
    parser = parser_for(format)
    parsed = parser.feed(text)
    parsed.extend(parser.finish())
    return parsed


class ChoiceCalls:
    """One choice's tool calls: its parser, whether it has called, and `parallel_tool_calls: false`
    (only the first call is kept)."""

    def __init__(self, format: str, parallel: bool = True, id_family: str | None = None,
                 declared: frozenset[str] | None = None) -> None:
        """`id_family`: the tool-call format of the model's template, whose id form the calls take (the
        format the answer is read in where None). `declared`: the names of the functions the request offers,
        the only ones a call may name (None: any name, where a grammar already allows only those)."""
        self._parser = parser_for(format)
        self._parser.id_family = id_family or format
        self._parser.declared = declared
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

    id_family: str | None = None  # the template's tool-call format: the form of the ids it gives calls
    declared: frozenset[str] | None = None  # the functions the request offers; None: any name

    def __init__(self) -> None:
        self._calls = 0  # calls begun

    def feed(self, text: str) -> Parsed:
        raise NotImplementedError

    def finish(self) -> Parsed:
        """The end of the text: whatever was held back, as content or a last call."""
        raise NotImplementedError

    def _settle(self) -> Parsed:
        """What the text read so far settles, step by step (`_advance`: True while there may be more)."""
        parsed = Parsed()
        while self._advance(parsed):
            pass
        return parsed

    def _advance(self, parsed: Parsed) -> bool:
        raise NotImplementedError

    def _offered(self, calls: list[ParsedCall]) -> bool:
        """Whether every one of `calls` names a function the request offers."""
        return self.declared is None or all(call.name in self.declared for call in calls)

    def _named(self, name: str) -> CallPiece:
        """The first piece of a new call: its id and name, as OpenAI's stream names a call first."""
        self._calls += 1
        return CallPiece(self._calls - 1, "", name, _new_id(self.id_family))

    def _whole(self, calls: list[ParsedCall]) -> list[CallPiece]:
        """Whole calls as OpenAI streams them: each named, then its arguments."""
        pieces = []
        for call in calls:
            pieces.append(self._named(call.name))
            pieces.append(CallPiece(self._calls - 1, call.arguments))
        return pieces


class HermesParser(ToolCallParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks among plain text.

    Each block is read whole at its closing tag (or at the end of the text, where a model stopped right
    after its last call) and is a call only if it parses as one naming a declared function; otherwise it
    stays content, tags and all, as vLLM keeps text that does not parse. Whitespace next to a call is layout, not content: it waits until what follows it
    is known."""

    def __init__(self) -> None:
        super().__init__()
        self._pending = ""  # text not given out yet: a possible start of a tag, whitespace, an open block
        self._gap = ""  # the whitespace before the open block: dropped if the block is a call
        self._in_call = False
        self._called = False

    def feed(self, text: str) -> Parsed:
        self._pending += text
        return self._settle()

    def finish(self) -> Parsed:
        if self._in_call:  # the model may stop right after its last call, without the closing tag
            body, self._pending, self._in_call = self._pending, "", False
            return self._end(body, "")
        rest, self._pending = self._pending, ""
        return Parsed(rest.rstrip() if self._called else rest)

    def _advance(self, parsed: Parsed) -> bool:
        """Gives out what the pending text settles; True while there may be more to settle."""
        if self._in_call:
            end = self._pending.find(_CLOSE)
            if end < 0:
                return False
            parsed.extend(self._end(self._pending[:end], _CLOSE))
            self._pending, self._in_call = self._pending[end + len(_CLOSE):], False
            return True
        start = self._pending.find(_OPEN)
        settled = self._pending[:safe_end(self._pending, _OPEN) if start < 0 else start]
        content = settled.rstrip()
        parsed.content += content
        if start < 0:
            self._pending = self._pending[len(content):]
            return False
        self._gap = settled[len(content):]
        self._pending, self._in_call = self._pending[start + len(_OPEN):], True
        return True

    def _end(self, body: str, closing: str) -> Parsed:
        gap, self._gap = self._gap, ""
        call = _call(body, "arguments")
        if call is None or not self._offered([call]):
            return Parsed(gap + _OPEN + body + closing)
        self._called = True
        return Parsed("", self._whole([call]))


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
        return Parsed("", self._whole(calls)) if calls and self._offered(calls) else Parsed(held)


class MistralArgsParser(ToolCallParser):
    """Mistral Small 3.x: `[TOOL_CALLS]name[ARGS]{...}` per call (`[CALL_ID]id` between them accepted), after
    any text. Text before the first marker streams as content; from the marker on, the rest is decided at
    the end: calls if it is nothing but calls, else content as written."""

    def __init__(self) -> None:
        super().__init__()
        self._pending = ""
        self._calling = False  # the marker was read: the rest waits for the end

    def feed(self, text: str) -> Parsed:
        self._pending += text
        if self._calling:
            return Parsed()
        start = self._pending.find(_MISTRAL_CALLS)
        settled = self._pending[:safe_end(self._pending, _MISTRAL_CALLS) if start < 0 else start]
        content = settled.rstrip()  # whitespace before a call is layout: it waits for what follows
        self._pending, self._calling = self._pending[len(content):], start >= 0
        return Parsed(content)

    def finish(self) -> Parsed:
        held, self._pending = self._pending, ""
        calls = _marked_calls(held.strip()) if self._calling else None
        return Parsed("", self._whole(calls)) if calls and self._offered(calls) else Parsed(held)


_MARKED_CALL = re.compile(r"\[TOOL_CALLS\]\s*([A-Za-z0-9_-]{1,64})\s*(?:\[CALL_ID\]\s*[A-Za-z0-9]{1,64}\s*)?\[ARGS\]\s*")


def _marked_calls(body: str) -> list[ParsedCall] | None:
    """`body` as nothing but `[TOOL_CALLS]name[ARGS]{...}` calls; None if it is anything else."""
    calls, at = [], 0
    while at < len(body):
        marker = _MARKED_CALL.match(body, at)
        if marker is None:
            return None
        arguments, at = _decoded(body, marker.end())
        if not isinstance(arguments, dict):
            return None
        calls.append(ParsedCall(marker.group(1), json.dumps(arguments, ensure_ascii=False), _new_id()))
        at = _skip_space(body, at)
    return calls or None


class ForcedCallsParser(ToolCallParser):
    """The answer a forced `tool_choice` allows: `[{"name": ..., "parameters": {...}}, ...]`, in that key order
    (the grammar keeps the schema's). The grammar guarantees it parses, so each call is given out as it is
    written: named as soon as its name is read, then its arguments' own text piece by piece, up to the
    brace that closes them."""

    def __init__(self) -> None:
        super().__init__()
        self._text = ""
        self._at = 0  # how far the text is read: given out, or structure between calls
        self._arguments: _ObjectScan | None = None  # the open call's arguments, while they are written

    def feed(self, text: str) -> Parsed:
        self._text += text
        return self._settle()

    def finish(self) -> Parsed:
        # No call at all: the answer stopped before its first name (a length limit); it is content.
        return Parsed() if self._calls else Parsed(self._text)

    def _advance(self, parsed: Parsed) -> bool:
        if self._arguments is None:
            header = _FORCED_HEADER.match(self._text, self._at)
            if header is None:
                return False
            parsed.pieces.append(self._named(header.group(1)))
            self._at, self._arguments = header.end(), _ObjectScan(header.end())
            return True
        end = self._arguments.end(self._text)
        stop = len(self._text) if end is None else end
        if stop > self._at:
            parsed.pieces.append(CallPiece(self._calls - 1, self._text[self._at:stop]))
            self._at = stop
        if end is None:
            return False
        self._arguments = None
        return True


# A forced call's start: the list's and the previous call's punctuation, then its name and the arguments' brace.
_FORCED_HEADER = re.compile(r'[\s\[\],}]*\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,\s*"parameters"\s*:\s*(?=\{)')


@dataclass(slots=True)
class _ObjectScan:
    """Finds where a JSON object ends as its text streams in: brackets counted outside strings."""

    scanned: int  # how far the text is read: at first, the object's opening brace
    depth: int = 0
    in_string: bool = False
    escaped: bool = False

    def end(self, text: str) -> int | None:
        """Index just past the object's closing brace; None while it is still open."""
        for index in range(self.scanned, len(text)):
            if self._closes(text[index]):
                return index + 1
        self.scanned = len(text)
        return None

    def _closes(self, char: str) -> bool:
        if self.in_string:
            self.escaped, self.in_string = (False, True) if self.escaped else (char == "\\", char != '"')
            return False
        if char == '"':
            self.in_string = True
        elif char in "{[":
            self.depth += 1
        elif char in "}]":
            self.depth -= 1
            return self.depth == 0
        return False


def _unmarked(text: str, prefix: str) -> str:
    body = text.lstrip()
    return body[len(prefix):].lstrip() if prefix and body.startswith(prefix) else body


def _json_calls(body: str, key: str, allow_list: bool) -> list[ParsedCall] | None:
    """One call, a list of calls (`allow_list`), or several calls joined by ";" as Llama writes them."""
    values = _json_sequence(body, ";")
    if values is None:
        return None
    entries = values[0] if len(values) == 1 and isinstance(values[0], list) and allow_list else values
    calls = [_call_of(entry, key) for entry in entries]
    return calls if calls and all(c is not None for c in calls) else None


def _json_sequence(body: str, separator: str) -> list[object] | None:
    """JSON values one after another, `separator` between them (which may also occur inside a string)."""
    values, at = [], 0
    while True:
        value, at = _decoded(body, _skip_space(body, at))
        if at < 0:
            return None
        values.append(value)
        at = _skip_space(body, at)
        if at == len(body):
            return values
        if not body.startswith(separator, at):
            return None
        at += len(separator)


_DECODER = json.JSONDecoder()


def _decoded(text: str, at: int) -> tuple[object, int]:
    """The JSON value starting at `at` and the index after it; (None, -1) if none starts there."""
    try:
        return _DECODER.raw_decode(text, at)
    except (ValueError, RecursionError):
        return None, -1


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


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


def safe_end(text: str, tag: str) -> int:
    """How much of `text` cannot be the start of `tag`: the rest is held until the next piece tells."""
    for keep in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-keep:]):
            return len(text) - keep
    return len(text)


_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def valid_function_name(name: object) -> bool:
    """OpenAI's rule for a function's name."""
    return isinstance(name, str) and _NAME.fullmatch(name) is not None
