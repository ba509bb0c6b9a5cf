"""logit_bias, the penalties and structured outputs at the node's inner API, with a real engine core:
each changes the answer as specified (a JSON schema's answers parse and validate, whole and streamed),
or is refused with a 400 whose `param` names the field and whose message echoes nothing."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import jsonschema
import pytest

from enclave.api import InnerApi
from engine import EngineConfig, Tokenizer
from engine.core_client import EngineCoreClient
from ohttp.bhttp import Request
from tests.engine_models import tiny_model_dir

CANARY = "CANARY-structured-7c2a-TEAL-HERON"
MODEL = "tiny"
CHAT = b"/v1/chat/completions"
COMPLETIONS = b"/v1/completions"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 5},
                                           "rank": {"type": "integer", "minimum": 1, "maximum": 9},
                                           "open": {"type": "boolean"}},
          "required": ["city", "rank", "open"], "additionalProperties": False}


@pytest.fixture(scope="module")
def api() -> Iterator[InnerApi]:
    core = EngineCoreClient(tiny_model_dir(), EngineConfig(kv_cache_gib=0.05, device="cpu"))
    core.start()
    yield InnerApi(core, Tokenizer(tiny_model_dir()), MODEL)
    core.stop()


def post(api: InnerApi, path: bytes, body: dict) -> tuple[int, dict | list[dict]]:
    response = api.handle(Request(b"POST", b"https", b"node", path, [], json.dumps(body).encode()))
    if response.streaming:
        events = b"".join(response.events).split(b"\n\n")
        return response.status, [json.loads(e[6:]) for e in events if e.startswith(b"data: {")]
    return response.status, json.loads(response.body)


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": CANARY}], "max_tokens": 120, "seed": 1, **fields}


def answers(api: InnerApi, body: dict) -> list[tuple[str, str]]:
    status, answer = post(api, CHAT, body)
    assert status == 200, answer
    return [(c["message"]["content"], c["finish_reason"]) for c in answer["choices"]]


def json_schema_format(schema: dict, strict: bool = True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "place", "schema": schema, "strict": strict}}


@pytest.mark.parametrize("field", ["response_format", "guided_json", "structured_outputs"])
def test_json_schema_answers_parse_and_validate(api, field):
    value = {"response_format": json_schema_format(SCHEMA), "guided_json": SCHEMA,
             "structured_outputs": {"json": SCHEMA}}[field]
    for content, reason in answers(api, chat(**{field: value}, n=3, temperature=1.0)):
        assert reason == "stop"
        jsonschema.validate(json.loads(content), SCHEMA)


def test_streamed_json_schema_answers_add_up_to_valid_json(api):
    status, events = post(api, CHAT, chat(response_format=json_schema_format(SCHEMA), n=2, stream=True,
                                          temperature=1.0, logprobs=True))
    assert status == 200
    texts: dict[int, str] = {}
    for event in events:
        for choice in event["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + (choice["delta"].get("content") or "")
    assert sorted(texts) == [0, 1]
    for text in texts.values():
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_regex_and_choice(api):
    for content, reason in answers(api, chat(response_format={"type": "json_object"}, max_tokens=200, n=2,
                                             temperature=1.0)):
        assert reason == "length" or isinstance(json.loads(content), dict)
    for content, _ in answers(api, chat(guided_regex="[A-Z][a-z]{2,5} [0-9]{2}", n=2, temperature=1.0)):
        assert re.fullmatch("[A-Z][a-z]{2,5} [0-9]{2}", content)
    for content, _ in answers(api, chat(guided_choice=["red", "green", "blue"], n=2, temperature=1.0)):
        assert content in ("red", "green", "blue")


def test_logit_bias_and_penalties_change_the_answer(api):
    plain = answers(api, chat(max_tokens=12, temperature=0.0))
    tokenizer = Tokenizer(tiny_model_dir())
    favourite = tokenizer.encode("fox", add_special_tokens=False)[0]
    biased = answers(api, chat(max_tokens=12, temperature=0.0, logit_bias={str(favourite): 100}))
    assert biased != plain and biased[0][0] == tokenizer.decode([favourite] * 12)
    repeated = answers(api, chat(max_tokens=12, temperature=0.0, logit_bias={str(favourite): 5}))
    penalized = answers(api, chat(max_tokens=12, temperature=0.0, logit_bias={str(favourite): 5},
                                  frequency_penalty=2.0, presence_penalty=2.0, repetition_penalty=2.0))
    assert repeated != penalized
    piece = tokenizer.decode([favourite])
    assert penalized[0][0].count(piece) < repeated[0][0].count(piece)


def refused(api: InnerApi, body: dict, param: str) -> str:
    status, answer = post(api, CHAT, body)
    assert status == 400, answer
    error = answer["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert CANARY not in json.dumps(answer) and "SECRET" not in json.dumps(answer)
    return error["message"]


@pytest.mark.parametrize(("fields", "param"), [
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"SECRET": 1}}, "logit_bias"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"),  # outside the vocabulary: the engine refuses it
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}}},
     "response_format"),
    ({"response_format": json_schema_format({"type": "string", "format": "SECRET-format"})}, "response_format"),
    ({"response_format": json_schema_format({"enum": ["SECRET" * 20] * 1000})}, "response_format"),
    ({"guided_regex": "(SECRET"}, "guided_regex"),
    ({"guided_grammar": "start: SECRETRULE"}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs"),
    ({"guided_regex": "a+", "response_format": {"type": "json_object"}}, "guided_regex"),
])
def test_what_cannot_be_served_is_refused_naming_the_field(api, fields, param):
    refused(api, chat(**fields), param)


def test_the_node_keeps_serving_after_a_refused_constraint(api):
    refused(api, chat(guided_regex="(SECRET"), "guided_regex")
    assert answers(api, chat(guided_choice=["yes", "no"]))[0][0] in ("yes", "no")


# ----- a request cannot set llguidance's compile options ("x-guidance") --------------------------------------

# Each would weaken what the node promises of every constrained answer: free whitespace back on, or a keyword
# llguidance does not implement (`uniqueItems`) silently ignored instead of refused by name.
UNIQUE = {"type": "object", "properties": {"SECRET": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}}
PLAIN = {"type": "object", "properties": {"SECRET": {"type": "integer"}}}
# What each option would let through: a schema served before, now spaced freely, or one refused before.
NODE_OPTIONS = [({"whitespace_flexible": True}, PLAIN), ({"lenient": True}, UNIQUE)]


def schema_fields(schema: dict) -> dict[str, dict]:
    """A request's field for each way it can give a JSON schema, and the `param` a refusal names."""
    return {"response_format": {"response_format": json_schema_format(schema)}, "guided_json": {"guided_json": schema},
            "guided_json_text": {"guided_json": json.dumps(schema)}, "structured_outputs": {"structured_outputs": {"json": schema}}}


def refused_before_the_engine(api: InnerApi, monkeypatch, body: dict, param: str) -> str:
    """The refusal's message; the engine is never asked to generate anything for the request."""
    submitted = []
    submit = api.engine.submit
    monkeypatch.setattr(api.engine, "submit", lambda *args, **kwargs: submitted.append(1) or submit(*args, **kwargs))
    message = refused(api, body, param)
    assert submitted == []
    return message


@pytest.mark.parametrize(("options", "schema"), NODE_OPTIONS, ids=["whitespace_flexible", "lenient"])
@pytest.mark.parametrize("way", ["response_format", "guided_json", "guided_json_text", "structured_outputs"])
def test_a_schema_setting_the_nodes_json_options_is_refused_by_name(api, monkeypatch, options, schema, way):
    fields = schema_fields({"x-guidance": options, **schema})[way]
    message = refused_before_the_engine(api, monkeypatch, chat(**fields), way.removesuffix("_text"))
    assert '"x-guidance"' in message
    assert not any(name in message for name in ("whitespace_flexible", "lenient", "uniqueItems", "integer"))


@pytest.mark.parametrize("grammar", [
    "start: %json " + json.dumps({"x-guidance": {"lenient": True}, **UNIQUE}),
    "start: \"SECRET\" | %json" + json.dumps({"type": "object", "x-guidance": {"whitespace_flexible": True}}),
    json.dumps({"grammars": [{"json_schema": {"x-guidance": {"lenient": True}, **UNIQUE}}]}),
    json.dumps({"grammars": [{"lark_grammar": "start: %json {\"x-guidance\": {\"lenient\": true}}"}]}),
], ids=["lark", "lark-alternative", "json-form", "json-form-lark"])
def test_a_grammar_whose_json_part_sets_the_nodes_json_options_is_refused_by_name(api, monkeypatch, grammar):
    for fields, param in (({"guided_grammar": grammar}, "guided_grammar"),
                          ({"structured_outputs": {"grammar": grammar}}, "structured_outputs")):
        message = refused_before_the_engine(api, monkeypatch, chat(**fields), param)
        assert '"x-guidance"' in message and "lenient" not in message and "whitespace" not in message


# llguidance's Lark reads `%llguidance {...}` anywhere in a grammar as its compile options: `allow_invalid_utf8`
# lets a byte regex through (served today: the model may write bytes that are not UTF-8), `no_forcing` and
# `allow_initial_skip` change how the node's grammar is applied. Each is refused by name wherever Lark is given.
INVALID_UTF8 = '%llguidance {"allow_invalid_utf8": true}\nstart: "SECRET" /(?s-u:[\\x80-\\xff])+/'
DIRECTIVE_GRAMMARS = {
    "allow_invalid_utf8": INVALID_UTF8,
    "no_forcing": 'start: "SECRET"\n%llguidance {"no_forcing": true}\n',
    "allow_initial_skip": '  %llguidance{"allow_initial_skip":true}\n%ignore /[ ]+/\nstart: "SECRET"',
    "nested-lark": 'start: %lark {\n%llguidance {"allow_invalid_utf8": true}\nstart: /(?s-u:[\\x80-\\xff])+/\n}',
    "json-form-lark": json.dumps({"grammars": [{"lark_grammar": INVALID_UTF8}]}),
    "json-form-escaped": json.dumps({"grammars": [{"lark_grammar": INVALID_UTF8}]}).replace("%", "\\u0025"),
}


@pytest.mark.parametrize("grammar", DIRECTIVE_GRAMMARS.values(), ids=DIRECTIVE_GRAMMARS)
def test_a_grammar_setting_llguidances_options_by_its_directive_is_refused_by_name(api, monkeypatch, grammar):
    for fields, param in (({"guided_grammar": grammar}, "guided_grammar"),
                          ({"structured_outputs": {"grammar": grammar}}, "structured_outputs")):
        message = refused_before_the_engine(api, monkeypatch, chat(**fields), param)
        assert "%llguidance" in message
        assert not any(name in message for name in ("allow_invalid_utf8", "no_forcing", "allow_initial_skip", "x80"))


def test_the_directives_name_in_a_grammars_literal_or_comment_is_refused_too(api):
    """The check does not parse Lark (see `schema_options`): the name anywhere is refused, naming the field."""
    for grammar in ('start: "%llguidance"', '// %llguidance {}\nstart: "SECRET"'):
        assert "%llguidance" in refused(api, chat(guided_grammar=grammar), "guided_grammar")
    assert answers(api, chat(guided_grammar='start: "%" "llguidance"'))[0][0] == "%llguidance"


def test_options_in_a_subschema_are_not_read_so_the_nodes_still_hold(api):
    """llguidance reads "x-guidance" only at a schema's top level: deeper, it is an annotation like any `x-` key,
    and the keyword it does not implement is still refused by name."""
    nested = {"type": "object", "properties": {"a": {"x-guidance": {"lenient": True}, "type": "array", "uniqueItems": True}}}
    in_defs = {"$defs": {"u": {"x-guidance": {"lenient": True}, "type": "array", "uniqueItems": True}}, "$ref": "#/$defs/u"}
    for schema in (nested, in_defs):
        assert "does not implement" in refused(api, chat(response_format=json_schema_format(schema)), "response_format")
    spaced = {"type": "object", "properties": {"a": {"x-guidance": {"whitespace_flexible": True}, "type": "array",
                                                     "items": {"type": "integer"}, "maxItems": 3}},
              "required": ["a"], "additionalProperties": False}
    for content, reason in answers(api, chat(guided_json=spaced, n=3, temperature=1.0)):
        assert reason == "stop" and not re.search(r"\s", content)  # compact: the node's option
