"""Tool call ids take the form the model's template reads back in the next turn of the tool loop.

Mistral's real templates (7B Instruct v0.3, Nemo, Small 3.2) refuse any call id but 9 letters and digits,
so an answer's `call_` + 24 hex ids, sent back as the assistant turn and the tool results, were refused.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from enclave.tool_calls import FORCED_JSON, HERMES, MISTRAL_ARGS, MISTRAL_JSON, ChoiceCalls, tool_format
from engine.tokenizer import ChatMessage, Tokenizer, ToolCall
from tests.family_support import MODELS, family_folder

MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")
WEATHER = [{"type": "function", "function": {"name": "get_weather",
                                             "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
MORE = json.loads((MODELS / "more-chat-templates" / "templates.json").read_text())


def mistral_folder(tmp_path: Path, name: str) -> Path:
    """Mistral v0.3's tokenizer with the named template (v0.3's own, Nemo's or Small 3.2's)."""
    folder = tmp_path / name
    shutil.copytree(family_folder("mistral-7b-instruct-v0.3"), folder)
    if name in MORE:
        (folder / "chat_template.jinja").write_text(MORE[name]["template"])
    return folder


def answer_calls(format: str, text: str, id_family: str | None = None) -> list[dict]:
    calls = ChoiceCalls(format, id_family=id_family)
    parsed = calls.read(text, last=True)
    return [call.openai() for call in parsed.calls]


def next_turn(calls: list[dict]) -> list[ChatMessage]:
    """The standard loop: the assistant's calls as the client sends them back, each call's result, a question."""
    made = tuple(ToolCall(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls)
    return [ChatMessage("user", "Weather in Paris and Rome?"), ChatMessage("assistant", None, made),
            *[ChatMessage("tool", "sunny", tool_call_id=call.id) for call in made]]


MISTRAL_ANSWER = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, ' \
                 '{"name": "get_weather", "arguments": {"city": "Rome"}}]'


@pytest.mark.parametrize("template", ["mistral-7b-instruct-v0.3", "mistral-nemo-instruct-2407",
                                      "mistral-small-3.2-24b-instruct-2506"])
def test_a_mistral_answers_calls_render_in_the_next_turn(tmp_path, template: str) -> None:
    tokenizer = Tokenizer(mistral_folder(tmp_path, template))
    family = tool_format(tokenizer.chat_template(with_tools=True))
    assert family in (MISTRAL_JSON, MISTRAL_ARGS)
    answer = MISTRAL_ANSWER if family == MISTRAL_JSON else \
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}'
    calls = answer_calls(family, answer)
    assert len(calls) == 2 and all(MISTRAL_ID.fullmatch(call["id"]) for call in calls)
    assert calls[0]["id"] != calls[1]["id"]
    text = tokenizer.apply_chat_template(next_turn(calls), tools=WEATHER)  # refused before: "Tool call IDs should…"
    assert all(call["id"] in text for call in calls)


def test_forced_calls_of_a_mistral_model_take_its_id_form(tmp_path) -> None:
    """`tool_choice: "required"` reads a JSON list whatever the family; the ids still follow the template."""
    calls = answer_calls(FORCED_JSON, '[{"name": "get_weather", "parameters": {"city": "Paris"}}]', MISTRAL_JSON)
    assert MISTRAL_ID.fullmatch(calls[0]["id"])
    Tokenizer(mistral_folder(tmp_path, "mistral-7b-instruct-v0.3")).apply_chat_template(next_turn(calls), tools=WEATHER)


def test_other_families_keep_openais_id_form() -> None:
    calls = answer_calls(HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    assert re.fullmatch(r"call_[0-9a-f]{24}", calls[0]["id"])
    forced = answer_calls(FORCED_JSON, '[{"name": "get_weather", "parameters": {"city": "Paris"}}]')
    assert re.fullmatch(r"call_[0-9a-f]{24}", forced[0]["id"])
