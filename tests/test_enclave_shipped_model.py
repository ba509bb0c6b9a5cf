"""A node's inner API serving what `veil up` and `veil demo` serve out of the box: the shipped trained model
(stories260K, `veil.models`), and the random-weight `init-tiny` model for benchmarks.

Text reads as the tokens decode after the prompt, whole and streamed alike: a SentencePiece tokenizer drops
a decode's leading space, and an answer decoded on its own would begin "a big box" after "They saw". And both
models' chat templates show tools in a format the node reads, so a chat with tools and the default
`tool_choice` ("auto") is served, not refused.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from enclave.api import InnerApi
from engine import EngineConfig, Tokenizer
from tests.engine_models import hf_greedy, running_core, tiny_model_dir, trained_model
from tests.test_enclave_fields import post
from tests.test_enclave_tools import TOOLS
from veil.models import shipped_model_dir

COMPLETIONS, CHAT = b"/v1/completions", b"/v1/chat/completions"
# Openings whose continuation begins with a word: its leading space is the first thing a bare decode loses.
OPENINGS = ("Lily and Ben went to the park. They saw", "Once upon a time", "Tom had a red boat. One day,")
MAX_TOKENS = 16


def serving(folder: Path) -> Iterator[InnerApi]:
    with running_core(folder, EngineConfig(kv_cache_gib=0.05, device="cpu")) as core:
        yield InnerApi(core, Tokenizer(folder), folder.name)


@pytest.fixture(scope="module")
def shipped() -> Iterator[InnerApi]:
    yield from serving(shipped_model_dir())


@pytest.fixture(scope="module")
def tiny() -> Iterator[InnerApi]:
    yield from serving(tiny_model_dir())


def continuation(prompt: str) -> str:
    """transformers' greedy continuation, as the decode of prompt + output tokens reads past the prompt's."""
    reference = trained_model()
    tokenizer = Tokenizer(reference.folder)
    prompt_ids = tokenizer.encode(prompt)
    whole = tokenizer.decode(prompt_ids + hf_greedy(reference.model, prompt_ids, MAX_TOKENS))
    assert whole.startswith(prompt)
    return whole[len(prompt):]


def streamed_text(chunks: list[dict], chat: bool) -> str:
    key = "delta" if chat else None
    pieces = [c["choices"][0][key].get("content") or "" if key else c["choices"][0]["text"]
              for c in chunks if c.get("choices")]
    return "".join(pieces)


@pytest.mark.parametrize("opening", OPENINGS)
def test_a_completion_reads_on_from_its_prompt_whole_and_streamed(shipped: InnerApi, opening: str) -> None:
    expected = continuation(opening)
    assert expected.startswith((" ", ","))  # what a decode of the output alone would lose or keep
    body = {"model": shipped.model_name, "prompt": opening, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True}
    status, whole = post(shipped, COMPLETIONS, body)
    assert status == 200 and whole["choices"][0]["text"] == expected
    status, chunks = post(shipped, COMPLETIONS, body | {"stream": True})
    assert status == 200 and streamed_text(chunks, chat=False) == expected


def test_a_chat_reads_on_from_the_story_it_was_given(shipped: InnerApi) -> None:
    """The shipped template writes a chat as its messages' text, so a chat continues the story too."""
    opening = OPENINGS[0]
    body = {"model": shipped.model_name, "messages": [{"role": "user", "content": opening}],
            "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    status, whole = post(shipped, CHAT, body)
    assert status == 200 and whole["choices"][0]["message"]["content"] == continuation(opening)
    status, chunks = post(shipped, CHAT, body | {"stream": True})
    assert status == 200 and streamed_text(chunks, chat=True) == continuation(opening)


@pytest.mark.parametrize("model", ["shipped", "tiny"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_chat_with_tools_and_the_default_choice_is_served(model: str, stream: bool,
                                                            request: pytest.FixtureRequest) -> None:
    api: InnerApi = request.getfixturevalue(model)
    body = {"model": api.model_name, "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "tools": TOOLS, "max_tokens": 8, "seed": 1, "stream": stream}
    status, answer = post(api, CHAT, body)
    assert status == 200, answer
    last = answer[-1] if stream else answer
    assert last["choices"][0]["finish_reason"] in ("length", "stop", "tool_calls")
