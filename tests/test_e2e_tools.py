"""Tool calling as an OpenAI application does it: the real `openai` package through `veil proxy`, a real
gateway and a `veil node` process serving a tiny random-weight model whose chat template is Qwen-style.

A forced choice ("required", a named function) always yields valid `tool_calls` with finish_reason
"tool_calls", whole and streamed; the calls, sent back with the tools' results, are a conversation the
node accepts and renders; the SDK's types keep every tool field on the way.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest

from engine.tiny import write_tiny_model
from tests.openai_support import openai_through_proxy

pytestmark = pytest.mark.slow
TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
FORECAST = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                             "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "days"], "additionalProperties": False}
NOTHING = {"type": "object", "properties": {}, "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_forecast", "description": "The forecast", "parameters": FORECAST}},
         {"type": "function", "function": {"name": "get_time", "parameters": NOTHING}}]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
QUESTION = [{"role": "user", "content": "What will the weather be in Paris?"}]


@pytest.fixture(scope="module")
def oa(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    root = tmp_path_factory.mktemp("e2e-tools")
    model = write_tiny_model(root / "tiny-qwen")
    shutil.copy(TEMPLATES / "qwen2.5.jinja", model / "chat_template.jinja")
    with openai_through_proxy(model, root) as client:
        yield client


def ask(oa: openai.OpenAI, **fields):
    return oa.chat.completions.create(model="tiny-qwen", messages=fields.pop("messages", QUESTION), tools=TOOLS,
                                      **{"max_tokens": 1000, **fields})


def check_calls(calls, names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_yields_valid_tool_calls_whole_and_streamed(oa: openai.OpenAI) -> None:
    for seed in (1, 2):
        whole = ask(oa, tool_choice="required", seed=seed)
        [choice] = whole.choices
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        check_calls(choice.message.tool_calls, set(SCHEMAS))
        chunks = list(ask(oa, tool_choice="required", seed=seed, stream=True))
        fragments = [call for c in chunks for choice in c.choices for call in choice.delta.tool_calls or []]
        streamed = {}
        for fragment in fragments:  # put together as OpenAI's own stream helpers do
            call = streamed.setdefault(fragment.index, {"name": "", "arguments": ""})
            call["name"] += fragment.function.name or ""
            call["arguments"] += fragment.function.arguments or ""
        assert [streamed[k] for k in sorted(streamed)] == [
            {"name": c.function.name, "arguments": c.function.arguments} for c in choice.message.tool_calls]
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_a_named_choice_calls_that_function(oa: openai.OpenAI) -> None:
    answer = ask(oa, tool_choice={"type": "function", "function": {"name": "get_forecast"}})
    [call] = answer.choices[0].message.tool_calls
    check_calls([call], {"get_forecast"})


def test_a_tool_call_conversation_round_trips(oa: openai.OpenAI) -> None:
    first = ask(oa, tool_choice="required", parallel_tool_calls=False)
    message = first.choices[0].message
    [call] = message.tool_calls
    history = [*QUESTION, message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"forecast": "sunny"})}]
    second = ask(oa, messages=history, tool_choice="none", max_tokens=3, temperature=0)
    assert second.choices[0].message.tool_calls is None and isinstance(second.choices[0].message.content, str)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result are in the prompt


def test_a_malformed_tool_field_is_refused_naming_it(oa: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        ask(oa, tool_choice={"type": "function", "function": {"name": "get_news"}})
    assert raised.value.body["param"] == "tool_choice"


STRICT = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": True}}]
HERMES_CALL = r'Checking\.\n<tool_call>\n\{"name": "get_forecast", "arguments": \{"city": "Oslo", "days": 2\}\}\n</tool_call>'


@pytest.mark.parametrize("fields", [{"tool_choice": "required"}, {"extra_body": {"guided_regex": HERMES_CALL}}])
def test_the_sdk_stream_helper_closes_every_call(oa: openai.OpenAI, fields: dict) -> None:
    """`chat.completions.stream` with a strict tool fires `tool_calls.function.arguments.done` (a forced call,
    and a Hermes call the model wrote after text), with arguments that parse."""
    with oa.chat.completions.stream(model="tiny-qwen", messages=QUESTION, tools=STRICT, max_tokens=1000,
                                    parallel_tool_calls=False, **fields) as stream:
        done = [event for event in stream if event.type == "tool_calls.function.arguments.done"]
        final = stream.get_final_completion()
    [event] = done
    assert event.name == "get_forecast" and event.parsed_arguments == json.loads(event.arguments)
    jsonschema.validate(event.parsed_arguments, FORECAST)
    assert final.choices[0].finish_reason == "tool_calls"


CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
        "additionalProperties": False}
OPEN_ANGLE = "32"  # "<" in the tiny vocabulary: `<tool_call>`'s first token, never one of the JSON answer


@pytest.mark.parametrize(("bias", "calls"), [(100, True), (-100, False)])
def test_auto_beside_a_response_format_calls_or_answers_in_the_format(oa: openai.OpenAI, bias: int, calls: bool) -> None:
    """An Agent with tools and an output type: the model may call (here, made to start `<tool_call>`) or answer
    in the format (made not to), and the SDK reads either as it reads OpenAI's answer."""
    city = {"type": "json_schema", "json_schema": {"name": "city", "strict": True, "schema": CITY}}
    [choice] = ask(oa, tool_choice="auto", response_format=city, logit_bias={OPEN_ANGLE: bias}, seed=1).choices
    if calls:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        check_calls(choice.message.tool_calls, set(SCHEMAS))
    else:
        assert choice.finish_reason == "stop" and not choice.message.tool_calls
        jsonschema.validate(json.loads(choice.message.content), CITY)
