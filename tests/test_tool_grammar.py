"""`tool_choice: "auto"` beside a response format: the compiled grammar, on the real families' vocabularies.

The answer may be calls in the model's own format (Qwen's Hermes `<tool_call>` blocks, Llama 3.1's JSON
with `"parameters"`, Mistral's `[TOOL_CALLS]`), each to a declared function with arguments valid against
its schema, or text in the response format, and nothing else. Each text is fed to the engine's own
matcher (`GrammarCompiler`) as the family's tokenizer writes it, special markers as their tokens.
"""

from __future__ import annotations

import json
import re

import pytest
from tokenizers import Tokenizer

from enclave.tool_calls import (FORCED_JSON, HERMES, LLAMA_JSON, MISTRAL_ARGS, MISTRAL_JSON, ChoiceCalls, markers,
                                parse_whole)
from enclave.tool_grammar import calls_in_format, forced_calls
from engine import RequestRejected, StructuredOutput
from engine.chat_template import ChatMessage, ChatTemplates, ToolCall
from engine.structured import GrammarCompiler
from engine.tokenizer import Tokenizer as EngineTokenizer
from tests.family_support import MODELS, family_folder

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer"}},
           "required": ["city"]}
FUNCTIONS = [{"name": "get_weather", "parameters": WEATHER},
             {"name": "get_time", "parameters": {"type": "object", "properties": {"utc": {"type": "boolean"}}}}]
ANSWER = StructuredOutput("json_schema", json.dumps({
    "type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"], "additionalProperties": False}))
# Text that is neither a call nor an answer in the format, in every family. The answer is compact JSON, as
# OpenAI writes it (`engine.structured.JSON_OPTIONS`), where calls are spaced as the templates write them.
NEITHER = ['Sure! {"answer":"hi"}', '{"answer":1}', '{"reply":"hi"}', "plain words", '{"answer": "hi"}']


class Family:
    """A family's real tokenizer and the engine's grammar compiler on its vocabulary."""

    def __init__(self, name: str, eos: int) -> None:
        folder = family_folder(name)
        text = (folder / "tokenizer.json").read_text()
        self.tokenizer = Tokenizer.from_str(text)
        vocab_size = json.loads((folder / "config.json").read_text())["vocab_size"]
        self.compiler = GrammarCompiler(text, vocab_size, [eos])

    def special(self, format: str) -> dict[str, int]:
        """The format's markers that are special tokens, by id: what the node passes `calls_in_format`."""
        added = self.tokenizer.get_added_tokens_decoder()
        ids = {marker: self.tokenizer.token_to_id(marker) for marker in markers(format)}
        return {marker: token for marker, token in ids.items() if token is not None and added[token].special}

    def guide(self, format: str, reasoning: str = "none"):
        calls = calls_in_format(FUNCTIONS, format, one=False, special=self.special(format))
        return self.compiler.compile(StructuredOutput(ANSWER.kind, ANSWER.spec, reasoning=reasoning, alternative=calls))

    def admits(self, guide, text: str) -> bool:
        """Whether the grammar takes the whole `text`, as the tokenizer encodes it, and may end there."""
        matcher = guide.fork().matcher
        ids = self.written(text)
        if matcher.validate_tokens(ids) != len(ids):
            return False
        assert matcher.consume_tokens(ids)
        return matcher.is_accepting()

    def written(self, text: str) -> list[int]:
        """`text` as the model writes it after a prompt: without the word-start space SentencePiece (Mistral's)
        puts before a text's first word, encoded after a newline as the engine encodes a chat's pieces."""
        newline = self.tokenizer.encode("\n", add_special_tokens=False).ids
        ids = self.tokenizer.encode("\n" + text, add_special_tokens=False).ids
        return ids[len(newline):] if ids[:len(newline)] == newline else self.tokenizer.encode(text, False).ids


@pytest.fixture(scope="module")
def qwen() -> Family:
    return Family("qwen2.5-3b-instruct", eos=151645)


@pytest.fixture(scope="module")
def llama() -> Family:
    return Family("llama-3.1-8b-instruct", eos=128009)


@pytest.fixture(scope="module")
def mistral() -> Family:
    return Family("mistral-7b-instruct-v0.3", eos=2)


def test_hermes_admits_calls_or_an_answer_and_nothing_else(qwen: Family) -> None:
    guide = qwen.guide(HERMES)
    one = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    two = one + '\n<tool_call>\n{"name": "get_time", "arguments": {"utc": true}}\n</tool_call>'
    assert qwen.tokenizer.encode(one, add_special_tokens=False).ids[0] == 151657  # `<tool_call>`: one added token
    for text in (one, two, '{"answer":"hi"}'):
        assert qwen.admits(guide, text), text
    wrong_calls = ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
                   '<tool_call>\n{"name": "get_news", "arguments": {}}\n</tool_call>',
                   '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "extra": 1}}\n</tool_call>',
                   one + ' {"answer":"hi"}', 'Let me check. ' + one]
    for text in NEITHER + wrong_calls:
        assert not qwen.admits(guide, text), text
    assert [call.name for call in parse_whole(HERMES, two).calls] == ["get_weather", "get_time"]


def test_llama_json_admits_calls_or_an_answer_and_nothing_else(llama: Family) -> None:
    guide = llama.guide(LLAMA_JSON)
    call = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    tagged = '<|python_tag|>' + call + '; {"name": "get_time", "parameters": {}}'
    assert 128010 in llama.tokenizer.encode(tagged, add_special_tokens=False).ids  # the special token itself
    for text in (call, tagged, '{"answer":"hi"}'):
        assert llama.admits(guide, text), text
    wrong_calls = ['{"name": "get_weather", "parameters": {"city": "Rome"}}', '{"name": "get_news", "parameters": {}}',
                   '{"name": "get_weather", "arguments": {"city": "Oslo"}}', call + "; plain words"]
    for text in NEITHER + wrong_calls:
        assert not llama.admits(guide, text), text
    parsed = parse_whole(LLAMA_JSON, tagged)
    assert [c.name for c in parsed.calls] == ["get_weather", "get_time"] and not parsed.content


@pytest.mark.parametrize(("format", "call"), [
    (MISTRAL_JSON,
     '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]'),
    (MISTRAL_ARGS, '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"utc": false}'),
])
def test_mistral_formats_admit_their_calls_and_refuse_other_text(mistral: Family, format: str, call: str) -> None:
    guide = mistral.guide(format)
    assert mistral.special(format)["[TOOL_CALLS]"] == 5  # a control token: named by its id in the grammar
    assert mistral.admits(guide, call)
    assert [c.name for c in parse_whole(format, call).calls] == ["get_weather", "get_time"]
    for text in ("[TOOL_CALLS] plain words", call.replace("Paris", "Rome"), "plain words"):
        assert not mistral.admits(guide, text), text


def test_a_reasoning_model_thinks_first_then_calls_or_answers() -> None:
    """Qwen3's `<think>` block comes before the union as before any constraint (`engine.reasoning_grammar`)."""
    qwen3 = Family("qwen3-0.6b", eos=151645)
    guide = qwen3.guide(HERMES, reasoning="block")
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    for text in ("<think>\nThe user asks.\n</think>\n\n" + call, '<think>\nok\n</think>\n\n{"answer":"hi"}'):
        assert qwen3.admits(guide, text), text
    for text in ("<think>\nok\n</think>\n\nplain words", call):  # a block first, then one of the two
        assert not qwen3.admits(guide, text), text


def test_a_tool_schema_the_node_cannot_compile_is_refused_naming_tools(qwen: Family) -> None:
    broken = [{"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "string", "pattern": "("}}}}]
    calls = calls_in_format(broken, HERMES, one=False, special={})
    with pytest.raises(RequestRejected) as refusal:
        qwen.compiler.compile(StructuredOutput(ANSWER.kind, ANSWER.spec, alternative=calls))
    assert str(refusal.value).startswith("tools ")
    bad_answer = StructuredOutput("json_schema", "{not json", alternative=calls_in_format(FUNCTIONS, HERMES, False, {}))
    with pytest.raises(RequestRejected) as refusal:
        qwen.compiler.compile(bad_answer)
    assert str(refusal.value).startswith("response_format ")


def wide_ranges(offset: int) -> dict:
    """An object of 400 numbers, each between bounds of 15 digits written for it alone: the lexer llguidance
    builds for it takes about 60% of the node's fuel (`engine.structured._LIMITS`), so one compiles and two
    together cannot. `offset` makes the bounds of two such schemas differ (the same regex is built once)."""
    def bounds(i: int) -> dict:
        return {"type": "number", "minimum": -428571428571428 - (i + offset) * 7919 + 0.125,
                "maximum": 666666666666666 + (i + offset) * 104729 + 0.375}
    return {"type": "object", "properties": {f"p{i}": bounds(i) for i in range(400)}}


def test_parts_over_the_limits_only_together_are_refused_naming_tools_and_the_format(qwen: Family) -> None:
    answer = StructuredOutput("json_schema", json.dumps(wide_ranges(0)), "response_format.json_schema.schema")
    calls = calls_in_format([{"name": "measure", "parameters": wide_ranges(10**6)}], HERMES, one=False, special={})
    for part in (answer, calls):
        qwen.compiler.compile(part)  # each alone is within the limits
    with pytest.raises(RequestRejected) as refusal:
        qwen.compiler.compile(StructuredOutput(answer.kind, answer.spec, answer.field, alternative=calls))
    assert str(refusal.value) == ("tools together with response_format.json_schema.schema is over this node's limits "
                                  "for compiling a grammar")


# ----- calls spaced as the model's template writes them ---------------------------------------------------------

MORE = json.loads((MODELS / "more-chat-templates" / "templates.json").read_text())
REPLAYED = ToolCall("call00001", "get_weather", {"city": "Paris", "days": 3})
# Each format's real template (a family folder, or a template of more-chat-templates with the Mistral v0.3
# vocabulary), where its assistant turn starts and ends in a rendered chat, and the replayed call's id as the
# template writes it in history: the node gives calls their ids, the model writes none.
TEMPLATES = {
    HERMES: ("qwen2.5-3b-instruct", "<|im_start|>assistant\n", "<|im_end|>", ""),
    LLAMA_JSON: ("llama-3.1-8b-instruct", "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>", ""),
    MISTRAL_JSON: ("mistral-7b-instruct-v0.3", "[/INST]", "</s>", ', "id": "call00001"'),
    MISTRAL_ARGS: ("mistral-small-3.2-24b-instruct-2506", "[/INST]", "</s>", "[CALL_ID]call00001"),
}


def replayed_call(format: str, with_id: bool = False) -> str:
    """`REPLAYED` as the format's real template renders it in an assistant turn, through the node's own
    template code: the text the model was trained to write for that call (its id left out unless `with_id`)."""
    name, opening, closing, written_id = TEMPLATES[format]
    messages = [ChatMessage("user", "Weather in Paris?"), ChatMessage("assistant", None, (REPLAYED,)),
                ChatMessage("tool", "Sunny.", tool_call_id=REPLAYED.id)]
    tools = [{"type": "function", "function": function} for function in FUNCTIONS]
    if name in MORE:
        entry = MORE[name]
        templates = ChatTemplates({"default": entry["template"]},
                                  {"bos_token": entry["bos_token"], "eos_token": entry["eos_token"]})
        rendered = templates.render(messages, tools, add_generation_prompt=False)
    else:
        rendered = EngineTokenizer(family_folder(name)).apply_chat_template(messages, False, tools)
    turn = rendered[rendered.index(opening) + len(opening):]
    call = turn[:turn.index(closing)]
    assert written_id in call
    return call if with_id else call.replace(written_id, "", 1)


FORMAT_FAMILIES = {HERMES: "qwen", LLAMA_JSON: "llama", MISTRAL_JSON: "mistral", MISTRAL_ARGS: "mistral"}


@pytest.mark.parametrize("format", list(TEMPLATES))
def test_each_format_admits_a_call_spaced_as_its_real_template_writes_it(request, format: str) -> None:
    family: Family = request.getfixturevalue(FORMAT_FAMILIES[format])
    call = replayed_call(format)
    assert '{"city": "Paris", "days": 3}' in call  # json.dumps' separators: every real template's `tojson`
    assert family.admits(family.guide(format), call), call
    [parsed] = parse_whole(format, call).calls
    assert (parsed.name, json.loads(parsed.arguments)) == ("get_weather", REPLAYED.arguments)


@pytest.mark.parametrize("format", list(TEMPLATES))
def test_each_format_refuses_calls_spaced_otherwise(request, format: str) -> None:
    """The spacing is the template's and no other: no free whitespace a model could stall in, nor compact JSON."""
    family: Family = request.getfixturevalue(FORMAT_FAMILIES[format])
    guide = family.guide(format)
    call = replayed_call(format)
    compact = call.replace(", ", ",").replace(": ", ":")
    otherwise = [compact, call.replace(": ", ":"), call.replace(", ", ","), call.replace(": ", ":  "),
                 call.replace(", ", ",  "), call.replace(": ", ":\n"), call.replace(", ", ",\n"),
                 call.replace('{"city"', '{ "city"'), call.replace("3}", "3\n}")]
    for text in otherwise:
        assert text != call and parse_whole(format, text).calls  # the parser reads any spacing
        assert not family.admits(guide, text), text


FORCED_CALLS = ('[{"name": "get_weather", "parameters": {"city": "Oslo"}}, '
                '{"name": "get_time", "parameters": {"utc": true}}]')


@pytest.mark.parametrize("name", ["qwen", "llama", "mistral"])
def test_forced_calls_are_spaced_as_the_templates_write_calls(request, name: str) -> None:
    family: Family = request.getfixturevalue(name)
    guide = family.compiler.compile(forced_calls(FUNCTIONS, one=False))
    assert family.admits(guide, FORCED_CALLS)
    assert [c.name for c in parse_whole(FORCED_JSON, FORCED_CALLS).calls] == ["get_weather", "get_time"]
    for text in (FORCED_CALLS.replace(", ", ",").replace(": ", ":"), FORCED_CALLS.replace(", ", ",\n"),
                 FORCED_CALLS.replace(": ", ":  "), FORCED_CALLS.replace("[{", "[ {")):
        assert [c.name for c in parse_whole(FORCED_JSON, text).calls] == ["get_weather", "get_time"]
        assert not family.admits(guide, text), text


@pytest.mark.parametrize("format", [MISTRAL_JSON, MISTRAL_ARGS])
def test_a_mistral_call_may_carry_the_id_its_template_writes_and_the_node_still_gives_its_own(mistral: Family,
                                                                                              format: str) -> None:
    """Mistral's templates replay every call with its 9-character id, so the model was trained to write one: the
    grammar admits it where the template puts it (and no other form of id), and the client gets a fresh id."""
    guide = mistral.guide(format)
    with_id = replayed_call(format, with_id=True)
    assert "call00001" in with_id and mistral.admits(guide, with_id), with_id
    assert mistral.admits(guide, replayed_call(format))  # or none
    for wrong in ("call0001", "call000001", "call-0001"):  # 8 or 10 characters, or not letters and digits
        assert not mistral.admits(guide, with_id.replace("call00001", wrong)), wrong
    [parsed] = ChoiceCalls(format).read(with_id, last=True).calls  # as a node reads an answer
    assert (parsed.name, json.loads(parsed.arguments)) == ("get_weather", REPLAYED.arguments)
    assert parsed.id != "call00001" and re.fullmatch("[A-Za-z0-9]{9}", parsed.id)
