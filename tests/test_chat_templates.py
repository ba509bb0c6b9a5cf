"""Chat templates render byte for byte as `transformers.apply_chat_template` renders them.

The templates under tests/data/chat_templates/ are written for these tests in the formats of current
model families (Llama 3.1 and 3.2, Qwen2.5, Qwen3, Mistral), with the Jinja those families' templates
use: namespace(), loop controls, raise_exception, strftime_now, tools, tool calls and tool results.
Each is put in a model folder beside the tiny model's tokenizer and loaded by transformers' own
AutoTokenizer and by the engine's Tokenizer; generated conversations must render the same text, or
fail in both.
"""

from __future__ import annotations

import json
import shutil
import string
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import ModelLoadError, RequestRejected
from engine.tokenizer import ChatMessage, Tokenizer, ToolCall
from tests.engine_models import tiny_model_dir

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
FAMILIES = ("llama3.1", "llama3.2", "qwen2.5", "qwen3", "mistral")
SPECIAL_TOKENS = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "pad_token": "<|end_of_text|>"}
HYPOTHESIS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def model_folder(root: Path, family: str, config: dict | None = None, template_file: bool = True) -> Path:
    folder = root / family
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(tiny_model_dir() / "tokenizer.json", folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({**SPECIAL_TOKENS, **(config or {})}))
    if template_file:
        shutil.copy(TEMPLATES / f"{family}.jinja", folder / "chat_template.jinja")
    return folder


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> dict[str, tuple]:
    """Per family: (transformers' tokenizer, the engine's) over the same model folder."""
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("templates")
    return {family: (transformers.AutoTokenizer.from_pretrained(str(folder)), Tokenizer(folder))
            for family in FAMILIES for folder in [model_folder(root, family)]}


# ----- generated conversations ---------------------------------------------------------------------------

# Text with the pieces templates split, strip and escape on.
_PIECES = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "\n", "\n\n", " ", "{", "}",
           '"', "'", "<b>&</b>", "[INST]", "é", "日本", "🙂")
TEXT = st.lists(st.one_of(st.sampled_from(_PIECES), st.text(max_size=6)), max_size=5).map("".join)
NAME = st.text(string.ascii_letters + string.digits + "_-", min_size=1, max_size=12)
CALL_ID = st.text(string.ascii_letters + string.digits, min_size=9, max_size=9)
JSON_VALUE = st.recursive(st.none() | st.booleans() | st.integers(-10**6, 10**6) | TEXT,
                          lambda inner: st.lists(inner, max_size=3) | st.dictionaries(NAME, inner, max_size=3),
                          max_leaves=6)
ARGUMENTS = st.dictionaries(NAME, JSON_VALUE, max_size=3)


@st.composite
def tools(draw) -> list[dict]:
    def tool(name: str) -> dict:
        function = {"name": name, "parameters": {"type": "object", "properties": draw(
            st.dictionaries(NAME, st.sampled_from([{"type": "string"}, {"type": "integer", "description": "n"}]),
                            max_size=3))}}
        if draw(st.booleans()):
            function["description"] = draw(TEXT)
        return {"type": "function", "function": function}

    return [tool(name) for name in draw(st.lists(NAME, min_size=1, max_size=3, unique=True))]


@st.composite
def tool_turn(draw, max_calls: int) -> list[ChatMessage]:
    """An assistant turn that calls tools, the tools' results, and the assistant's answer."""
    calls = tuple(ToolCall(draw(CALL_ID), draw(NAME), draw(ARGUMENTS))
                  for _ in range(draw(st.integers(1, max_calls))))
    content = draw(st.none() | TEXT) if max_calls > 1 else None
    results = [ChatMessage("tool", draw(TEXT), tool_call_id=call.id) for call in calls]
    return [ChatMessage("assistant", content, calls), *results, ChatMessage("assistant", draw(TEXT))]


@st.composite
def conversations(draw, max_calls: int) -> list[ChatMessage]:
    """Well-formed: an optional system message, then user turns each answered by text or by tool calls."""
    messages = [ChatMessage("system", draw(TEXT))] if draw(st.booleans()) else []
    for _ in range(draw(st.integers(1, 3))):
        messages.append(ChatMessage("user", draw(TEXT)))
        answer = draw(st.sampled_from(["text", "tools", "none"]))
        if answer == "text":
            messages.append(ChatMessage("assistant", draw(TEXT)))
        elif answer == "tools":
            messages.extend(draw(tool_turn(max_calls)))
        else:
            break
    return messages


ANY_MESSAGE = st.one_of(
    st.builds(ChatMessage, st.sampled_from(["system", "user", "assistant", "tool", "ipython"]), st.none() | TEXT),
    st.builds(lambda calls, content: ChatMessage("assistant", content, tuple(calls)),
              st.lists(st.builds(ToolCall, st.text(string.ascii_letters, max_size=10), NAME, ARGUMENTS),
                       min_size=1, max_size=2), st.none() | TEXT),
    st.builds(lambda call_id, text: ChatMessage("tool", text, tool_call_id=call_id), CALL_ID | NAME, TEXT),
)


def as_transformers_gets_it(message: ChatMessage) -> dict:
    """The message as an OpenAI client sends it (None where unset), tool arguments as dicts."""
    calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
             for c in message.tool_calls] or None
    return {"role": message.role, "content": message.content, "tool_calls": calls,
            "tool_call_id": message.tool_call_id, "name": message.name}


def render_both(pair: tuple, messages: list[ChatMessage], tool_list: list[dict] | None,
                add_generation_prompt: bool) -> tuple[str | None, str | None]:
    """Each side's text, or None where it refused the conversation."""
    theirs, ours = pair
    try:
        expected = theirs.apply_chat_template([as_transformers_gets_it(m) for m in messages], tools=tool_list,
                                              add_generation_prompt=add_generation_prompt, tokenize=False)
    except Exception:  # noqa: BLE001 - any failure of the template: ours must refuse the same conversation
        expected = None
    try:
        got = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tool_list)
    except RequestRejected as refusal:
        assert refusal.reason == "invalid_messages"
        got = None
    return expected, got


def max_calls(family: str) -> int:
    return 1 if family.startswith("llama") else 2  # Llama 3.1's template calls one tool per message


@pytest.mark.parametrize("family", FAMILIES)
def test_well_formed_conversations_render_as_transformers_renders_them(pairs, family: str) -> None:
    @HYPOTHESIS
    @given(conversations(max_calls(family)), st.none() | tools(), st.booleans())
    def check(messages, tool_list, add_generation_prompt):
        expected, got = render_both(pairs[family], messages, tool_list, add_generation_prompt)
        assert expected is not None, "the family's template accepts a well-formed conversation"
        assert got == expected

    check()


@pytest.mark.parametrize("family", FAMILIES)
def test_any_conversation_renders_the_same_or_is_refused_by_both(pairs, family: str) -> None:
    @HYPOTHESIS
    @given(st.lists(ANY_MESSAGE, min_size=1, max_size=6), st.none() | tools(), st.booleans())
    def check(messages, tool_list, add_generation_prompt):
        expected, got = render_both(pairs[family], messages, tool_list, add_generation_prompt)
        assert got == expected

    check()


# ----- each family's own features ----------------------------------------------------------------------

WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "Today's weather",
                                             "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = ToolCall("call00001", "get_weather", {"city": "Paris"})
TOOL_TURN = [ChatMessage("user", "Weather in Paris?"), ChatMessage("assistant", None, (CALL,)),
             ChatMessage("tool", "sunny", tool_call_id=CALL.id)]


def test_qwen25_renders_a_plain_chat_whose_messages_have_no_tool_calls(pairs) -> None:
    """Qwen2.5's template reads `message.tool_calls` of every assistant message: undefined must not fail."""
    _, ours = pairs["qwen2.5"]
    text = ours.apply_chat_template([ChatMessage("user", "Hi"), ChatMessage("assistant", "Hello"),
                                     ChatMessage("user", "Bye")])
    assert text.endswith("<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n")


def test_qwen_renders_tools_calls_and_results(pairs) -> None:
    for family in ("qwen2.5", "qwen3"):
        text = pairs[family][1].apply_chat_template(TOOL_TURN, tools=WEATHER)
        assert json.dumps(WEATHER[0]) in text
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
        assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>" in text


def test_qwen3_keeps_reasoning_only_after_the_last_question(pairs) -> None:
    _, ours = pairs["qwen3"]
    text = ours.apply_chat_template([ChatMessage("user", "A?"), ChatMessage("assistant", "<think>\nold\n</think>\n\nA."),
                                     ChatMessage("user", "B?"), ChatMessage("assistant", "<think>new</think>B.")],
                                    add_generation_prompt=False)
    assert "old" not in text and "<|im_start|>assistant\nA.<|im_end|>" in text
    assert "<|im_start|>assistant\n<think>\nnew\n</think>\n\nB.<|im_end|>" in text


def test_llama31_writes_the_ipython_environment_the_date_and_json_calls(pairs) -> None:
    for family in ("llama3.1", "llama3.2"):
        text = pairs[family][1].apply_chat_template(TOOL_TURN, tools=WEATHER)
        assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n")
        assert '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>' in text
        assert "<|start_header_id|>ipython<|end_header_id|>\n\nsunny<|eot_id|>" in text
    assert "Today Date: 26 Jul 2024" in pairs["llama3.1"][1].apply_chat_template(TOOL_TURN)
    assert "Today Date: 26 Jul 2024" not in pairs["llama3.2"][1].apply_chat_template(TOOL_TURN)  # strftime_now


def test_a_templates_own_refusal_is_shown_when_it_is_the_templates_text(pairs) -> None:
    _, ours = pairs["mistral"]
    with pytest.raises(RequestRejected) as raised:
        ours.apply_chat_template([ChatMessage("user", "CANARY-a"), ChatMessage("user", "CANARY-b")])
    assert raised.value.reason == "invalid_messages"
    assert "Roles must alternate user/assistant" in str(raised.value) and "CANARY" not in str(raised.value)


def test_mistral_renders_tools_before_the_last_user_turn(pairs) -> None:
    _, ours = pairs["mistral"]
    call = ToolCall("abcDEF123", "get_weather", {"city": "Paris"})
    text = ours.apply_chat_template([ChatMessage("user", "Weather?"), ChatMessage("assistant", None, (call,)),
                                     ChatMessage("tool", "sunny", tool_call_id=call.id),
                                     ChatMessage("assistant", "Sunny."), ChatMessage("user", "Thanks")], tools=WEATHER)
    assert '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abcDEF123"}]<|eot_id|>' in text
    assert '[TOOL_RESULTS] {"content": sunny, "call_id": "abcDEF123"}[/TOOL_RESULTS]' in text
    assert text.index("[AVAILABLE_TOOLS]") > text.index("Sunny.") and text.endswith("[INST] Thanks[/INST]")


# ----- where templates come from -----------------------------------------------------------------------

def template_of(folder: Path, tools: list[dict] | None = None) -> str:
    return Tokenizer(folder).apply_chat_template([ChatMessage("user", "Hi")], tools=tools)


def test_chat_template_jinja_wins_over_tokenizer_config(tmp_path) -> None:
    folder = model_folder(tmp_path, "qwen2.5", {"chat_template": "from the config"})
    assert template_of(folder).startswith("<|im_start|>system\n")
    (folder / "chat_template.jinja").unlink()
    assert template_of(folder) == "from the config"


def test_named_templates_render_tool_use_only_when_tools_are_given(tmp_path) -> None:
    named = [{"name": "default", "template": "plain"}, {"name": "tool_use", "template": "tools: {{ tools | length }}"}]
    folder = model_folder(tmp_path, "named", {"chat_template": named}, template_file=False)
    assert template_of(folder) == "plain" and template_of(folder, WEATHER) == "tools: 1"
    (folder / "chat_templates").mkdir()
    (folder / "chat_templates" / "tool_use.jinja").write_text("file tools")
    (folder / "chat_template.jinja").write_text("file plain")
    assert template_of(folder) == "file plain" and template_of(folder, WEATHER) == "file tools"


def test_special_tokens_reach_the_template(tmp_path) -> None:
    folder = model_folder(tmp_path, "tokens", {"chat_template": "{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|"
                                               "{{ unk_token }}|{{ {'a': '<é>'} | tojson }}"}, template_file=False)
    # Undefined renders as nothing; tojson neither escapes HTML nor non-ASCII, as transformers' filter.
    assert template_of(folder) == '<|begin_of_text|>|<|eot_id|>|<|end_of_text|>||{"a": "<é>"}'


def test_a_template_that_is_not_jinja_is_a_load_error(tmp_path) -> None:
    folder = model_folder(tmp_path, "broken", {"chat_template": "{% for m in messages %}"}, template_file=False)
    with pytest.raises(ModelLoadError):
        Tokenizer(folder)


def test_named_templates_without_a_default_are_a_load_error(tmp_path) -> None:
    named = [{"name": "a", "template": "x"}, {"name": "b", "template": "y"}]
    with pytest.raises(ModelLoadError):
        Tokenizer(model_folder(tmp_path, "nodefault", {"chat_template": named}, template_file=False))


def test_a_namespace_refuses_underscore_attributes(tmp_path) -> None:
    folder = model_folder(tmp_path, "ns", {"chat_template": "{% set ns = namespace(_x=1) %}{{ ns._x }}"},
                          template_file=False)
    with pytest.raises(RequestRejected):
        template_of(folder)
