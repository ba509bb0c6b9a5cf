"""Structured outputs as an OpenAI application asks for them: the real `openai` package through `veil proxy`,
a real gateway and a `veil node` process serving the tiny random-weight model.

Every `json_schema` (strict) answer parses and validates against its schema, for generated schemas
(hypothesis), whole and streamed; `json_object` answers parse; a schema the node cannot serve is a 400
that names `response_format`, kept by the SDK and the `openai` package.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.tiny import write_tiny_model
from tests.openai_support import openai_through_proxy
from tests.test_engine_structured import SCHEMAS

pytestmark = pytest.mark.slow
QUESTION = [{"role": "user", "content": "Describe a place as JSON."}]


@pytest.fixture(scope="module")
def oa(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    root = tmp_path_factory.mktemp("e2e-structured")
    model = write_tiny_model(root / "tiny")
    with openai_through_proxy(model, root) as client:
        yield client


def json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                               HealthCheck.too_slow])
@given(schema=SCHEMAS, seed=st.integers(0, 2**31))
def test_every_strict_json_schema_answer_parses_and_validates(oa: openai.OpenAI, schema: dict, seed: int) -> None:
    wrapped = {"type": "object", "properties": {"answer": schema}, "required": ["answer"], "additionalProperties": False}
    whole = oa.chat.completions.create(model="tiny", messages=QUESTION, response_format=json_schema(wrapped),
                                       max_tokens=400, seed=seed, n=2)
    for choice in whole.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), wrapped)
    chunks = oa.chat.completions.create(model="tiny", messages=QUESTION, response_format=json_schema(wrapped),
                                        max_tokens=400, seed=seed, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(streamed), wrapped)


def test_json_object_answers_parse(oa: openai.OpenAI) -> None:
    answers = oa.chat.completions.create(model="tiny", messages=QUESTION, response_format={"type": "json_object"},
                                         max_tokens=300, seed=4, n=4)
    finished = [c.message.content for c in answers.choices if c.finish_reason == "stop"]
    assert all(isinstance(json.loads(text), dict) for text in finished)


def test_a_schema_the_node_cannot_serve_is_a_400_naming_response_format(oa: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        oa.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=5,
                                   response_format=json_schema({"type": "string", "format": "no-such-format"}))
    assert refused.value.status_code == 400 and refused.value.param == "response_format"
    assert "no-such-format" not in str(refused.value)


@pytest.mark.parametrize("options", [{"whitespace_flexible": True}, {"lenient": True}])
def test_a_schema_setting_the_nodes_json_options_is_a_400_naming_response_format(oa: openai.OpenAI, options) -> None:
    """llguidance's "x-guidance" would set free whitespace or ignore unimplemented keywords for this request."""
    schema = {"type": "object", "properties": {"secret_name": {"type": "integer"}}, "x-guidance": options}
    with pytest.raises(openai.BadRequestError) as refused:
        oa.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=5, response_format=json_schema(schema))
    assert refused.value.status_code == 400 and refused.value.param == "response_format"
    assert '"x-guidance"' in str(refused.value) and "secret_name" not in str(refused.value)
    assert not any(str(name) in str(refused.value) for name in options)


def test_a_grammar_setting_llguidances_options_by_its_directive_is_a_400_naming_the_field(oa: openai.OpenAI) -> None:
    """llguidance's `%llguidance {...}` would let this request's answer hold bytes that are not UTF-8."""
    grammar = '%llguidance {"allow_invalid_utf8": true}\nstart: "secret_name" /(?s-u:[\\x80-\\xff])+/'
    for extra, param in (({"guided_grammar": grammar}, "guided_grammar"),
                         ({"structured_outputs": {"grammar": grammar}}, "structured_outputs")):
        with pytest.raises(openai.BadRequestError) as refused:
            oa.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=5, extra_body=extra)
        assert refused.value.status_code == 400 and refused.value.param == param
        assert "%llguidance" in str(refused.value)
        assert "secret_name" not in str(refused.value) and "allow_invalid_utf8" not in str(refused.value)
