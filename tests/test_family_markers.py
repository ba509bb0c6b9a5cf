"""Tool-call markers that are special tokens reach the parser, on the families' real tokenizers.

`[TOOL_CALLS]` (Mistral) and `<|python_tag|>` (Llama 3.1) are special tokens, which a decode leaves out
of the text by default; the node keeps exactly the markers its call format and reasoning read by
(`SamplingParams.kept_special_tokens`), so the parser sees them, and the content a user sees holds no
marker of a call that was parsed. End-of-turn tokens stay out of the text.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from enclave.api import InnerApi
from enclave.tool_calls import LLAMA_JSON, MISTRAL_ARGS, MISTRAL_JSON, ChoiceCalls, markers
from engine import EngineConfig, SamplingParams, Tokenizer
from engine.core_client import EngineCoreClient
from engine.output_processor import OutputProcessor
from engine.sequence import FinishReason
from tests.family_model_support import random_family_model
from tests.family_support import family_folder
from tests.test_enclave_fields import post

MISTRAL, LLAMA = "mistral-7b-instruct-v0.3", "llama-3.1-8b-instruct"
ARGUMENTS = {"city": "Paris"}
# Each format's call as a model writes it: its markers are the vocabulary's special tokens.
WRITTEN = {
    (MISTRAL, MISTRAL_JSON): '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    (MISTRAL, MISTRAL_ARGS): '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
    (LLAMA, LLAMA_JSON): '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
}


def texts(tokenizer: Tokenizer, format: str, ids: list[int], streamed: bool) -> list[str]:
    """The text pieces the output path makes of `ids`: one step for all, or one token a step."""
    processor = OutputProcessor(tokenizer)
    processor.add("r", SamplingParams(kept_special_tokens=tokenizer.special_ids_of(markers(format))))
    steps = [[t] for t in ids] if streamed else [ids]
    pieces = []
    for k, step in enumerate(steps):
        finish = FinishReason.STOP if k == len(steps) - 1 else None
        deltas, _ = processor.process([("r", 0, step, (), finish, None)])
        pieces += [delta.text for delta in deltas]
    return pieces


@pytest.mark.parametrize("streamed", [False, True])
@pytest.mark.parametrize(("family", "format"), list(WRITTEN))
def test_a_special_marker_reaches_the_parser_whole_and_streamed(family: str, format: str, streamed: bool) -> None:
    tokenizer = Tokenizer(family_folder(family))
    ids = tokenizer.encode(WRITTEN[family, format], add_special_tokens=False)
    assert tokenizer.special_ids_of(markers(format)) & set(ids)  # the marker is one special token
    eot = tokenizer.token_id("</s>" if family == MISTRAL else "<|eom_id|>")
    reader = ChoiceCalls(format)
    parsed = [reader.read(piece, last=False) for piece in texts(tokenizer, format, ids + [eot], streamed)]
    parsed.append(reader.read("", last=True))
    calls = [piece for p in parsed for piece in p.pieces]
    assert [c.name for c in calls if c.name] == ["get_weather"]
    assert json.loads("".join(c.arguments for c in calls)) == ARGUMENTS
    assert "".join(p.content for p in parsed).strip() == ""  # neither the marker nor the end of turn shows


def test_only_the_formats_markers_are_kept() -> None:
    tokenizer = Tokenizer(family_folder(LLAMA))
    ids = tokenizer.encode("<|start_header_id|>x<|python_tag|>y", add_special_tokens=False)
    assert "".join(texts(tokenizer, LLAMA_JSON, ids, streamed=True)) == "x<|python_tag|>y"
    assert "".join(texts(tokenizer, "none", ids, streamed=True)) == "xy"


# Mistral Small 3's call format, written by a random Mistral-shaped model with v0.3's real vocabulary
# (whose `[ARGS]` is text; `[TOOL_CALLS]` is special token 5, which the grammar writes as that token).
FORCED_MARKER = r'start: "Checking. " <[5]> "get_weather[ARGS]" /\{"city": "(Paris|Oslo)"\}/'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def mistral() -> Iterator[InnerApi]:
    folder = random_family_model(MISTRAL)
    core = EngineCoreClient(folder, EngineConfig(kv_cache_gib=0.05, device="cpu"))
    core.start()
    yield InnerApi(core, Tokenizer(folder), "mistral", tool_call_format=MISTRAL_ARGS)
    core.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_a_mistral_call_marked_by_its_special_token_is_read_through_the_node(mistral, stream: bool) -> None:
    body = {"model": "mistral", "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS,
            "max_tokens": 60, "seed": 1, "guided_grammar": FORCED_MARKER, "stream": stream}
    status, answer = post(mistral, b"/v1/chat/completions", body)
    assert status == 200, answer
    if stream:
        deltas = [c["choices"][0]["delta"] for c in answer if c["choices"]]
        content = "".join(d.get("content") or "" for d in deltas)
        pieces = [f["function"] for d in deltas for f in d.get("tool_calls", [])]
        name, arguments = pieces[0]["name"], "".join(p["arguments"] for p in pieces)
        finish = [c["choices"][0]["finish_reason"] for c in answer if c["choices"]][-1]
    else:
        [choice] = answer["choices"]
        content, finish = choice["message"]["content"], choice["finish_reason"]
        [call] = choice["message"]["tool_calls"]
        name, arguments = call["function"]["name"], call["function"]["arguments"]
    assert (name, finish) == ("get_weather", "tool_calls")  # before: "get_weather[ARGS]{...}" stayed content
    assert json.loads(arguments)["city"] in ("Paris", "Oslo")
    assert content.strip() == "Checking."
