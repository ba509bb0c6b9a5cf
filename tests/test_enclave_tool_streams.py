"""Tool calls of every format, whole and streamed, as the `openai` package's stream helper reads them.

A random-weight model writes no call by itself, so a regex constraint (`guided_regex`) makes it write a
call in a family's format, as the model would; the node reads that format because the operator named it
(`InnerApi.tool_call_format`, what `veil node --tool-call-format` sets). The stream is then handed, chunk
by chunk, to `openai.lib.streaming.chat.ChatCompletionStreamState`, the very state that
`client.chat.completions.stream` runs: with a strict tool it must fire `tool_calls.function.arguments.done`
for every call, with arguments that parse.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from enclave.api import InnerApi
from enclave.tool_calls import HERMES, LLAMA_JSON, MISTRAL_ARGS, MISTRAL_JSON
from engine import EngineConfig, Tokenizer
from engine.core_client import EngineCoreClient
from tests.engine_models import tiny_model_dir
from tests.test_enclave_fields import post as post_to

MODEL = "tiny"
CHAT = b"/v1/chat/completions"
# Bounded arguments, so that a forced call by random weights always ends.
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER, "strict": True}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME, "strict": True}}]
_WEATHER_ARGS = r'\{"city": "(Paris|Oslo)", "days": [1-7]\}'
_TIME_ARGS = r'\{"utc": (true|false)\}'
# Each format's calls as its models write them: parallel calls, text before a call.
WRITTEN = {
    HERMES: (rf'Let me look\.\n<tool_call>\n\{{"name": "get_weather", "arguments": {_WEATHER_ARGS}\}}\n</tool_call>\n'
             rf'<tool_call>\n\{{"name": "get_time", "arguments": {_TIME_ARGS}\}}\n</tool_call>', "Let me look.", 2),
    LLAMA_JSON: (rf'\{{"name": "get_weather", "parameters": {_WEATHER_ARGS}\}}; '
                 rf'\{{"name": "get_time", "parameters": {_TIME_ARGS}\}}', None, 2),
    MISTRAL_JSON: (rf'\[\{{"name": "get_weather", "arguments": {_WEATHER_ARGS}\}}\]', None, 1),
    MISTRAL_ARGS: (rf'Checking\. \[TOOL_CALLS\]get_weather\[ARGS\]{_WEATHER_ARGS}'
                   rf'\[TOOL_CALLS\]get_time\[ARGS\]{_TIME_ARGS}', "Checking.", 2),
}


@pytest.fixture(scope="module")
def core() -> Iterator[EngineCoreClient]:
    core = EngineCoreClient(tiny_model_dir(), EngineConfig(kv_cache_gib=0.05, device="cpu"))
    core.start()
    yield core
    core.stop()


def api(core: EngineCoreClient, format: str | None) -> InnerApi:
    return InnerApi(core, Tokenizer(tiny_model_dir()), MODEL, tool_call_format=format)


def ask(**fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris, and the time?"}],
            "tools": TOOLS, "max_tokens": 400, "seed": 1, **fields}


def helper_events(chunks: list[dict]) -> tuple[list, object]:
    """The events the SDK's stream helper fires for these chunks, and the completion it puts together."""
    state = ChatCompletionStreamState(input_tools=TOOLS)
    events = [event for chunk in chunks for event in state.handle_chunk(ChatCompletionChunk.model_validate(chunk))]
    return events, state.get_final_completion()


def assert_streamed_as_openai_does(chunks: list[dict], calls: int) -> None:
    events, final = helper_events(chunks)
    done = [event for event in events if event.type == "tool_calls.function.arguments.done"]
    assert [event.index for event in done] == list(range(calls))
    assert all(isinstance(event.parsed_arguments, dict) for event in done)
    [choice] = final.choices
    assert choice.finish_reason == "tool_calls"
    assert [call.function.arguments for call in choice.message.tool_calls] == [event.arguments for event in done]
    # The call's last piece and the finish are apart: the answer ends on an empty delta, as OpenAI's does.
    assert chunks[-1]["choices"][0]["delta"] == {} and chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    named = [f for c in chunks for f in c["choices"][0]["delta"].get("tool_calls", []) if "id" in f]
    assert all(f["function"]["arguments"] == "" for f in named)  # a call is named first, then its arguments


@pytest.mark.parametrize("format", list(WRITTEN))
def test_every_format_parses_whole_and_streams_as_openai_does(core, format: str) -> None:
    regex, content, calls = WRITTEN[format]
    node = api(core, format)
    status, whole = post_to(node, CHAT, ask(guided_regex=regex))
    assert status == 200, whole
    [choice] = whole["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == content
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather", "get_time"][:calls]
    assert all(isinstance(json.loads(c["function"]["arguments"]), dict) for c in choice["message"]["tool_calls"])
    status, chunks = post_to(node, CHAT, ask(guided_regex=regex, stream=True))
    assert status == 200
    assert_streamed_as_openai_does(chunks, calls)
    _, final = helper_events(chunks)
    assert [c.function.arguments for c in final.choices[0].message.tool_calls] == [
        c["function"]["arguments"] for c in choice["message"]["tool_calls"]]  # same seed: the same calls


def test_malformed_calls_stay_content_whole_and_streamed(core) -> None:
    """A Hermes block without its outer "}" is not a call (as vLLM keeps it): content, finish "stop"."""
    regex = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Paris", "days": 2\}\n</tool_call>'
    node = api(core, HERMES)
    _, whole = post_to(node, CHAT, ask(guided_regex=regex))
    [choice] = whole["choices"]
    assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]
    assert choice["message"]["content"].startswith("<tool_call>")
    _, chunks = post_to(node, CHAT, ask(guided_regex=regex, stream=True))
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == choice["message"]["content"]
    assert not any("tool_calls" in c["choices"][0]["delta"] for c in chunks)


# Each format's call to `send_email`, which the request does not declare (TOOLS offers get_weather, get_time).
UNDECLARED = {
    HERMES: 'Let me send it.\n<tool_call>\n{"name": "send_email", "arguments": {"to": "a"}}\n</tool_call>',
    LLAMA_JSON: '{"name": "send_email", "parameters": {"to": "a"}}',
    MISTRAL_JSON: '[{"name": "send_email", "arguments": {"to": "a"}}]',
    MISTRAL_ARGS: 'Sending. [TOOL_CALLS]send_email[ARGS]{"to": "a"}',
}


@pytest.mark.parametrize("format", list(UNDECLARED))
def test_a_call_to_an_undeclared_function_is_content_whole_and_streamed(core, format: str) -> None:
    """The client is never handed a call to a function it did not offer: the text stays content, ending "stop"."""
    text, node = UNDECLARED[format], api(core, format)
    status, whole = post_to(node, CHAT, ask(guided_regex=re.escape(text)))
    assert status == 200, whole
    [choice] = whole["choices"]
    assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]
    assert choice["message"]["content"] == text
    status, chunks = post_to(node, CHAT, ask(guided_regex=re.escape(text), stream=True))
    assert status == 200
    assert not any("tool_calls" in c["choices"][0]["delta"] for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == text
    _, final = helper_events(chunks)
    assert final.choices[0].finish_reason == "stop" and not final.choices[0].message.tool_calls


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_call_streams_name_first_then_arguments_then_an_empty_finish(core, choice) -> None:
    status, chunks = post_to(api(core, None), CHAT, ask(tool_choice=choice, parallel_tool_calls=False,
                                                         temperature=1.0, stream=True))
    assert status == 200
    assert_streamed_as_openai_does(chunks, 1)
    pieces = [f["function"]["arguments"] for c in chunks for f in c["choices"][0]["delta"].get("tool_calls", [])]
    assert len(pieces) > 2  # the arguments come in pieces as they are written, not in one block at the end
    assert not any(c["choices"][0]["delta"] == {} for c in chunks[:-1])  # no empty chunks while it is written


def test_auto_without_a_format_is_refused_unless_the_operator_names_one(core, tmp_path) -> None:
    plain = tmp_path / "plain"
    plain.mkdir()
    for name in ("tokenizer.json", "config.json"):
        (plain / name).write_bytes((tiny_model_dir() / name).read_bytes())
    settings = json.loads((tiny_model_dir() / "tokenizer_config.json").read_text())
    settings["chat_template"] = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    (plain / "tokenizer_config.json").write_text(json.dumps(settings))
    refused = InnerApi(core, Tokenizer(plain), MODEL)
    status, answer = post_to(refused, CHAT, ask(max_tokens=2))
    assert status == 400 and answer["error"]["param"] == "tool_choice"
    assert "--tool-call-format" in answer["error"]["message"]
    named = InnerApi(core, Tokenizer(plain), MODEL, tool_call_format=LLAMA_JSON)
    status, answer = post_to(named, CHAT, ask(guided_regex=WRITTEN[LLAMA_JSON][0]))
    assert status == 200 and answer["choices"][0]["finish_reason"] == "tool_calls"
