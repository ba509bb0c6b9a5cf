"""Constraints on real vocabularies: a grammar's text may hold the family's added tokens.

Qwen's `<think>`, `</think>`, `<tool_call>` are added tokens (not special): a grammar whose text holds
them must let the model write them, as one token or as pieces, and must never abort the sample. A
random-weight Qwen3-shaped model with Qwen3's real tokenizer and template runs in an engine core.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import pytest

from enclave.api import InnerApi
from engine import EngineConfig, Tokenizer
from engine.core_client import EngineCoreClient
from tests.family_model_support import random_family_model
from tests.test_enclave_fields import post

QWEN3 = "qwen3-0.6b"
CHAT = b"/v1/chat/completions"
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
           "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER, "strict": True}}]


@pytest.fixture(scope="module")
def qwen3() -> Iterator[InnerApi]:
    folder = random_family_model(QWEN3)
    core = EngineCoreClient(folder, EngineConfig(kv_cache_gib=0.05, device="cpu"))
    core.start()
    yield InnerApi(core, Tokenizer(folder), "qwen3")
    core.stop()


def ask(**fields) -> dict:
    return {"model": "qwen3", "messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 60,
            "seed": 1, **fields}


@pytest.mark.parametrize("regex", [r"<think>\nThe user asks\.\n</think>\n\nParis", r"<tool_call>\n[a-z]{1,8}\n</tool_call>",
                                   r"(<think>[a-z ]{0,20}</think>)?ok"])
def test_a_regex_holding_added_tokens_completes(qwen3, regex: str) -> None:
    body = {"model": "qwen3", "prompt": "Weather in Paris?", "max_tokens": 60, "seed": 1, "guided_regex": regex}
    status, answer = post(qwen3, b"/v1/completions", body)
    assert status == 200, answer
    [choice] = answer["choices"]
    assert choice["finish_reason"] == "stop"  # "abort" before: the mask offered `<think>`, the matcher refused it
    assert re.fullmatch(regex, choice["text"])


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_in_hermes_tags_completes(qwen3, stream: bool) -> None:
    """Qwen3's template teaches Hermes `<tool_call>` tags, so the forced call's grammar writes them. (Thinking
    off: the call is then forced from the first token; with it on, it follows the reasoning, as tested in
    tests/test_reasoning_constraints.py.)"""
    off = {"enable_thinking": False}
    status, answer = post(qwen3, CHAT, ask(tools=TOOLS, tool_choice="required", max_tokens=200, stream=stream,
                                           chat_template_kwargs=off))
    assert status == 200, answer
    if stream:
        finish = [c["choices"][0]["finish_reason"] for c in answer if c["choices"]][-1]
        calls: dict[int, list] = {}
        for chunk in answer:
            for piece in chunk["choices"][0]["delta"].get("tool_calls", []) if chunk["choices"] else []:
                calls.setdefault(piece["index"], []).append(piece["function"])
        named = [(pieces[0]["name"], "".join(p["arguments"] for p in pieces)) for pieces in calls.values()]
    else:
        [choice] = answer["choices"]
        finish = choice["finish_reason"]
        named = [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]]
    assert finish == "tool_calls"  # "abort" before, after the first token
    assert named and all(name == "get_weather" for name, _ in named)
    assert all(json.loads(arguments) in ({"city": "Paris"}, {"city": "Oslo"}) for _, arguments in named)
