"""Chat templates render byte for byte as `transformers.apply_chat_template` renders them.

The templates are the real ones of the families Veil serves (tests/data/models: Llama 3.1 and 3.2,
Qwen2.5, Qwen3, Mistral 7B Instruct v0.3), plus more real templates (Mistral-Nemo, Mistral-Small 3.2,
Llama 3.3, Qwen3's first, DeepSeek-R1-Distill's) and vLLM's tool-calling templates. Each folder is
loaded by transformers' own AutoTokenizer and by the engine's Tokenizer; generated conversations (plain,
with tools, replaying tool calls and their results) must render the same text, or fail in both.
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
from tests.family_support import FAMILIES, MODELS, family_folder

SPECIAL_TOKENS = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "pad_token": "<|end_of_text|>"}
HYPOTHESIS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MORE = json.loads((MODELS / "more-chat-templates" / "templates.json").read_text())
VLLM = MODELS / "vllm-tool-templates"


def model_folder(root: Path, name: str, config: dict | None = None) -> Path:
    """The tiny model's tokenizer with a tokenizer_config.json of `config`: for where templates come from."""
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(tiny_model_dir() / "tokenizer.json", folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({**SPECIAL_TOKENS, **(config or {})}))
    return folder


def with_template(root: Path, family: str, name: str, template: str) -> Path:
    """A family's folder (its tokenizer and special tokens) with another real template as chat_template.jinja."""
    folder = root / name
    shutil.copytree(family_folder(family), folder)
    (folder / "chat_template.jinja").write_text(template)
    return folder


def both(folder: Path) -> tuple:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(folder)), Tokenizer(folder)


@pytest.fixture(scope="module")
def pairs() -> dict[str, tuple]:
    """Per family: (transformers' tokenizer, the engine's) over the family's real folder."""
    return {family: both(family_folder(family)) for family in FAMILIES}


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
    """The message as an OpenAI client sends it (None where unset), tool arguments as dicts; an assistant's
    null content as vLLM passes it: "" (none of these templates tests it against none)."""
    calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
             for c in message.tool_calls] or None
    content = "" if message.content is None and message.role == "assistant" else message.content
    return {"role": message.role, "content": content, "tool_calls": calls,
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

QWEN25, QWEN3, LLAMA31, LLAMA32, MISTRAL = FAMILIES[2], FAMILIES[3], FAMILIES[0], FAMILIES[1], FAMILIES[4]
WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "Today's weather",
                                             "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = ToolCall("call00001", "get_weather", {"city": "Paris"})
TOOL_TURN = [ChatMessage("user", "Weather in Paris?"), ChatMessage("assistant", None, (CALL,)),
             ChatMessage("tool", "sunny", tool_call_id=CALL.id)]
REPLAY = [*TOOL_TURN, ChatMessage("assistant", "Sunny."), ChatMessage("user", "Thanks")]


def test_qwen25_renders_a_plain_chat_whose_messages_have_no_tool_calls(pairs) -> None:
    """Qwen2.5's template reads `message.tool_calls` of every assistant message: undefined must not fail."""
    _, ours = pairs[QWEN25]
    text = ours.apply_chat_template([ChatMessage("user", "Hi"), ChatMessage("assistant", "Hello"),
                                     ChatMessage("user", "Bye")])
    assert text.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")
    assert text.endswith("<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n")


def test_qwen_renders_tools_calls_and_results(pairs) -> None:
    for family in (QWEN25, QWEN3):
        text = pairs[family][1].apply_chat_template(TOOL_TURN, tools=WEATHER)
        assert json.dumps(WEATHER[0]) in text
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
        assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>" in text


def test_qwen3_keeps_reasoning_only_after_the_last_question(pairs) -> None:
    _, ours = pairs[QWEN3]
    text = ours.apply_chat_template([ChatMessage("user", "A?"), ChatMessage("assistant", "<think>\nold\n</think>\n\nA."),
                                     ChatMessage("user", "B?"), ChatMessage("assistant", "<think>new</think>B.")],
                                    add_generation_prompt=False)
    assert "old" not in text and "<|im_start|>assistant\nA.<|im_end|>" in text
    assert "<|im_start|>assistant\n<think>\nnew\n</think>\n\nB.<|im_end|>" in text


def test_llama_writes_the_ipython_environment_the_date_and_json_calls(pairs) -> None:
    for family in (LLAMA31, LLAMA32):
        text = pairs[family][1].apply_chat_template(TOOL_TURN, tools=WEATHER)
        assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n")
        assert '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>' in text
        assert '<|start_header_id|>ipython<|end_header_id|>\n\n"sunny"<|eot_id|>' in text
    assert "Today Date: 26 Jul 2024" in pairs[LLAMA31][1].apply_chat_template(TOOL_TURN)
    assert "Today Date: 26 Jul 2024" not in pairs[LLAMA32][1].apply_chat_template(TOOL_TURN)  # strftime_now


def test_a_templates_own_refusal_is_shown_when_it_is_the_templates_text(pairs) -> None:
    _, ours = pairs[MISTRAL]
    with pytest.raises(RequestRejected) as raised:
        ours.apply_chat_template([ChatMessage("user", "CANARY-a"), ChatMessage("user", "CANARY-b")])
    assert raised.value.reason == "invalid_messages"
    assert "roles must alternate user/assistant" in str(raised.value) and "CANARY" not in str(raised.value)


def test_mistral_renders_tools_before_the_last_user_turn(pairs) -> None:
    _, ours = pairs[MISTRAL]
    call = ToolCall("abcDEF123", "get_weather", {"city": "Paris"})
    text = ours.apply_chat_template([ChatMessage("user", "Weather?"), ChatMessage("assistant", None, (call,)),
                                     ChatMessage("tool", "sunny", tool_call_id=call.id),
                                     ChatMessage("assistant", "Sunny."), ChatMessage("user", "Thanks")], tools=WEATHER)
    assert '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abcDEF123"}]</s>' in text
    assert '[TOOL_RESULTS] {"content": sunny, "call_id": "abcDEF123"}[/TOOL_RESULTS]' in text
    assert text.index("[AVAILABLE_TOOLS]") > text.index("Sunny.") and text.endswith("[INST] Thanks[/INST]")


# ----- more real templates: on their family's tokenizer ------------------------------------------------

# Each template with the family folder whose tokenizer it goes with.
OTHER_TEMPLATES = {
    "mistral-nemo-instruct-2407": (MISTRAL, MORE["mistral-nemo-instruct-2407"]["template"]),
    "mistral-small-3.2-24b-instruct-2506": (MISTRAL, MORE["mistral-small-3.2-24b-instruct-2506"]["template"]),
    "llama-3.3-70b-instruct": (LLAMA31, MORE["llama-3.3-70b-instruct"]["template"]),
    "qwen3-0.6b-first": (QWEN3, MORE["qwen3-0.6b"]["template"]),
    **{path.stem: ({"mistral": MISTRAL, "llama3": LLAMA31}.get(path.stem.split("_")[3].split(".")[0], QWEN25),
                   path.read_text()) for path in sorted(VLLM.glob("*.jinja"))},
}


@pytest.mark.parametrize("name", sorted(OTHER_TEMPLATES))
def test_other_real_templates_render_plain_and_tool_replays_as_transformers(tmp_path, name: str) -> None:
    family, template = OTHER_TEMPLATES[name]
    pair = both(with_template(tmp_path, family, name, template))
    tool_list = [{"type": "function", "function": {**WEATHER[0]["function"], "description": "Weather"}}]
    for messages, given_tools in ((REPLAY[:1], None), (REPLAY, tool_list), (TOOL_TURN, tool_list)):
        expected, got = render_both(pair, messages, given_tools, True)
        assert expected is not None and got == expected


# ----- an assistant turn that only calls tools: OpenAI's `content: null` --------------------------------

def test_qwen3s_first_template_renders_a_replayed_call_whose_content_is_null(tmp_path) -> None:
    """Qwen3-0.6B's first template reads the content of every assistant turn as text: vLLM passes ""."""
    theirs, ours = both(with_template(tmp_path, QWEN3, "qwen3-first", MORE["qwen3-0.6b"]["template"]))
    text = ours.apply_chat_template(REPLAY, tools=WEATHER)  # refused before: the dropped key failed the template
    expected = theirs.apply_chat_template([as_transformers_gets_it(m) for m in REPLAY], tools=WEATHER,
                                          add_generation_prompt=True, tokenize=False)
    assert text == expected
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather"' in text


def test_deepseek_r1s_template_sees_a_null_content_as_none() -> None:
    """DeepSeek-R1's own template tells a tool-calling turn by `message['content'] is none`: it gets None,
    so the turn is not rendered as an empty answer. (Its call branch joins the arguments as a string, so
    transformers and Veil both refuse such a replay; vLLM's DeepSeek-R1 template renders it, above.)"""
    from engine.chat_template import ChatTemplates

    folder = family_folder("deepseek-r1-distill-qwen-32b")
    templates = ChatTemplates.load(folder, json.loads((folder / "tokenizer_config.json").read_text()))
    plain = templates.render([ChatMessage("user", "Hi"), ChatMessage("assistant", "Hello"),
                              ChatMessage("user", "Bye")], None, True)
    assert plain == "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜>Hello<｜end▁of▁sentence｜><｜User｜>Bye<｜Assistant｜>"
    with pytest.raises(RequestRejected):  # with "" the calls would vanish: "<｜Assistant｜><｜end▁of▁sentence｜>"
        templates.render(TOOL_TURN, None, True)


# ----- where templates come from -----------------------------------------------------------------------

def template_of(folder: Path, tools: list[dict] | None = None) -> str:
    return Tokenizer(folder).apply_chat_template([ChatMessage("user", "Hi")], tools=tools)


def test_chat_template_jinja_wins_over_tokenizer_config(tmp_path) -> None:
    folder = model_folder(tmp_path, "qwen2.5", {"chat_template": "from the config"})
    qwen = json.loads((family_folder(QWEN25) / "tokenizer_config.json").read_text())["chat_template"]
    (folder / "chat_template.jinja").write_text(qwen)
    assert template_of(folder).startswith("<|im_start|>system\n")
    (folder / "chat_template.jinja").unlink()
    assert template_of(folder) == "from the config"


def test_named_templates_render_tool_use_only_when_tools_are_given(tmp_path) -> None:
    named = [{"name": "default", "template": "plain"}, {"name": "tool_use", "template": "tools: {{ tools | length }}"}]
    folder = model_folder(tmp_path, "named", {"chat_template": named})
    assert template_of(folder) == "plain" and template_of(folder, WEATHER) == "tools: 1"
    (folder / "chat_templates").mkdir()
    (folder / "chat_templates" / "tool_use.jinja").write_text("file tools")
    (folder / "chat_template.jinja").write_text("file plain")
    assert template_of(folder) == "file plain" and template_of(folder, WEATHER) == "file tools"


def test_special_tokens_reach_the_template(tmp_path) -> None:
    folder = model_folder(tmp_path, "tokens", {"chat_template": "{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|"
                                               "{{ unk_token }}|{{ {'a': '<é>'} | tojson }}"})
    # Undefined renders as nothing; tojson neither escapes HTML nor non-ASCII, as transformers' filter.
    assert template_of(folder) == '<|begin_of_text|>|<|eot_id|>|<|end_of_text|>||{"a": "<é>"}'


def test_a_template_that_is_not_jinja_is_a_load_error(tmp_path) -> None:
    folder = model_folder(tmp_path, "broken", {"chat_template": "{% for m in messages %}"})
    with pytest.raises(ModelLoadError):
        Tokenizer(folder)


def test_named_templates_without_a_default_are_a_load_error(tmp_path) -> None:
    named = [{"name": "a", "template": "x"}, {"name": "b", "template": "y"}]
    with pytest.raises(ModelLoadError):
        Tokenizer(model_folder(tmp_path, "nodefault", {"chat_template": named}))


def test_a_namespace_refuses_underscore_attributes(tmp_path) -> None:
    folder = model_folder(tmp_path, "ns", {"chat_template": "{% set ns = namespace(_x=1) %}{{ ns._x }}"})
    with pytest.raises(RequestRejected):
        template_of(folder)
