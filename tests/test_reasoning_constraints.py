"""A reasoning model's constraint applies after its `<think>` block: free reasoning, `</think>`, then the constraint.

First the grammar the engine compiles, on Qwen3's real vocabulary (where `<think>` and `</think>` are added
tokens that are not special) and on one where they are special: what it accepts token by token. Then end to
end at the node's inner API, on a random-weight Qwen3-shaped model with Qwen3's real tokenizer and template.
Random weights never close a block by themselves, so `logit_bias` makes them: a reasoning word biased above
`</think>` wins until the frequency penalty has taken it below (a few words), then `</think>` does.
"""

from __future__ import annotations

import json
import pytest
from tokenizers import Tokenizer as FastTokenizer

from engine import ChatMessage, RequestRejected
from engine.sampling_params import StructuredOutput
from engine.structured import GrammarCompiler, Guide, MaskRequest
from enclave.answer_parts import reasoning_place
from tests.family_support import family_folder
from tests.test_enclave_fields import post
from tests.test_family_constraints import QWEN3, TOOLS, WEATHER, ask, qwen3  # noqa: F401  (fixture)

CHAT = b"/v1/chat/completions"
QWEN3_VOCAB = 151_936
END_OF_TURN = 151_645  # <|im_end|>
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}
ANSWER = '{"city":"Paris"}'
CONSTRAINTS = [
    ("json_schema", json.dumps(CITY)),
    ("regex", r'\{"city":"[A-Z][a-z]+"\}'),
    ("choice", json.dumps([ANSWER, '{"city":"Oslo"}'])),
    ("grammar", 'start: "{\\"city\\":\\"" CITY "\\"}"\nCITY: /[A-Z][a-z]+/'),
    ("json_object", ""),
]


def qwen3_tokenizer_json(special_markers: bool = False) -> str:
    """Qwen3's tokenizer.json; with `special_markers`, as if `<think>` and `</think>` were special tokens."""
    data = json.loads((family_folder(QWEN3) / "tokenizer.json").read_text())
    for token in data["added_tokens"]:
        if token["content"] in ("<think>", "</think>"):
            token["special"] = token["special"] or special_markers
    return json.dumps(data)


@pytest.fixture(scope="module")
def vocabulary() -> tuple[GrammarCompiler, FastTokenizer]:
    text = qwen3_tokenizer_json()
    return GrammarCompiler(text, QWEN3_VOCAB, [END_OF_TURN]), FastTokenizer.from_str(text)


def ids(library: FastTokenizer, text: str) -> list[int]:
    return library.encode(text, add_special_tokens=False).ids


def consumed(guide: Guide, tokens: list[int]) -> bool:
    """Whether the guide takes every token, and then accepts (the answer may end there)."""
    return all(guide.advance(token) for token in tokens) and guide.accepting


@pytest.mark.parametrize(("kind", "spec"), CONSTRAINTS)
def test_the_answer_opens_a_block_then_meets_the_constraint(vocabulary, kind: str, spec: str) -> None:
    compiler, library = vocabulary
    constraint = StructuredOutput(kind, spec, "response_format", reasoning="block")
    accepted = (f"<think>abc</think>{ANSWER}", f"<think>\nLet me see: {{\n</think>\n\n{ANSWER}",
                f"<think></think>{ANSWER}")
    for text in accepted:
        assert consumed(compiler.compile(constraint), ids(library, text)), text
    # The block comes first; after `</think>` a blank line at most, then exactly the constraint.
    refused = (ANSWER, f"<think>a</think>\n\n\n{ANSWER}", f"<think>a</think>So: {ANSWER}",
               f"<think>a</think>x</think>{ANSWER}")
    for text in refused:
        assert not consumed(compiler.compile(constraint), ids(library, text)), text
    assert not compiler.compile(constraint).advance(ids(library, "{")[0])
    # Without reasoning the constraint is what it was: from the first token.
    assert consumed(compiler.compile(StructuredOutput(kind, spec, "response_format")), ids(library, ANSWER))


@pytest.mark.parametrize(("kind", "spec"), CONSTRAINTS[:2])
def test_an_answer_inside_a_block_the_prompt_opened_closes_it_first(vocabulary, kind: str, spec: str) -> None:
    compiler, library = vocabulary
    constraint = StructuredOutput(kind, spec, "response_format", reasoning="inside")
    for text in (f"abc</think>\n\n{ANSWER}", f"</think>{ANSWER}", f"\nI think {ANSWER} fits.\n</think>\n\n{ANSWER}"):
        assert consumed(compiler.compile(constraint), ids(library, text)), text
    assert not consumed(compiler.compile(constraint), ids(library, ANSWER))  # still reasoning: not an answer yet


def test_the_turn_cannot_end_while_the_model_reasons(vocabulary) -> None:
    compiler, library = vocabulary
    guide = compiler.compile(StructuredOutput("json_schema", json.dumps(CITY), reasoning="block"))
    assert all(guide.advance(token) for token in ids(library, "<think>abc"))
    close, word = library.token_to_id("</think>"), ids(library, "abc")[0]
    [mask] = compiler.masks([MaskRequest(guide, (END_OF_TURN,))]).numpy().view("uint32")
    allowed = {token for token in (close, word, END_OF_TURN) if mask[token // 32] >> (token % 32) & 1}
    assert allowed == {close, word}
    assert consumed(guide, ids(library, f"</think>{ANSWER}"))
    [mask] = compiler.masks([MaskRequest(guide, (END_OF_TURN,))]).numpy().view("uint32")
    assert mask[END_OF_TURN // 32] >> (END_OF_TURN % 32) & 1


def test_a_constraint_that_writes_its_own_block_applies_as_given(vocabulary) -> None:
    compiler, library = vocabulary
    constraint = StructuredOutput("regex", r"(<think>\n[a-z]+\n</think>\n\n)?ok", reasoning="block")
    assert consumed(compiler.compile(constraint), ids(library, "ok"))
    assert consumed(compiler.compile(constraint), ids(library, "<think>\nabc\n</think>\n\nok"))
    assert not consumed(compiler.compile(constraint), ids(library, "<think>ABC</think>ok"))


def test_special_markers_are_written_as_their_tokens() -> None:
    text = qwen3_tokenizer_json(special_markers=True)
    compiler, library = GrammarCompiler(text, QWEN3_VOCAB, [END_OF_TURN]), FastTokenizer.from_str(text)
    opening, close = library.token_to_id("<think>"), library.token_to_id("</think>")
    schema = json.dumps(CITY)
    block = StructuredOutput("json_schema", schema, reasoning="block")
    assert consumed(compiler.compile(block), [opening, *ids(library, "abc"), close, *ids(library, ANSWER)])
    assert not compiler.compile(block).advance(ids(library, "<")[0])  # the marker is the token, not its text
    inside = StructuredOutput("json_schema", schema, reasoning="inside")
    assert consumed(compiler.compile(inside), [*ids(library, "abc"), close, *ids(library, "\n\n" + ANSWER)])


def test_a_bad_constraint_is_refused_as_without_reasoning(vocabulary) -> None:
    compiler, _ = vocabulary
    for reasoning in ("none", "block", "inside"):
        with pytest.raises(RequestRejected, match="response_format is not a valid regex"):
            compiler.compile(StructuredOutput("regex", "(", reasoning=reasoning))
    problem = StructuredOutput("regex", "a", reasoning="maybe").problem()
    assert problem is not None and problem.startswith("response_format")


# ----- end to end ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def closing_bias() -> dict:
    """The request fields that make the random model reason a few words, then close its block."""
    library = FastTokenizer.from_file(str(family_folder(QWEN3) / "tokenizer.json"))
    [word] = ids(library, "abc")
    return {"logit_bias": {str(word): 100, str(library.token_to_id("</think>")): 90}, "frequency_penalty": 2,
            "temperature": 0}


def reasoned(reasoning: str | None) -> bool:
    """Whether the reasoning is what `closing_bias` makes: the biased word (the opening `<think>` may have been
    written in pieces, the last of which carries the reasoning's first letter)."""
    return bool(reasoning) and "abc" in reasoning and set(reasoning) <= set("abc\n")


CITIES = ({"city": "Paris"}, {"city": "Oslo"})  # what WEATHER allows
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}}


@pytest.mark.parametrize("stream", [False, True])
def test_a_structured_answer_returns_its_reasoning_first(qwen3, closing_bias, stream: bool) -> None:  # noqa: F811
    status, answer = post(qwen3, CHAT, ask(response_format=SCHEMA_FORMAT, stream=stream, **closing_bias))
    assert status == 200, answer
    if stream:
        deltas = [chunk["choices"][0]["delta"] for chunk in answer if chunk["choices"]]
        finish = [chunk["choices"][0]["finish_reason"] for chunk in answer if chunk["choices"]][-1]
        reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
        content = "".join(d.get("content") or "" for d in deltas)
    else:
        [choice] = answer["choices"]
        finish, reasoning, content = (choice["finish_reason"], choice["message"]["reasoning_content"],
                                      choice["message"]["content"])
    assert finish == "stop"
    assert reasoned(reasoning)  # None before: the schema applied from the first token
    assert json.loads(content) in CITIES


def test_a_forced_call_follows_the_reasoning(qwen3, closing_bias) -> None:  # noqa: F811
    status, answer = post(qwen3, CHAT, ask(tools=TOOLS, tool_choice="required", max_tokens=200, **closing_bias))
    assert status == 200, answer
    [choice] = answer["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert reasoned(choice["message"]["reasoning_content"]) and choice["message"]["content"] is None
    calls = choice["message"]["tool_calls"]
    assert calls and all(call["function"]["name"] == "get_weather" for call in calls)
    assert all(json.loads(call["function"]["arguments"]) in CITIES for call in calls)


def test_with_thinking_off_the_constraint_applies_from_the_first_token(qwen3, closing_bias) -> None:  # noqa: F811
    off = {"enable_thinking": False}
    status, answer = post(qwen3, CHAT, ask(response_format=SCHEMA_FORMAT, chat_template_kwargs=off, **closing_bias))
    assert status == 200, answer
    message = answer["choices"][0]["message"]
    assert message["reasoning_content"] is None and json.loads(message["content"]) in CITIES


def test_where_the_prompt_leaves_the_block_is_read_from_its_end(qwen3) -> None:  # noqa: F811
    tokenizer, question = qwen3.tokenizer, [ChatMessage("user", "Weather in Paris?")]
    thinking = tokenizer.decode(tokenizer.encode_chat(question)[-16:], skip_special_tokens=False)
    not_thinking = tokenizer.decode(tokenizer.encode_chat(question, template_kwargs={"enable_thinking": False})[-16:],
                                    skip_special_tokens=False)
    assert (reasoning_place(thinking), reasoning_place(not_thinking)) == ("block", "none")
    assert reasoning_place("<｜Assistant｜><think>\n") == "inside"  # DeepSeek-R1's newer templates
