"""A request cannot set llguidance's compile options: the node's are the only ones.

llguidance reads a JSON schema's top-level "x-guidance" object (`engine.JSON_OPTIONS_KEY`) as options for
compiling it, applied over the node's (`engine.JSON_OPTIONS`): free whitespace back on (`whitespace_flexible`,
`whitespace_pattern`), keywords it does not implement silently ignored instead of refused by name
(`lenient`), other separators or escapes. Each changes what every constrained answer is promised, so a
request's schema that carries the key is refused by name, wherever llguidance would read it: a JSON schema's
top level, and the top level of each JSON part of a grammar (Lark's `%json{...}`, or a `json_schema` of
llguidance's JSON form). Refused rather than overridden: an option dropped in silence would be a field that
changes nothing and says so nowhere. Deeper in a schema (a property's, `$defs`) llguidance does not read the
key (its docs: "only recognized at the top level"; 1.9 ignores it there as it ignores any `x-` annotation),
so the node's options hold there and nothing needs refusing.

Each check reads the schema or grammar only; what it cannot parse is left to the engine, which refuses it.
"""

from __future__ import annotations

import json
import re

from engine import JSON_OPTIONS_KEY

OPTIONS_REFUSAL = (f"sets {json.dumps(JSON_OPTIONS_KEY)}, llguidance's compile options, which only this node sets "
                   "(compact JSON; keywords it does not implement refused by name); remove the key")
_JSON_PART = re.compile(r"%json\s*")  # llguidance's Lark lexer reads a JSON value right after `%json`


def schema_sets_options(schema: object) -> bool:
    """Whether a JSON schema (an object, or JSON text of one) sets llguidance's options at its top level."""
    return _sets_options(_parsed(schema))


def grammar_sets_options(grammar: str) -> bool:
    """Whether a grammar (Lark, or llguidance's JSON form `{"grammars": [...]}`) has a JSON part that sets them."""
    if grammar.lstrip().startswith("{"):  # llguidance's own test: JSON form, else Lark
        listed = _parsed(grammar)
        parts = listed.get("grammars") if isinstance(listed, dict) else None
        return isinstance(parts, list) and any(_part_sets_options(part) for part in parts)
    return _lark_sets_options(grammar)


def _part_sets_options(part: object) -> bool:
    if not isinstance(part, dict):
        return False
    lark = part.get("lark_grammar")
    return _sets_options(part.get("json_schema")) or (isinstance(lark, str) and _lark_sets_options(lark))


def _lark_sets_options(lark: str) -> bool:
    return any(_sets_options(schema) for schema in _json_parts(lark))


def _sets_options(schema: object) -> bool:
    return isinstance(schema, dict) and JSON_OPTIONS_KEY in schema


def _json_parts(lark: str) -> list[object]:
    """The JSON values after each `%json` of a Lark grammar. A `%json` in a comment or a string is read too:
    refusing such a grammar that spells the key is the price of not parsing Lark here."""
    decoder, parts = json.JSONDecoder(), []
    for match in _JSON_PART.finditer(lark):
        try:
            parts.append(decoder.raw_decode(lark, match.end())[0])
        except (ValueError, RecursionError):
            continue  # not JSON: llguidance refuses the grammar itself
    return parts


def _parsed(schema: object) -> object:
    if not isinstance(schema, str):
        return schema
    try:
        return json.loads(schema)
    except (ValueError, RecursionError):
        return None  # not JSON: the engine refuses it, naming the field
