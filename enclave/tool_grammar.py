"""The grammars of tool-call answers: a forced choice's JSON list, and calls in a model's own format.

A forced `tool_choice` ("required" or a named function) makes the whole answer a JSON list of calls
(`forced_calls`), read by `tool_calls.ForcedCallsParser`. Under "auto" beside OpenAI's `response_format`
the answer is either calls written as the model's template teaches them (`calls_in_format`, read by
the format's own parser exactly as for plain "auto") or text in the response format: the engine
compiles `start: calls | answer` (`StructuredOutput.alternative`). Either way each call names a
declared function and its arguments are valid against that function's schema, closed as OpenAI's
strict mode reads it (`closed`).

The calls grammars are Lark in llguidance's dialect, their JSON parts `%json{...}` schemas. A marker that
is a special token of the vocabulary (Mistral's `[TOOL_CALLS]`, Llama's `<|python_tag|>`) is named by its
id, `<[id]>`, since a grammar's text never reads as a special token; one that is not (Qwen's `<tool_call>`)
is text, which the model may write as that one added token or in pieces.

A call's JSON is spaced as the model's chat template replays calls (`CALL_JSON_OPTIONS`): a model writes
best what it was trained on, and compact JSON would push it off that at every separator.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from enclave.tool_calls import HERMES, LLAMA_JSON, MISTRAL_ARGS, MISTRAL_JSON, markers
from engine import JSON_OPTIONS, JSON_OPTIONS_KEY, StructuredOutput

MAX_CALLS = 16  # in one answer: bounded, so a bounded schema's answer always ends
_NEWLINE = json.dumps("\n")  # as Lark writes it: "\n"
_ARGUMENTS_KEY = {HERMES: "arguments", LLAMA_JSON: "parameters", MISTRAL_JSON: "arguments"}
GRAMMAR_FORMATS = (*_ARGUMENTS_KEY, MISTRAL_ARGS)  # the call formats `calls_in_format` writes
# Mistral's templates refuse a replayed call id of any other form than 9 letters and digits, and write it in
# every call they replay (`[CALL_ID]` before `[ARGS]`, or "id" after the arguments).
MISTRAL_ID_PATTERN = "[A-Za-z0-9]{9}"
# Every real template renders a replayed call with Jinja's `tojson` (json.dumps' separators): Qwen2.5's and
# Qwen3's Hermes blocks, Llama 3.1-3.3's JSON, Mistral v0.3's and Nemo's `[TOOL_CALLS]` list, Mistral Small
# 3.2's `[ARGS]` all write `{"name": "f", "arguments": {"a": 1, "b": [1, 2]}}`. Still no free whitespace.
CALL_JSON_OPTIONS = {**JSON_OPTIONS, "item_separator": ", ", "key_separator": ": "}


def forced_calls(functions: list[dict], one: bool) -> StructuredOutput:
    """A JSON list of calls to `functions`, each {"name", "parameters"} (one call where `one`)."""
    calls = {"type": "array", "minItems": 1, "maxItems": 1 if one else MAX_CALLS,
             "items": {"anyOf": [call_schema(function, "parameters") for function in functions]},
             JSON_OPTIONS_KEY: CALL_JSON_OPTIONS}
    return StructuredOutput("json_schema", json.dumps(calls), field="tools")  # what a refusal faults


def calls_in_format(functions: list[dict], format: str, one: bool, special: Mapping[str, int]) -> StructuredOutput:
    """Calls to `functions` as `format` writes them (one call where `one`), a Lark grammar that refusals
    name as 'tools'. `special`: the ids of those of the format's markers that are special tokens."""
    most = 1 if one else MAX_CALLS

    def term(marker: str) -> str:
        return f"<[{special[marker]}]>" if marker in special else json.dumps(marker)

    if format == MISTRAL_ARGS:
        calls_marker, args_marker, id_marker = markers(MISTRAL_ARGS)
        written_id = f"({term(id_marker)} /{MISTRAL_ID_PATTERN}/)?"
        shapes = [f"{term(calls_marker)} {json.dumps(function['name'])} {written_id} {term(args_marker)} "
                  f"{_json(_parameters(function))}" for function in functions]
        return _lark(f"start: {_repeated('call', '', most)}\ncall: {' | '.join(shapes)}\n")
    call = {"anyOf": [call_schema(function, _ARGUMENTS_KEY[format], with_id=format == MISTRAL_JSON)
                      for function in functions]}
    if format == HERMES:
        opening, closing = markers(HERMES)
        return _lark(f'start: {_repeated("call", _NEWLINE, most)}\n'
                     f'call: {term(opening)} {_NEWLINE} {_json(call)} {_NEWLINE} {term(closing)}\n')
    if format == LLAMA_JSON:
        [python_tag] = markers(LLAMA_JSON)
        return _lark(f'start: {term(python_tag)}? {_repeated("call", json.dumps("; "), most)}\ncall: {_json(call)}\n')
    [calls_marker] = markers(MISTRAL_JSON)
    listed = {"type": "array", "minItems": 1, "maxItems": most, "items": call}
    return _lark(f'start: {term(calls_marker)} " "? {_json(listed)}\n')


def call_schema(function: dict, arguments_key: str, with_id: bool = False) -> dict:
    """A call to `function`; `with_id`: an optional "id" after the arguments, where Mistral v0.3's template
    replays it (the model was trained to write one; the node gives the client a fresh one all the same)."""
    properties = {"name": {"const": function["name"]}, arguments_key: _parameters(function)}
    if with_id:
        properties["id"] = {"type": "string", "pattern": f"^{MISTRAL_ID_PATTERN}$"}
    return {"type": "object", "properties": properties, "required": ["name", arguments_key],
            "additionalProperties": False}


def _parameters(function: dict) -> object:
    return closed(function.get("parameters") or {"type": "object", "properties": {}})


def _repeated(item: str, separator: str, most: int) -> str:
    """`item` one to `most` times, `separator` (a Lark term, or "") between them."""
    return item if most == 1 else f"{item} ({separator} {item}){{0,{most - 1}}}"


def _json(schema: dict) -> str:
    """A JSON part of a Lark grammar, spaced as templates write calls (no free whitespace)."""
    return "%json" + json.dumps({**schema, JSON_OPTIONS_KEY: CALL_JSON_OPTIONS})


def _lark(grammar: str) -> StructuredOutput:
    return StructuredOutput("grammar", grammar, field="tools")


# The keywords whose values are subschemas (a schema, a list of them, or a mapping of names to them).
# `not` and `if` are left as they are: closing a condition would change what it matches.
_SUBSCHEMA_KEYS = ("items", "prefixItems", "additionalProperties", "anyOf", "oneOf", "then", "else", "contains",
                   "properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed(schema: object, in_all_of: bool = False) -> object:
    """The schema with every object that lists its `properties` and says nothing of others closed to them
    (`additionalProperties: false`), as OpenAI's strict mode and vLLM's default (xgrammar's strict mode) read
    a tool's parameters: otherwise a call may go on writing made-up properties until the context ends.
    The parts of an `allOf` stay open: each holds only some of the object's properties."""
    if isinstance(schema, list):
        return [closed(part, in_all_of) for part in schema]
    if not isinstance(schema, dict):
        return schema
    copy = {key: _closed_value(key, value) for key, value in schema.items()}
    if "allOf" in schema:
        copy["allOf"] = closed(schema["allOf"], in_all_of=True)
    lists_properties = isinstance(schema.get("properties"), dict)
    if lists_properties and not in_all_of and not {"additionalProperties", "unevaluatedProperties"} & set(schema):
        copy["additionalProperties"] = False
    return copy


def _closed_value(key: str, value: object) -> object:
    if key not in _SUBSCHEMA_KEYS:
        return value  # `const`, `enum`, `default`, `examples`: data, never schemas
    if key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas") and isinstance(value, dict):
        return {name: closed(part) for name, part in value.items()}
    return closed(value)
