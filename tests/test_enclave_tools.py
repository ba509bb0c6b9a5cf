"""Tools at the node's inner API, with a real engine core and a tiny random-weight model with a Qwen-style template:
tool turns replayed in the conversation, tools rendered, calls forced by `tool_choice` returned as OpenAI's
`tool_calls` whole and streamed, and every malformed tool field refused by name without echoing it.

With random weights the model never writes a call on its own, so "auto" is tested for its shape here and
its parsing on texts in tests/test_tool_calls.py; calls reach the response here through a forced choice.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest

from enclave import tool_fields
from enclave.api import InnerApi
from engine import ChatMessage, EngineConfig, Tokenizer, ToolCall
from engine.core_client import EngineCoreClient
from ohttp.bhttp import Request
from tests.engine_models import tiny_model_dir
from tests.test_enclave_fields import post as post_to
from tests.test_tool_grammar import wide_ranges

CANARY = "CANARY-tools-77b1-AMBER-HERON"
MODEL = "tiny-qwen"
CHAT = b"/v1/chat/completions"
TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The forecast",
                                      "parameters": WEATHER_PARAMETERS}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"], "additionalProperties": False}}},
]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
REPLAY = [
    {"role": "user", "content": f"Weather in Paris? {CANARY}"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


def qwen_style_model(root: Path) -> Path:
    folder = root / "tiny-qwen"
    shutil.copytree(tiny_model_dir(), folder)
    shutil.copy(TEMPLATES / "qwen2.5.jinja", folder / "chat_template.jinja")
    return folder


def toolless_model(root: Path) -> Path:
    """The tiny model with a chat template that shows no tool-call format (the tiny model's own shows Hermes')."""
    folder = root / "tiny-toolless"
    shutil.copytree(tiny_model_dir(), folder)
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tools")
    return qwen_style_model(root), toolless_model(root)


@pytest.fixture(scope="module")
def api(folders) -> Iterator[InnerApi]:
    core = EngineCoreClient(folders[0], EngineConfig(kv_cache_gib=0.05, device="cpu"))
    core.start()
    yield InnerApi(core, Tokenizer(folders[0]), MODEL)
    core.stop()


def post(api: InnerApi, body: dict) -> tuple[int, dict | list[dict]]:
    return post_to(api, CHAT, body)


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": REPLAY, "max_tokens": 4, "seed": 1, "tools": TOOLS, **fields}


def refused(api: InnerApi, body: dict, param: str, words: str) -> None:
    status, answer = post(api, body)
    assert status == 400, answer
    assert answer["error"]["param"] == param and words in answer["error"]["message"]
    assert CANARY not in json.dumps(answer)


# ----- tool turns in the conversation ----------------------------------------------------------------------

def test_a_replayed_tool_turn_is_accepted_and_rendered(api, folders) -> None:
    status, answer = post(api, chat())
    assert status == 200, answer
    rendered = Tokenizer(folders[0]).encode_chat([
        ChatMessage("user", REPLAY[0]["content"]),
        ChatMessage("assistant", None, (ToolCall("call_1", "get_weather", {"city": "Paris", "days": 1}),)),
        ChatMessage("tool", "sunny", tool_call_id="call_1")], tools=TOOLS)
    assert answer["usage"]["prompt_tokens"] == len(rendered)
    without_tools = Tokenizer(folders[0]).encode_chat([ChatMessage("user", REPLAY[0]["content"])])
    assert len(rendered) > len(without_tools) + 100  # the tools, the call and its result are all in the prompt


@pytest.mark.parametrize(("message", "words"), [
    ({"role": "tool", "content": CANARY}, "tool_call_id"),
    ({"role": "assistant", "content": None}, "needs a 'content'"),
    ({"role": "assistant", "content": None, "tool_calls": []}, "tool_calls"),
    ({"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
                                                            "function": {"name": "f", "arguments": CANARY}}]},
     "'arguments' must be a JSON object"),
    ({"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
                                                            "function": {"name": CANARY + " x", "arguments": "{}"}}]},
     "name"),
    ({"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "f"}}]}, "'id'"),
])
def test_a_malformed_tool_turn_is_refused_naming_what_is_wrong(api, message: dict, words: str) -> None:
    refused(api, chat(messages=[*REPLAY, message]), "messages", words)


@pytest.mark.parametrize("arguments", ["", None, {}])
def test_a_replayed_call_without_arguments_reads_as_an_empty_object(api, arguments) -> None:
    """As vLLM reads them: missing, null or "" is `{}`, an object is taken as it is."""
    def replayed(value) -> list[dict]:
        call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": value}}
        return [REPLAY[0], {"role": "assistant", "content": None, "tool_calls": [call]}, REPLAY[2]]

    status, answer = post(api, chat(messages=replayed(arguments)))
    _, expected = post(api, chat(messages=replayed("{}")))
    assert status == 200, answer
    assert answer["usage"]["prompt_tokens"] == expected["usage"]["prompt_tokens"]


def test_replayed_arguments_given_as_an_object_render_as_their_json_text(api) -> None:
    as_object = [REPLAY[0], json.loads(json.dumps(REPLAY[1])), REPLAY[2]]
    as_object[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris", "days": 1}
    status, answer = post(api, chat(messages=as_object))
    _, expected = post(api, chat())
    assert status == 200 and answer["usage"]["prompt_tokens"] == expected["usage"]["prompt_tokens"]


def test_a_refusal_says_which_message_was_wrong(api) -> None:
    status, answer = post(api, chat(messages=[*REPLAY, {"role": "tool", "content": "x"}]))
    assert status == 400 and "messages[3]" in answer["error"]["message"]


def test_a_conversation_the_template_refuses_is_a_400_naming_messages(api, tmp_path) -> None:
    """Mistral's format refuses two user turns in a row: its own words come back, never the conversation."""
    mistral = shutil.copytree(tiny_model_dir(), tmp_path / "mistral", ignore=shutil.ignore_patterns("*.safetensors"))
    shutil.copy(TEMPLATES / "mistral.jinja", mistral / "chat_template.jinja")
    strict = InnerApi(api.engine, Tokenizer(mistral), MODEL)  # the same tokenizer.json as the served model's
    body = chat(messages=[{"role": "user", "content": CANARY}, {"role": "user", "content": CANARY}], tools=None)
    status, answer = post(strict, body)
    assert status == 400 and answer["error"]["param"] == "messages" and answer["error"]["code"] == "invalid_messages"
    assert "Roles must alternate user/assistant" in answer["error"]["message"] and CANARY not in json.dumps(answer)


# ----- tools and tool_choice ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": [{"type": "function", "function": {"name": CANARY + "!"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": CANARY}}]}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_news"}}}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": None, "tool_choice": "auto"}, "tool_choice"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_malformed_tool_fields_are_refused_by_name(api, fields: dict, param: str) -> None:
    status, answer = post(api, chat(**fields))
    assert status == 400 and answer["error"]["param"] == param, answer
    assert CANARY not in json.dumps(answer)


def test_tools_are_a_chat_field_only(api) -> None:
    response = api.handle(Request(b"POST", b"https", b"node", b"/v1/completions", [],
                                  json.dumps({"model": MODEL, "prompt": "x", "tools": TOOLS}).encode()))
    assert response.status == 400 and json.loads(response.body)["error"]["param"] == "tools"


def test_auto_with_a_template_that_shows_no_call_format_is_refused(folders) -> None:
    core = EngineCoreClient(folders[1], EngineConfig(kv_cache_gib=0.05, device="cpu"))
    core.start()
    try:
        status, answer = post(InnerApi(core, Tokenizer(folders[1]), MODEL), chat())
        assert status == 400 and answer["error"]["param"] == "tool_choice"
        status, answer = post(InnerApi(core, Tokenizer(folders[1]), MODEL), chat(tool_choice="none"))
        assert status == 200
    finally:
        core.stop()


@pytest.mark.parametrize("choice", ["auto", "none"])
def test_an_answer_without_calls_is_plain_content(api, choice: str) -> None:
    """Random weights write no call: the answer is its text, as without tools, and ends as it ended."""
    for stream in (False, True):
        status, answer = post(api, chat(tool_choice=choice, stream=stream, temperature=0))
        assert status == 200
        if stream:
            assert all("tool_calls" not in c["choices"][0]["delta"] for c in answer)
            assert answer[-1]["choices"][0]["finish_reason"] == "length"
        else:
            [choice_] = answer["choices"]
            assert "tool_calls" not in choice_["message"] and isinstance(choice_["message"]["content"], str)
            assert choice_["finish_reason"] == "length"


# ----- forced calls: required and named --------------------------------------------------------------------

FORCED = {"max_tokens": 1000, "temperature": 1.0}  # calls and their arguments are bounded: they end before


def assert_valid_calls(calls: list[dict], names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_") and call["function"]["name"] in names
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])


def streamed_calls(chunks: list[dict]) -> dict[int, list[dict]]:
    """Each choice's calls, put together from `delta.tool_calls` fragments as OpenAI's SDK does."""
    calls: dict[int, dict[int, dict]] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            for fragment in choice["delta"].get("tool_calls", []):
                call = calls.setdefault(choice["index"], {}).setdefault(
                    fragment["index"], {"type": "function", "function": {"name": "", "arguments": ""}})
                call["id"] = fragment.get("id", call.get("id"))
                call["function"]["name"] += fragment["function"].get("name", "")
                call["function"]["arguments"] += fragment["function"].get("arguments", "")
    return {index: [by_index[k] for k in sorted(by_index)] for index, by_index in calls.items()}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_required_always_yields_valid_tool_calls(api, seed: int) -> None:
    assert_required_calls(api, seed=seed)


def assert_required_calls(api: InnerApi, **fields) -> None:
    status, answer = post(api, chat(**{"tool_choice": "required", **FORCED, **fields}))
    assert status == 200, answer
    [choice] = answer["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert_valid_calls(choice["message"]["tool_calls"], set(SCHEMAS))


def test_a_named_choice_calls_that_function_once(api) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    for seed in (1, 2):
        status, answer = post(api, chat(tool_choice=named, seed=seed, **FORCED))
        [choice] = answer["choices"]
        assert status == 200 and choice["finish_reason"] == "tool_calls"
        assert len(choice["message"]["tool_calls"]) == 1
        assert_valid_calls(choice["message"]["tool_calls"], {"get_time"})


def test_parallel_tool_calls_false_gives_one_call(api) -> None:
    status, answer = post(api, chat(tool_choice="required", parallel_tool_calls=False, **FORCED))
    assert status == 200 and len(answer["choices"][0]["message"]["tool_calls"]) == 1


def test_streamed_calls_add_up_to_the_whole_answer(api) -> None:
    body = chat(tool_choice="required", n=2, **FORCED)
    _, whole = post(api, body)
    status, chunks = post(api, {**body, "stream": True})
    assert status == 200
    calls = streamed_calls(chunks)
    finish = {c["choices"][0]["index"]: c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]}
    assert finish == {0: "tool_calls", 1: "tool_calls"}
    for choice in whole["choices"]:
        expected = choice["message"]["tool_calls"]
        got = calls[choice["index"]]
        assert [c["function"] for c in got] == [c["function"] for c in expected]  # same seed, same calls
        assert {c["id"] for c in got}.isdisjoint({c["id"] for c in expected})  # ids are random per call
        assert_valid_calls(got, set(SCHEMAS))
    assert all(c["choices"][0]["delta"].get("content") in ("", None) for c in chunks)


CITY_FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "strict": True, "schema": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}}}


@pytest.mark.parametrize("response_format", [CITY_FORMAT, {"type": "json_object"}])
def test_a_forced_choice_serves_beside_a_response_format_as_openai_does(api, response_format: dict) -> None:
    """The format shapes message text, which a forced call has none of: it gives way (the Agents SDK sends both
    for an Agent with an `output_type` and `tool_choice="required"`)."""
    assert_required_calls(api, response_format=response_format)


def test_a_forced_function_call_is_served_beside_a_text_format(api) -> None:
    """The same on the Responses API, where the Agents SDK sends `text.format` with `tool_choice`."""
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER_PARAMETERS}
    text = {"format": {"type": "json_schema", **CITY_FORMAT["json_schema"]}}
    body = {"model": MODEL, "input": REPLAY[0]["content"], "tools": [tool], "tool_choice": "required", "text": text,
            "seed": 1, "max_output_tokens": 1000}
    status, answer = post_to(api, b"/v1/responses", body)
    assert status == 200, answer
    assert answer["output"] and {item["type"] for item in answer["output"]} == {"function_call"}
    assert_valid_calls([{"id": item["call_id"], "type": "function", "function": item} for item in answer["output"]],
                       {"get_weather"})


@pytest.mark.parametrize("constraint", [{"guided_json": {"type": "object"}}, {"guided_regex": "a+"},
                                        {"structured_outputs": {"json_object": True}}])
def test_a_forced_choice_refuses_a_constraint_on_the_whole_answer(api, constraint: dict) -> None:
    refused(api, chat(tool_choice="required", **constraint), "tool_choice", "structured_outputs, guided_*")


OPEN_CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_forced_call_writes_only_the_properties_its_function_lists(api, seed: int) -> None:
    """Parameters that do not say `additionalProperties` are read as OpenAI's strict mode and vLLM's default do:
    a random model would otherwise go on inventing properties until the context ends."""
    tool = {"type": "function", "function": {"name": "get_city", "parameters": OPEN_CITY}}
    named = {"type": "function", "function": {"name": "get_city"}}
    status, answer = post(api, chat(tools=[tool], tool_choice=named, seed=seed, **FORCED))
    assert status == 200, answer
    [choice] = answer["choices"]
    assert choice["finish_reason"] == "tool_calls"
    [call] = choice["message"]["tool_calls"]
    assert set(json.loads(call["function"]["arguments"])) == {"city"}


def test_the_forced_grammar_closes_listed_objects_and_leaves_declared_ones_alone() -> None:
    parameters = {"type": "object", "properties": {"place": {"$ref": "#/$defs/Place"}, "tags": {
        "type": "object", "additionalProperties": {"type": "string"}}, "both": {"allOf": [
            {"properties": {"a": {"type": "integer"}}}, {"properties": {"b": {"type": "integer"}}}]}},
        "$defs": {"Place": {"type": "object", "properties": {"city": {"type": "string"}}}}}
    tools = tool_fields.tool_request({"tools": [{"type": "function", "function": {"name": "f", "parameters": parameters}}],
                                      "tool_choice": "required"})
    [call] = json.loads(tools.grammar().spec)["items"]["anyOf"]
    closed = call["properties"]["parameters"]
    assert closed["additionalProperties"] is False and closed["$defs"]["Place"]["additionalProperties"] is False
    assert closed["properties"]["tags"]["additionalProperties"] == {"type": "string"}  # said: kept as said
    assert all("additionalProperties" not in part for part in closed["properties"]["both"]["allOf"])
    assert parameters["$defs"]["Place"] == {"type": "object", "properties": {"city": {"type": "string"}}}  # a copy


# ----- "auto" beside a response format: calls or an answer in the format ----------------------------------

CITY_ANSWER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
               "additionalProperties": False}
AUTO_FORMAT = {"tool_choice": "auto", "max_tokens": 1000,
               "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_ANSWER}}}
OPEN_ANGLE = 32  # "<" in the tiny vocabulary: the first token of `<tool_call>`, never one of a JSON answer


def assert_calls_or_answer(choice: dict) -> str:
    """The choice is valid calls or JSON valid against the answer schema; which one it is."""
    if choice["message"].get("tool_calls"):
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        assert_valid_calls(choice["message"]["tool_calls"], set(SCHEMAS))
        return "calls"
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), CITY_ANSWER)
    return "answer"


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_auto_beside_a_response_format_calls_or_answers_in_the_format(api, seed: int) -> None:
    status, answer = post(api, chat(**AUTO_FORMAT, seed=seed))
    assert status == 200, answer
    assert_calls_or_answer(answer["choices"][0]) in ("calls", "answer")


@pytest.mark.parametrize("stream", [False, True])
def test_auto_beside_a_response_format_lets_the_model_call(api, stream: bool) -> None:
    """A model that starts `<tool_call>` calls, in the template's Hermes format (before: it could only answer
    in the format, so the tools were offered and never callable)."""
    body = chat(**AUTO_FORMAT, logit_bias={str(OPEN_ANGLE): 100}, stream=stream)
    status, answer = post(api, body)
    assert status == 200, answer
    if stream:
        [calls] = streamed_calls(answer).values()
        assert_valid_calls(calls, set(SCHEMAS))
        assert [c["choices"][0]["finish_reason"] for c in answer if c["choices"][0]["finish_reason"]] == ["tool_calls"]
        assert all(c["choices"][0]["delta"].get("content") in ("", None) for c in answer)
    else:
        assert assert_calls_or_answer(answer["choices"][0]) == "calls"


def test_auto_beside_a_response_format_answers_in_the_format_when_it_does_not_call(api) -> None:
    status, answer = post(api, chat(**AUTO_FORMAT, logit_bias={str(OPEN_ANGLE): -100}))
    assert status == 200, answer
    assert assert_calls_or_answer(answer["choices"][0]) == "answer"


def test_auto_beside_a_response_format_refuses_a_tool_schema_it_cannot_constrain(api) -> None:
    broken = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(" + CANARY}}}}}
    refused(api, chat(**AUTO_FORMAT, tools=[broken]), "tools", "tools")
    status, _ = post(api, chat(tools=[broken], tool_choice="auto"))  # without a format nothing constrains the calls
    assert status == 200


def test_a_format_and_tools_over_the_limits_only_together_are_refused_naming_tools(folders, tmp_path) -> None:
    """Each part compiles alone (tests/test_tool_grammar.py); "auto" beside the format compiles both as one
    grammar, over the node's limits, and the refusal names 'tools' and the format. The tools' 36 kB schema is
    in the prompt: a copy of the model with a longer context holds it (nothing is computed: the grammar is
    refused when the request is admitted)."""
    folder = tmp_path / "tiny-qwen-long"
    shutil.copytree(folders[0], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 65536}))
    core = EngineCoreClient(folder, EngineConfig(kv_cache_gib=0.1, device="cpu"))
    core.start()
    try:
        tools = [{"type": "function", "function": {"name": "measure", "parameters": wide_ranges(10**6)}}]
        response_format = {"type": "json_schema", "json_schema": {"name": "ranges", "schema": wide_ranges(0)}}
        body = chat(tools=tools, tool_choice="auto", response_format=response_format)
        status, answer = post(InnerApi(core, Tokenizer(folder), MODEL), body)
    finally:
        core.stop()
    assert status == 400 and answer["error"]["param"] == "tools", answer
    message = answer["error"]["message"]
    assert message.startswith("tools together with response_format") and "limits" in message, message


# llguidance reads "x-guidance" at a schema's top level as options over the node's: free whitespace, or
# keywords it does not implement ignored (`lenient`). Parameters set it where a user would: at their own top.
OPTIONS_TOOL = {"type": "function", "function": {"name": "get_news", "parameters": {
    "type": "object", "properties": {CANARY: {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}},
    "x-guidance": {"lenient": True, "whitespace_flexible": True}}}}


@pytest.mark.parametrize("fields", [
    {"tool_choice": "required"},
    {"tool_choice": {"type": "function", "function": {"name": "get_news"}}},
    AUTO_FORMAT,
], ids=["required", "named", "auto-beside-format"])
def test_a_tool_schema_setting_the_nodes_json_options_is_refused_by_name(api, monkeypatch, fields: dict) -> None:
    submitted = []
    submit = api.engine.submit
    monkeypatch.setattr(api.engine, "submit", lambda *args, **kwargs: submitted.append(1) or submit(*args, **kwargs))
    status, answer = post(api, chat(**fields, tools=[*TOOLS, OPTIONS_TOOL]))
    assert status == 400 and answer["error"]["param"] == "tools", answer
    message = answer["error"]["message"]
    assert "tools[2]" in message and '"x-guidance"' in message and submitted == []
    assert not any(word in message for word in (CANARY, "lenient", "whitespace_flexible", "uniqueItems", "get_news"))


def test_a_tool_schema_with_options_no_grammar_is_built_from_is_only_shown_to_the_model(api) -> None:
    """Only the prompt holds these parameters (a call to another function is forced, or nothing constrains
    "auto"): llguidance never reads them, so there is nothing to refuse."""
    named = {"type": "function", "function": {"name": "get_time"}}
    for fields in ({"tool_choice": named}, {"tool_choice": "auto"}, {"tool_choice": "none"}):
        status, answer = post(api, chat(**fields, tools=[*TOOLS, OPTIONS_TOOL]))
        assert status == 200, answer


@pytest.mark.parametrize(("bias", "expected"), [(100, "calls"), (-100, "answer")])
def test_auto_beside_a_text_format_on_the_responses_api_calls_or_answers(api, bias: int, expected: str) -> None:
    """The Agents SDK's Agent with tools and an `output_type`: `text.format` beside `tool_choice: "auto"`."""
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER_PARAMETERS}
    text = {"format": {"type": "json_schema", "name": "city", "schema": CITY_ANSWER}}
    body = {"model": MODEL, "input": REPLAY[0]["content"], "tools": [tool], "tool_choice": "auto", "text": text,
            "seed": 1, "max_output_tokens": 1000, "logit_bias": {str(OPEN_ANGLE): bias}}
    status, answer = post_to(api, b"/v1/responses", body)
    assert status == 200, answer
    if expected == "calls":
        assert answer["output"] and {item["type"] for item in answer["output"]} == {"function_call"}
        assert_valid_calls([{"id": item["call_id"], "type": "function", "function": item} for item in answer["output"]],
                           {"get_weather"})
    else:
        [message] = answer["output"]
        jsonschema.validate(json.loads(message["content"][0]["text"]), CITY_ANSWER)


UNIQUE_TOOL = {"type": "function", "function": {"name": "get_news", "parameters": {
    "type": "object", "properties": {"ids": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}}}}


@pytest.mark.parametrize("fields", [
    {"tool_choice": "required"},
    {"tool_choice": {"type": "function", "function": {"name": "get_news"}}},
    AUTO_FORMAT,
], ids=["required", "named", "auto-beside-format"])
def test_a_keyword_the_grammar_cannot_enforce_in_a_tools_parameters_is_refused_naming_tools(api, fields: dict) -> None:
    """The fault is in `tools`, whichever choice built the grammar from it: a forced call named `tool_choice`."""
    status, answer = post(api, chat(**fields, tools=[*TOOLS, UNIQUE_TOOL]))
    assert status == 400 and answer["error"]["param"] == "tools", answer
    assert answer["error"]["message"].startswith("tools"), answer  # a keyword's name only, no schema contents
