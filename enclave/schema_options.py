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

llguidance's Lark also reads options from the grammar's own text: a `%llguidance {...}` directive, anywhere at a
statement's place, as often as it likes (its docs/syntax.md, "Grammar options"), nested `%lark {...}` grammars
included. Its options are not the JSON ones but the grammar's: `allow_invalid_utf8` (an answer may hold bytes that
are not UTF-8), `no_forcing`, `allow_initial_skip`; so a grammar that carries the directive is refused by name too.
The name is refused anywhere in the text, a string literal's or a comment's too: telling those apart would mean
lexing Lark exactly as llguidance does (its strings, `/regex/`es, `<special>` tokens, JSON bodies, longest match),
and any place this module read as a comment where llguidance reads a statement would let the options through. A
literal can spell the text as `"%" "llguidance"`. The text is read as Lark whatever its form, as well as each part
of llguidance's JSON form where it parses as that: no guess here of which form llguidance takes it for matters.

Each check reads the schema or grammar only; what it cannot parse is left to the engine, which refuses it.
"""

from __future__ import annotations

import json
import re

from engine import JSON_OPTIONS_KEY

OPTIONS_REFUSAL = (f"sets {json.dumps(JSON_OPTIONS_KEY)}, llguidance's compile options, which only this node sets "
                   "(compact JSON; keywords it does not implement refused by name); remove the key")
_JSON_PART = re.compile(r"%json\s*")  # llguidance's Lark lexer reads a JSON value right after `%json`
DIRECTIVE = "%llguidance"  # llguidance's Lark keyword for its grammar options (case-sensitive: `%LLGUIDANCE` fails)
DIRECTIVE_REFUSAL = (f"has {DIRECTIVE}, the directive that sets llguidance's compile options, which only this node "
                     "sets (UTF-8 text only; forced text tokenized as the node does); remove it, from literals and "
                     'comments too (a literal may write "%" "llguidance")')


def schema_sets_options(schema: object) -> bool:
    """Whether a JSON schema (an object, or JSON text of one) sets llguidance's options at its top level."""
    return _sets_options(_parsed(schema))


def grammar_options_refusal(grammar: str) -> str | None:
    """Why a grammar (Lark, or llguidance's JSON form `{"grammars": [...]}`) is refused: it sets llguidance's
    options by a `%llguidance` directive or in a JSON part's "x-guidance"; None where it sets neither."""
    larks, schemas = _grammar_parts(grammar)
    if any(DIRECTIVE in lark for lark in larks):
        return DIRECTIVE_REFUSAL
    if any(_sets_options(schema) for schema in schemas):
        return f"has a JSON part that {OPTIONS_REFUSAL}"
    return None


def _grammar_parts(grammar: str) -> tuple[list[str], list[object]]:
    """The Lark texts of a grammar (itself, and each `lark_grammar` of its JSON form) and its JSON schemas (each
    `json_schema` of the JSON form, each `%json` part of a Lark text)."""
    listed = _parsed(grammar)
    parts = listed.get("grammars") if isinstance(listed, dict) else None
    parts = [part for part in parts if isinstance(part, dict)] if isinstance(parts, list) else []
    larks = [grammar, *(part["lark_grammar"] for part in parts if isinstance(part.get("lark_grammar"), str))]
    schemas = [part.get("json_schema") for part in parts]
    return larks, schemas + [schema for lark in larks for schema in _json_parts(lark)]


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
