"""Tool calls read out of model text: the format chosen from the chat template, whole and streamed answers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from enclave.tool_calls import (
    ChoiceCalls,
    FORCED_JSON,
    HERMES,
    LLAMA_JSON,
    MISTRAL_ARGS,
    MISTRAL_JSON,
    Parsed,
    parse_whole,
    parser_for,
    tool_format,
)
from tests.family_support import MODELS, family_folder

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
TIME = '{"name": "get_time", "arguments": {"zone": "CET", "exact": true}}'


def streamed(format: str, pieces: list[str]) -> tuple[str, list[tuple[str, dict]]]:
    """The content and the calls (name, arguments) a stream of pieces gives."""
    parser = parser_for(format)
    total = Parsed()
    for piece in pieces:
        total.extend(parser.feed(piece))
    total.extend(parser.finish())
    return total.content, [(c.name, loaded(c.arguments)) for c in total.calls]


def whole(format: str, text: str) -> tuple[str, list[tuple[str, dict]]]:
    parsed = parse_whole(format, text)
    return parsed.content, [(c.name, loaded(c.arguments)) for c in parsed.calls]


def loaded(arguments: str) -> dict | str:
    """The arguments as an object; as text where the model's own text is not JSON (a streamed call's)."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def every_split(format: str, text: str) -> None:
    """Split at every character boundary (and one character at a time), the stream adds up to the whole."""
    expected = whole(format, text)
    for cut in range(len(text) + 1):
        assert streamed(format, [text[:cut], text[cut:]]) == expected
    assert streamed(format, list(text)) == expected


@pytest.mark.parametrize(("template", "format"), [
    ("qwen2.5", HERMES), ("qwen3", HERMES), ("llama3.1", LLAMA_JSON), ("llama3.2", LLAMA_JSON), ("mistral", MISTRAL_JSON),
])
def test_the_format_is_read_from_the_chat_template(template: str, format: str | None) -> None:
    assert tool_format((TEMPLATES / f"{template}.jinja").read_text()) == format


def family_template(name: str) -> str:
    return json.loads((family_folder(name) / "tokenizer_config.json").read_text())["chat_template"]


def more_template(name: str) -> str:
    return json.loads((MODELS / "more-chat-templates" / "templates.json").read_text())[name]["template"]


@pytest.mark.parametrize(("name", "format"), [
    ("llama-3.1-8b-instruct", LLAMA_JSON), ("llama-3.2-3b-instruct", LLAMA_JSON), ("qwen2.5-3b-instruct", HERMES),
    ("qwen3-0.6b", HERMES), ("mistral-7b-instruct-v0.3", MISTRAL_JSON), ("deepseek-r1-distill-qwen-32b", None),
])
def test_the_format_is_read_from_each_real_familys_template(name: str, format: str | None) -> None:
    assert tool_format(family_template(name)) == format


@pytest.mark.parametrize(("name", "format"), [
    ("mistral-small-3.2-24b-instruct-2506", MISTRAL_ARGS), ("mistral-nemo-instruct-2407", MISTRAL_JSON),
    ("llama-3.3-70b-instruct", LLAMA_JSON), ("qwen3-0.6b", HERMES),
])
def test_mistral_small_3_reads_as_name_then_args_not_as_a_json_list(name: str, format: str) -> None:
    """Mistral Small 3.x writes `[TOOL_CALLS]name[ARGS]{...}`: its template shows `[ARGS]`."""
    assert tool_format(more_template(name)) == format


def test_a_template_that_shows_no_call_format_has_none() -> None:
    plain = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    assert tool_format(plain) is None and tool_format(None) is None


HERMES_CASES = [
    (f"<tool_call>\n{WEATHER}\n</tool_call>", "", [("get_weather", {"city": "Paris"})]),
    (f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>\n", "",
     [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET", "exact": True})]),
    (f"Let me look.\n\n<tool_call>\n{WEATHER}\n</tool_call>", "Let me look.", [("get_weather", {"city": "Paris"})]),
    (f"<tool_call>\n{WEATHER}", "", [("get_weather", {"city": "Paris"})]),  # stopped before the closing tag
    (f"<tool_call>\n{WEATHER}\n</tool_call>\nDone.", "\nDone.", [("get_weather", {"city": "Paris"})]),
    ("Plain answer, <b>no</b> call.\n\n", "Plain answer, <b>no</b> call.\n\n", []),
    ("Almost a tag: <tool_", "Almost a tag: <tool_", []),
    ("A\n<tool_call>not json</tool_call> B", "A\n<tool_call>not json</tool_call> B", []),
    # Malformed blocks stay content, as vLLM keeps them: the outer "}" left out, the arguments never closed.
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}</tool_call>',
     '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}</tool_call>', []),
    ('<tool_call>{"name": "f", "arguments": {"a": 1</tool_call>', '<tool_call>{"name": "f", "arguments": {"a": 1</tool_call>', []),
    (f"Sure.<tool_call>{WEATHER}</tool_call><tool_call>{{\"name\": \"f\"</tool_call>",
     'Sure.<tool_call>{"name": "f"</tool_call>', [("get_weather", {"city": "Paris"})]),
    ('<tool_call>{"name": "x", "arguments": [1]}</tool_call>', '<tool_call>{"name": "x", "arguments": [1]}</tool_call>', []),
    ('<tool_call>{"arguments": {}, "name": "no_args_first"}</tool_call>', "", [("no_args_first", {})]),
]


@pytest.mark.parametrize(("text", "content", "calls"), HERMES_CASES)
def test_hermes_blocks_become_calls_whole_and_streamed(text: str, content: str, calls: list) -> None:
    assert whole(HERMES, text) == (content, calls)
    every_split(HERMES, text)


LLAMA_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [("get_weather", {"city": "Paris"})]),
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [("get_weather", {"city": "Paris"})]),
    (' {"name": "a", "parameters": {}}; {"name": "b", "parameters": {"k": 1}}', "", [("a", {}), ("b", {"k": 1})]),
    ('{"name": "get_weather", "arguments": {"city": "Paris"}}', "", [("get_weather", {"city": "Paris"})]),
    ("  The weather is {mild}.", "  The weather is {mild}.", []),
    ('{"city": "Paris"}', '{"city": "Paris"}', []),
    ("Sure: {\"name\": \"a\", \"parameters\": {}}", "Sure: {\"name\": \"a\", \"parameters\": {}}", []),
    ("<|py", "<|py", []),
    # A ";" inside a string argument does not split the calls.
    ('{"name": "sql", "parameters": {"q": "SELECT 1; SELECT 2"}}; {"name": "b", "parameters": {}}', "",
     [("sql", {"q": "SELECT 1; SELECT 2"}), ("b", {})]),
    ('{"name": "a", "parameters": {}}; not a call', '{"name": "a", "parameters": {}}; not a call', []),
    ('{"name": "a", "parameters": {"x": 1}', '{"name": "a", "parameters": {"x": 1}', []),  # malformed: content
]


@pytest.mark.parametrize(("text", "content", "calls"), LLAMA_CASES)
def test_llama_json_answers_become_calls_whole_and_streamed(text: str, content: str, calls: list) -> None:
    assert whole(LLAMA_JSON, text) == (content, calls)
    every_split(LLAMA_JSON, text)


MISTRAL_CASES = [
    ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]', "", [("get_weather", {"city": "Paris"})]),
    (' [{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"k": 1}}]', "", [("a", {}), ("b", {"k": 1})]),
    ("[1] is the first source.", "[1] is the first source.", []),
    ("[TOOL_CALLS] not json", "[TOOL_CALLS] not json", []),
    ("Sunny, 20 degrees.", "Sunny, 20 degrees.", []),
]


MISTRAL_ARGS_CASES = [
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "", [("get_weather", {"city": "Paris"})]),
    ('[TOOL_CALLS]a[ARGS]{}[TOOL_CALLS]b[ARGS]{"k": "[ARGS]"}', "", [("a", {}), ("b", {"k": "[ARGS]"})]),
    ('Let me check.\n[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris"}', "Let me check.",
     [("get_weather", {"city": "Paris"})]),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Par', '[TOOL_CALLS]get_weather[ARGS]{"city": "Par', []),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"} and more', '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"} and more', []),
    ('[TOOL_CALLS] [{"name": "a", "arguments": {}}]', '[TOOL_CALLS] [{"name": "a", "arguments": {}}]', []),
    ("Sunny, [20] degrees.", "Sunny, [20] degrees.", []),
]


@pytest.mark.parametrize(("format", "text", "content", "calls"),
                         [(MISTRAL_JSON, *case) for case in MISTRAL_CASES] + [(MISTRAL_ARGS, *case) for case in MISTRAL_ARGS_CASES])
def test_mistral_calls_become_calls_whole_and_streamed(format: str, text: str, content: str, calls: list) -> None:
    """Mistral 7B v0.3 and Nemo write a JSON list after `[TOOL_CALLS]`; Mistral Small 3.x `[TOOL_CALLS]name[ARGS]{...}`."""
    assert whole(format, text) == (content, calls)
    every_split(format, text)


def test_a_forced_answer_is_a_list_of_calls() -> None:
    text = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]'
    assert whole(FORCED_JSON, text) == ("", [("a", {"x": 1}), ("b", {})])
    assert whole(LLAMA_JSON, text)[1] == []  # a list is only read where the grammar forced it


def test_content_streams_before_the_answer_ends() -> None:
    """Plain text is given out as it comes (all but what may start a tag, or whitespace that may precede one)."""
    parser = parser_for(HERMES)
    assert parser.feed("Hello there, <to").content == "Hello there,"
    assert parser.feed("day> it is").content == " <today> it is"
    llama = parser_for(LLAMA_JSON)
    assert llama.feed("  It").content == "  It" and llama.feed(" rains").content == " rains"


def test_a_forced_call_streams_its_name_first_then_its_arguments_as_written() -> None:
    """As OpenAI streams a call: named at once, its arguments in pieces as the model writes them."""
    parser = parser_for(FORCED_JSON)
    assert parser.feed('[{"name":"get_wea').pieces == []
    first = parser.feed('ther","parameters":{"city":"Pa')
    [header, part] = [piece.fragment() for piece in first.pieces]
    assert header["index"] == 0 and header["id"].startswith("call_") and header["type"] == "function"
    assert header["function"] == {"name": "get_weather", "arguments": ""}
    assert part == {"index": 0, "function": {"arguments": '{"city":"Pa'}}
    assert [p.arguments for p in parser.feed('ris\\"}"').pieces] == ['ris\\"}"']  # a brace in a string
    rest = parser.feed('}},{"name":"get_time","parameters":{}}]')
    rest.extend(parser.finish())
    assert [(p.call, p.name, p.arguments) for p in rest.pieces] == [
        (0, None, "}"), (1, "get_time", ""), (1, None, "{}")]
    assert rest.content == ""


def test_a_chosen_call_is_named_then_given_its_arguments_once_it_parses() -> None:
    """A call the model chose is given out only once it is whole and parses, still named first."""
    parser = parser_for(HERMES)
    assert parser.feed('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa').pieces == []
    parsed = parser.feed('ris"}}\n</tool_call>')
    assert [(p.name, p.arguments) for p in parsed.pieces] == [("get_weather", ""), (None, '{"city": "Paris"}')]


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    calls = ChoiceCalls(HERMES, parallel=False)
    parsed = calls.read(f"<tool_call>{WEATHER}</tool_call>", last=False)
    parsed.extend(calls.read(f"<tool_call>{TIME}</tool_call>", last=True))
    assert [call.name for call in parsed.calls] == ["get_weather"] and calls.finish_reason("stop") == "tool_calls"
    assert ChoiceCalls(HERMES).finish_reason("stop") == "stop" and calls.finish_reason("length") == "length"


OFFERED = frozenset({"get_weather"})
UNDECLARED = '{"name": "send_email", "arguments": {"to": "x"}}'
# Each format's answer calling get_weather (declared) and send_email (not), and what the first call looks like.
UNDECLARED_ANSWERS = {
    HERMES: f"Sure.\n<tool_call>\n{UNDECLARED}\n</tool_call>",
    LLAMA_JSON: '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                '{"name": "send_email", "parameters": {"to": "x"}}',
    MISTRAL_JSON: f"[TOOL_CALLS][{WEATHER}, {UNDECLARED}]",
    MISTRAL_ARGS: 'Checking. [TOOL_CALLS]send_email[ARGS]{"to": "x"}',
}


def read_offered(format: str, pieces: list[str]) -> tuple[Parsed, ChoiceCalls]:
    calls, total = ChoiceCalls(format, declared=OFFERED), Parsed()
    for index, piece in enumerate(pieces):
        total.extend(calls.read(piece, last=index == len(pieces) - 1))
    return total, calls


@pytest.mark.parametrize("format", list(UNDECLARED_ANSWERS))
def test_a_call_to_an_undeclared_function_stays_content_whole_and_streamed(format: str) -> None:
    text = UNDECLARED_ANSWERS[format]
    for pieces in ([text], list(text)):
        parsed, calls = read_offered(format, pieces)
        assert parsed.pieces == [] and parsed.content == text
        assert calls.finish_reason("stop") == "stop"
    assert [call.name for call in parse_whole(format, text).calls]  # without `declared`: read as calls


def test_a_hermes_block_naming_an_undeclared_function_stays_beside_a_declared_call() -> None:
    text = f"<tool_call>{UNDECLARED}</tool_call>\n<tool_call>{WEATHER}</tool_call>"
    for pieces in ([text], list(text)):
        parsed, calls = read_offered(HERMES, pieces)
        assert [call.name for call in parsed.calls] == ["get_weather"]
        assert parsed.content == f"<tool_call>{UNDECLARED}</tool_call>"
        assert calls.finish_reason("stop") == "tool_calls"


def test_call_ids_are_random_per_call() -> None:
    text = f"<tool_call>{WEATHER}</tool_call><tool_call>{WEATHER}</tool_call>"
    ids = [call.id for _ in range(3) for call in parse_whole(HERMES, text).calls]
    assert len(set(ids)) == len(ids) == 6
    assert all(i.startswith("call_") and len(i) == len("call_") + 24 for i in ids)


PIECES = st.sampled_from(["<tool_call>", "</tool_call>", "<tool", "_call>", "\n", " ", "x", "{", "}", WEATHER, TIME,
                          "<|python_tag|>", '{"name": "f", "parameters": {}}', ";", "é", "[TOOL_CALLS]", "[", "]",
                          "[ARGS]", '{"k": "}"}', '[{"name":"f","parameters":{"a":"]}"}}'])


@settings(max_examples=300, deadline=None)
@given(st.lists(PIECES | st.text(max_size=4), max_size=10),
       st.sampled_from([HERMES, LLAMA_JSON, MISTRAL_JSON, MISTRAL_ARGS, FORCED_JSON]),
       st.data())
def test_any_text_streams_as_its_whole_parse_and_plain_text_is_unchanged(pieces, format, data) -> None:
    text = "".join(pieces)
    expected = whole(format, text)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=4)))
    split = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    assert streamed(format, split) == expected
    if not expected[1]:
        assert expected[0] == text


def test_reprs_show_nothing_a_call_or_message_says() -> None:
    from engine import ChatMessage, ToolCall

    canary = "CANARY-repr-31f"
    call = ToolCall(canary, canary, {canary: canary})
    shown = [repr(call), repr(ChatMessage("user", canary, (call,), canary, canary)),
             repr(parse_whole(HERMES, '<tool_call>{"name": "f", "arguments": {"k": "%s"}}</tool_call>' % canary).calls[0])]
    assert all(canary not in text for text in shown)
