"""Reading the fields the engine applies to picks: logit_bias, the penalties, and output constraints.

Constraints come from OpenAI's `response_format` (`json_object`, `json_schema`), vLLM's
`structured_outputs` (`json`, `regex`, `choice`, `grammar`, `json_object`) and its older `guided_json`,
`guided_regex`, `guided_choice` and `guided_grammar`; a request may give one of them. A grammar is
Lark in llguidance's dialect (not GBNF). A forced tool call (`tool_choice` "required" or a named
function) is a constraint too, built by `tool_fields`; under "auto" a `response_format` gets the model's
tool-call format as its alternative (`tool_grammar`). The engine compiles each constraint for its request alone (`engine.structured`); here only the shape
of the fields is checked, and that no schema or grammar sets llguidance's compile options (`schema_options`).
Every check names the field and never echoes what it held.
"""

from __future__ import annotations

import json
import re

from engine import StructuredOutput
from enclave.api_types import ApiError
from enclave.schema_options import OPTIONS_REFUSAL, grammar_options_refusal, schema_sets_options

PENALTY_RANGE = (-2.0, 2.0)
MAX_REPETITION_PENALTY = 2.0
_TOKEN_ID = re.compile(r"[0-9]{1,9}")
_SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
_STRUCTURED_OUTPUTS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}


def pick_fields(body: dict) -> dict:
    """The SamplingParams keywords of logit_bias, the penalties and the request's one output constraint."""
    return {
        "logit_bias": logit_bias(body.get("logit_bias")),
        "presence_penalty": penalty(body, "presence_penalty"),
        "frequency_penalty": penalty(body, "frequency_penalty"),
        "repetition_penalty": repetition_penalty(body),
        "structured": constraint(body),
    }


def logit_bias(raw: object) -> tuple[tuple[int, float], ...]:
    """OpenAI's map of token ids (as JSON keys: decimal strings) to a bias in [-100, 100]."""
    if raw is None:
        return ()
    if not isinstance(raw, dict):
        raise _invalid("logit_bias", "must be an object mapping token ids to numbers between -100 and 100")
    pairs = []
    for key, value in raw.items():
        if not (isinstance(key, str) and _TOKEN_ID.fullmatch(key)):
            raise _invalid("logit_bias", "keys must be token ids written as decimal integers")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise _invalid("logit_bias", "values must be numbers between -100 and 100")
        pairs.append((int(key), float(value)))
    return tuple(pairs)  # the engine refuses ids outside the model's vocabulary, naming logit_bias


def penalty(body: dict, name: str) -> float:
    value = _number(body, name, 0.0)
    low, high = PENALTY_RANGE
    if not low <= value <= high:
        raise _invalid(name, f"must be between {low:g} and {high:g}")
    return value


def repetition_penalty(body: dict) -> float:
    value = _number(body, "repetition_penalty", 1.0)
    if not 0.0 < value <= MAX_REPETITION_PENALTY:
        raise _invalid("repetition_penalty", f"must be in (0, {MAX_REPETITION_PENALTY:g}]")
    return value


def constraint(body: dict) -> StructuredOutput | None:
    """The request's output constraint; None when it asks for plain text."""
    found = [c for c in (_response_format(body.get("response_format")),
                         _structured_outputs(body.get("structured_outputs")),
                         *(_guided(name, kind, body.get(name)) for name, kind in _GUIDED.items())) if c is not None]
    if len(found) > 1:
        raise ApiError(400, "invalid_request", "give at most one output constraint: 'response_format', "
                       "'structured_outputs' or one 'guided_*' field", param=found[1].field.split(".")[0])
    return found[0] if found else None


def _response_format(raw: object) -> StructuredOutput | None:
    if raw is None:
        return None
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind == "text" and set(raw) == {"type"}:
        return None
    if kind == "json_object" and set(raw) == {"type"}:
        return StructuredOutput("json_object", "", "response_format")
    if kind == "json_schema" and set(raw) == {"type", "json_schema"}:
        return _json_schema(raw["json_schema"])
    raise _invalid("response_format", "must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                   "{\"type\": \"json_schema\", \"json_schema\": {...}}")


def _json_schema(raw: object) -> StructuredOutput:
    """OpenAI's {"name", "schema", "strict", "description"}: the schema is enforced whatever `strict` says."""
    field = "response_format.json_schema"
    if not isinstance(raw, dict) or not set(raw) <= {"name", "schema", "strict", "description"}:
        raise _invalid(field, "must be an object with 'name', 'schema' and optionally 'strict' and 'description'")
    if not (isinstance(raw.get("name"), str) and _SCHEMA_NAME.fullmatch(raw["name"])):
        raise _invalid(field, "needs a 'name' of 1-64 letters, digits, underscores or dashes")
    if not isinstance(raw.get("strict", False), (bool, type(None))) or not isinstance(raw.get("description", ""), str):
        raise _invalid(field, "has a 'strict' that is not true or false, or a 'description' that is not a string")
    return _schema(raw.get("schema", {"type": "object"}), f"{field}.schema")


def _structured_outputs(raw: object) -> StructuredOutput | None:
    """vLLM's `structured_outputs`: one of json, regex, choice, grammar, or json_object: true."""
    if raw is None:
        return None
    given = {k: v for k, v in raw.items() if v is not None and v is not False} if isinstance(raw, dict) else None
    if given is None or not set(given) <= {*_STRUCTURED_OUTPUTS, "json_object"} or len(given) != 1:
        raise _invalid("structured_outputs", "must give exactly one of 'json', 'regex', 'choice', 'grammar' "
                       "or 'json_object': true")
    (key, value), = given.items()
    if key == "json_object":
        if value is not True:
            raise _invalid("structured_outputs.json_object", "must be true")
        return StructuredOutput("json_object", "", "structured_outputs.json_object")
    return _guided(f"structured_outputs.{key}", _STRUCTURED_OUTPUTS[key], value)


def _guided(field: str, kind: str, value: object) -> StructuredOutput | None:
    if value is None:
        return None
    if kind == "json_schema":
        return _schema(value, field)
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
            raise _invalid(field, "must be a non-empty list of non-empty strings")
        return StructuredOutput("choice", json.dumps(value), field)
    if not (isinstance(value, str) and value):
        raise _invalid(field, "must be a non-empty string")
    refusal = grammar_options_refusal(value) if kind == "grammar" else None
    if refusal is not None:
        raise _invalid(field, refusal)
    return StructuredOutput(kind, value, field)


def _schema(value: object, field: str) -> StructuredOutput:
    """A JSON schema given as an object, or (vLLM) as JSON text of one."""
    if schema_sets_options(value):
        raise _invalid(field, OPTIONS_REFUSAL)
    if isinstance(value, str):
        return StructuredOutput("json_schema", value, field)  # parsed, bounded and compiled by the engine
    if not isinstance(value, dict):
        raise _invalid(field, "must be a JSON schema object")
    try:
        return StructuredOutput("json_schema", json.dumps(value), field)
    except (ValueError, RecursionError):  # nested past what the encoder handles: over any sane bound
        raise _invalid(field, "is nested too deeply") from None


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _invalid(name, "must be a number")
    return float(value)


def _invalid(field: str, problem: str) -> ApiError:
    return ApiError(400, "invalid_request", f"'{field}' {problem}", param=field.split(".")[0])
