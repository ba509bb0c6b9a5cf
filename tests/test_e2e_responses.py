"""The Responses API end to end: the real `openai` package's `client.responses` through `veil proxy`, and the
SDK's, against a one-node fleet whose node serves its model under two ids (`--model-name` given twice)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import openai
import pytest
from pydantic import BaseModel

from client.errors import NodeError
from client.sdk import Client
from engine.tiny import write_tiny_model
from tests.openai_support import openai_client, sdk_and_proxy

pytestmark = pytest.mark.slow
MODEL, ALIAS = "tiny-responses", "gpt-4o-mini"
TOOL = {"type": "function", "name": "get_weather", "description": "the weather in a city", "strict": True,
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                       "required": ["city"], "additionalProperties": False}}


class City(BaseModel):
    city: Literal["Paris", "Rome"]


@dataclass
class World:
    sdk: Client
    oa: openai.OpenAI


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    root = tmp_path_factory.mktemp("e2e-responses")
    with sdk_and_proxy(write_tiny_model(root / "tiny"), root, model_names=(MODEL,),
                       extra_node_args=("--model-name", ALIAS)) as (sdk, proxy_url):
        yield World(sdk, openai_client(proxy_url))


def test_openai_package_responses_whole_and_streamed(world: World) -> None:
    whole = world.oa.responses.create(model=MODEL, input="Hello", instructions="be brief", max_output_tokens=5,
                                    extra_body={"ignore_eos": True})
    assert whole.output_text and whole.usage.output_tokens == 5 and whole.store is False
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    # A constrained answer completes (an incomplete one has no final response in the SDK's stream helper).
    with world.oa.responses.stream(model=MODEL, input="which city?", text_format=City, max_output_tokens=40,
                                   temperature=0) as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text and final.output_parsed.city in ("Paris", "Rome")
    assert final.usage.total_tokens == final.usage.input_tokens + final.usage.output_tokens


def test_openai_package_function_tool_round_trip(world: World) -> None:
    first = world.oa.responses.create(model=MODEL, input="weather?", tools=[TOOL], tool_choice="required",
                                      max_output_tokens=60)
    [call] = first.output
    assert call.type == "function_call" and json.loads(call.arguments)["city"] in ("Paris", "Rome")
    streamed = world.oa.responses.create(model=MODEL, input="weather?", tools=[TOOL], tool_choice="required",
                                         max_output_tokens=60, stream=True)
    done = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and json.loads(done[0].arguments)["city"] in ("Paris", "Rome")
    conversation = [{"role": "user", "content": "weather?"}, call.model_dump(exclude_none=True),
                    {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    second = world.oa.responses.create(model=MODEL, input=conversation, tools=[TOOL], max_output_tokens=4,
                                       extra_body={"ignore_eos": True})
    assert second.status == "incomplete" and second.output[0].type == "message"


def test_openai_package_parses_a_json_schema_text_format(world: World) -> None:
    parsed = world.oa.responses.parse(model=MODEL, input="which city?", text_format=City, max_output_tokens=40)
    assert parsed.output_parsed.city in ("Paris", "Rome")


@pytest.mark.parametrize(("fields", "param"), [({"store": True}, "store"),
                                               ({"previous_response_id": "resp_1"}, "previous_response_id")])
def test_openai_package_sees_stateful_fields_refused_by_name(world: World, fields: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        world.oa.responses.create(model=MODEL, input="Hello", **fields)
    assert refused.value.param == param and "no state outlives a request" in refused.value.message


def test_the_sdk_serves_responses_and_routes_by_an_alias(world: World) -> None:
    whole = world.sdk.responses.create(model=ALIAS, input="Hello", max_output_tokens=3, ignore_eos=True)
    assert whole.model == MODEL and whole.receipt is not None and whole.output_text
    with world.sdk.responses.create(model=ALIAS, input="Hello", max_output_tokens=3, stream=True,
                                    ignore_eos=True) as stream:
        kinds = [event.type for event in stream]
    assert kinds[0] == "response.created" and kinds[-1] == "response.incomplete" and stream.receipt is not None
    assert {m.id for m in world.sdk.models.list().data} == {MODEL, ALIAS}
    with pytest.raises(NodeError) as refused:
        world.sdk.responses.create(model=ALIAS, input="Hello", store=True)
    assert refused.value.param == "store"


def test_openai_package_chat_without_max_tokens_runs_past_128_tokens(world: World) -> None:
    answer = world.oa.chat.completions.create(model=ALIAS, messages=[{"role": "user", "content": "Hello"}],
                                              extra_body={"ignore_eos": True})
    assert answer.usage.completion_tokens > 128 and answer.model == MODEL
