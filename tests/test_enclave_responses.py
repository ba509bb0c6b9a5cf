"""OpenAI's Responses API at the node's inner API, with a real engine core: served as the chat completion it
describes, answered in the Responses shapes (whole and as its event stream), its stateful parts and hosted
tools refused by name; a request without `max_tokens` may use the rest of the context; model aliases."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from enclave.api import InnerApi
from engine import EngineConfig, Tokenizer
from engine.core_client import EngineCoreClient
from ohttp.bhttp import Request
from tests.engine_models import tiny_model_dir
from tests.test_enclave_fields import CANARY, chat, refused

RESPONSES = b"/v1/responses"
ALIAS = "gpt-4o-mini"
CITY_TOOL = {"type": "function", "name": "get_weather", "description": "the weather in a city",
             "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                            "required": ["city"], "additionalProperties": False}}
CITY_FORMAT = {"type": "json_schema", "name": "city", "strict": True,
               "schema": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                          "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def api() -> Iterator[InnerApi]:
    # A short context, so that an answer running to its end (no max_tokens) is a few hundred tokens, not 2,000.
    core = EngineCoreClient(tiny_model_dir(), EngineConfig(kv_cache_gib=0.05, device="cpu", max_model_len=640))
    core.start()
    yield InnerApi(core, Tokenizer(tiny_model_dir()), "tiny", aliases=(ALIAS,))
    core.stop()


def post(api: InnerApi, path: bytes, body: dict) -> tuple[int, object]:
    response = api.handle(Request(b"POST", b"https", b"node", path, [], json.dumps(body).encode()))
    if response.streaming:
        return response.status, b"".join(response.events)
    return response.status, json.loads(response.body)


def respond(**fields) -> dict:
    return {"model": "tiny", "input": CANARY, "max_output_tokens": 4, "seed": 1, **fields}


def events(raw: bytes) -> list[dict]:
    """The payloads of a Responses stream, each checked to carry its type as the SSE event's name."""
    payloads = []
    for event in raw.split(b"\n\n"):
        lines = event.split(b"\n")
        if lines[0].startswith(b"event: "):
            payload = json.loads(lines[1].removeprefix(b"data: "))
            assert lines[0] == b"event: " + payload["type"].encode()
            payloads.append(payload)
    assert raw.endswith(b"data: [DONE]\n\n")  # the end Veil's client checks for truncation
    return payloads


# ----- whole and streamed -----------------------------------------------------------------------------

def test_a_response_is_the_chat_answer_in_the_responses_shape(api) -> None:
    status, whole = post(api, RESPONSES, respond(instructions="be brief", temperature=0))
    _, answer = post(api, b"/v1/chat/completions", chat(
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": CANARY}],
        max_tokens=4, temperature=0))
    assert status == 200 and whole["object"] == "response" and whole["id"].startswith("resp_")
    [message] = whole["output"]
    assert message["type"] == "message" and message["role"] == "assistant"
    assert message["content"][0]["text"] == answer["choices"][0]["message"]["content"]
    assert whole["status"] == "incomplete" and whole["incomplete_details"] == {"reason": "max_output_tokens"}
    assert whole["usage"]["output_tokens"] == 4 and whole["usage"]["input_tokens"] == answer["usage"]["prompt_tokens"]
    assert whole["store"] is False and whole["instructions"] == "be brief"
    assert CANARY not in json.dumps({k: v for k, v in whole.items() if k != "output"})


def test_a_streamed_response_is_the_responses_event_stream_adding_up_to_the_whole(api) -> None:
    status, raw = post(api, RESPONSES, respond(stream=True, temperature=0))
    _, whole = post(api, RESPONSES, respond(temperature=0))
    payloads = events(raw)
    kinds = [p["type"] for p in payloads]
    assert status == 200 and kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                                           "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [p["sequence_number"] for p in payloads] == list(range(len(payloads)))
    text = "".join(p["delta"] for p in payloads if p["type"] == "response.output_text.delta")
    last = payloads[-1]["response"]
    assert text == whole["output"][0]["content"][0]["text"] == last["output"][0]["content"][0]["text"]
    assert last["usage"] == whole["usage"]


def test_a_function_call_and_its_output_make_a_round_trip(api) -> None:
    # One call, so that it ends within the limit: the random model may otherwise go on to write a second one.
    status, first = post(api, RESPONSES, respond(tools=[CITY_TOOL], tool_choice="required", max_output_tokens=60,
                                                 parallel_tool_calls=False))
    [call] = first["output"]
    assert status == 200 and call["type"] == "function_call" and call["name"] == "get_weather"
    assert json.loads(call["arguments"])["city"] in ("Paris", "Rome") and first["status"] == "completed"
    conversation = [{"role": "user", "content": CANARY}, call,
                    {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}]
    status, second = post(api, RESPONSES, respond(input=conversation, tools=[CITY_TOOL]))
    assert status == 200 and second["output"][0]["type"] == "message"


def test_a_streamed_function_call_has_its_argument_events(api) -> None:
    status, raw = post(api, RESPONSES, respond(tools=[CITY_TOOL], tool_choice={"type": "function", "name": "get_weather"},
                                               max_output_tokens=60, stream=True))
    payloads = events(raw)
    deltas = "".join(p["delta"] for p in payloads if p["type"] == "response.function_call_arguments.delta")
    [done] = [p for p in payloads if p["type"] == "response.function_call_arguments.done"]
    assert status == 200 and deltas == done["arguments"] and json.loads(deltas)["city"] in ("Paris", "Rome")
    assert payloads[-1]["type"] == "response.completed"
    assert payloads[-1]["response"]["output"][0]["arguments"] == deltas


def test_text_format_json_schema_constrains_the_answer(api) -> None:
    status, whole = post(api, RESPONSES, respond(text={"format": CITY_FORMAT}, max_output_tokens=40))
    assert status == 200 and json.loads(whole["output"][0]["content"][0]["text"])["city"] in ("Paris", "Rome")
    assert whole["text"] == {"format": CITY_FORMAT}


# ----- refused by name --------------------------------------------------------------------------------

@pytest.mark.parametrize(("fields", "param"), [
    ({"store": True}, "store"), ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"conversation": "conv_123"}, "conversation"), ({"background": True}, "background"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
])
def test_stateful_fields_are_refused_saying_no_state_outlives_a_request(api, fields: dict, param: str) -> None:
    error = refused(api, RESPONSES, respond(**fields), param)
    assert error["code"] == "unsupported_parameter" and "no state outlives a request" in error["message"]


@pytest.mark.parametrize("tool", ["web_search", "file_search", "code_interpreter"])
def test_hosted_tools_are_refused_by_name(api, tool: str) -> None:
    error = refused(api, RESPONSES, respond(tools=[{"type": tool}]), "tools")
    assert tool in error["message"]


def test_retrieval_by_id_is_refused_saying_why(api) -> None:
    response = api.handle(Request(b"GET", b"https", b"node", b"/v1/responses/resp_123", [], b""))
    assert response.status == 404 and b"never stored" in response.body


@pytest.mark.parametrize(("fields", "param"), [
    ({"input": [{"role": "user"}]}, "input"), ({"input": 3}, "input"), ({"bogus_field": 1}, "bogus_field"),
    ({"max_output_tokens": 10**9}, "max_output_tokens"), ({"text": {"format": {"type": "json_schema"}}}, "text.format"),
    ({"tool_choice": "required"}, "tool_choice"), ({"text": {"verbosity": "low"}}, "text.verbosity"),
])
def test_a_bad_field_is_refused_under_its_responses_name(api, fields: dict, param: str) -> None:
    refused(api, RESPONSES, respond(**fields), param)


def test_null_stands_for_a_field_left_out(api) -> None:
    nulls = {name: None for name in ("instructions", "tools", "tool_choice", "text", "parallel_tool_calls", "store",
                                     "previous_response_id", "temperature", "top_p", "metadata", "reasoning")}
    assert post(api, RESPONSES, respond(**nulls))[0] == 200
    assert post(api, b"/v1/chat/completions", chat(parallel_tool_calls=None))[0] == 200


# ----- max_tokens left out, aliases ------------------------------------------------------------------

def test_without_max_tokens_the_answer_may_use_the_rest_of_the_context(api) -> None:
    body = chat(ignore_eos=True)
    del body["max_tokens"]
    status, answer = post(api, b"/v1/chat/completions", body)
    usage = answer["usage"]
    assert status == 200 and usage["completion_tokens"] > 128 and answer["choices"][0]["finish_reason"] == "length"
    assert usage["prompt_tokens"] + usage["completion_tokens"] == api.max_tokens_limit
    status, whole = post(api, RESPONSES, respond(max_output_tokens=None, ignore_eos=True))
    assert status == 200 and whole["usage"]["output_tokens"] > 128


def test_a_prompt_that_leaves_no_room_is_refused_naming_it(api) -> None:
    long = "word " * (2 * api.max_tokens_limit)
    refused(api, b"/v1/chat/completions", chat(messages=[{"role": "user", "content": long}]), "messages")
    refused(api, RESPONSES, respond(input=long), "input")


def test_each_alias_is_listed_and_served_and_answers_name_the_first(api) -> None:
    listing = json.loads(api.handle(Request(b"GET", b"https", b"node", b"/v1/models", [], b"")).body)
    assert [model["id"] for model in listing["data"]] == ["tiny", ALIAS]
    status, answer = post(api, b"/v1/chat/completions", chat(model=ALIAS))
    assert status == 200 and answer["model"] == "tiny"
    assert post(api, RESPONSES, respond(model=ALIAS))[1]["model"] == "tiny"


def test_a_text_format_or_tool_setting_the_nodes_json_options_is_refused_under_its_responses_name(api) -> None:
    """llguidance's "x-guidance" would turn free whitespace back on or ignore keywords it does not implement."""
    spaced = {**CITY_FORMAT, "schema": {**CITY_FORMAT["schema"], "x-guidance": {"whitespace_flexible": True}}}
    error = refused(api, RESPONSES, respond(text={"format": spaced}), "text.format")
    assert '"x-guidance"' in error["message"] and "whitespace" not in error["message"]
    lenient = {**CITY_TOOL, "parameters": {**CITY_TOOL["parameters"], "x-guidance": {"lenient": True}}}
    error = refused(api, RESPONSES, respond(tools=[lenient], tool_choice="required"), "tools")
    assert '"x-guidance"' in error["message"] and "lenient" not in error["message"]
