"""Incremental detokenization: the text built window by window is exactly the whole output's decode,
whatever the tokens (split multi-byte characters, special tokens, SentencePiece's dropped leading space)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as FastTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from engine.detokenizer import IncrementalDetokenizer, step_batch
from engine.tokenizer import Tokenizer
from tests.engine_models import tiny_model_dir
from veil.models import shipped_model_dir

TEXT = "Grüße aus Zürich ✓ — naïve café 東京 🙂 plain ascii words, spaces  and\nnewlines " * 4


@pytest.fixture(scope="module")
def byte_level() -> Tokenizer:
    return Tokenizer(tiny_model_dir())


class Metaspace:
    """A SentencePiece-style tokenizer: words start with '▁', and decoding drops the first one's space."""

    def __init__(self) -> None:
        self._tokenizer = FastTokenizer(models.BPE(unk_token="<unk>"))
        self._tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
        self._tokenizer.decoder = decoders.Metaspace()
        trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>"])
        self._tokenizer.train_from_iterator([TEXT] * 8, trainer)
        self.vocab_size = self._tokenizer.get_vocab_size()

    def decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=True)


METASPACE = Metaspace()


def built_text(decoder, token_ids: list[int], prompt: list[int] | None = None) -> tuple[str, list[str]]:
    """(final text, the pieces `step` gave along the way), feeding the tokens one at a time; after `prompt`'s
    last tokens if given."""
    detokenizer = IncrementalDetokenizer() if prompt is None else IncrementalDetokenizer.after_prompt(prompt)
    pieces = [detokenizer.step(decoder, token_ids[: end + 1]) for end in range(len(token_ids))]
    return "".join(pieces) + detokenizer.flush(decoder, token_ids), pieces


def check_matches_whole_decode(decoder, token_ids: list[int]) -> None:
    final, pieces = built_text(decoder, token_ids)
    whole = decoder.decode(token_ids)
    assert final == whole
    streamed = ""
    for piece in pieces:
        streamed += piece
        assert whole.startswith(streamed)
        assert not streamed.endswith("\ufffd")  # an incomplete character waits for its last byte


def test_real_text_is_rebuilt_exactly(byte_level: Tokenizer) -> None:
    ids = byte_level.encode(TEXT, add_special_tokens=False)
    assert len(ids) > 50
    check_matches_whole_decode(byte_level, ids)
    final, pieces = built_text(byte_level, ids)
    assert sum(1 for piece in pieces if piece) > 20  # streamed in many pieces, not all at the end


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_any_token_sequence_is_rebuilt_exactly(byte_level: Tokenizer, data: st.DataObject) -> None:
    ids = data.draw(st.lists(st.integers(0, byte_level.vocab_size - 1), max_size=40))
    check_matches_whole_decode(byte_level, ids)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, METASPACE.vocab_size - 1), max_size=40))
def test_sentencepiece_leading_spaces_are_rebuilt_exactly(ids: list[int]) -> None:
    check_matches_whole_decode(METASPACE, ids)


def test_a_split_character_is_held_back_until_complete(byte_level: Tokenizer) -> None:
    ids = byte_level.encode("🙂", add_special_tokens=False)
    assert len(ids) == 4  # one token per UTF-8 byte in this vocabulary
    _, pieces = built_text(byte_level, ids)
    assert pieces[:-1] == [""] * (len(ids) - 1) and pieces[-1] == "🙂"


def test_an_unfinished_character_comes_out_on_flush(byte_level: Tokenizer) -> None:
    ids = byte_level.encode("🙂", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer()
    assert detokenizer.step(byte_level, ids[:1]) == ""
    assert detokenizer.flush(byte_level, ids[:1]) == byte_level.decode(ids[:1])


class CountingDecoder:
    def __init__(self, inner) -> None:
        self.inner, self.decoded_tokens = inner, 0

    def decode(self, token_ids: list[int]) -> str:
        self.decoded_tokens += len(token_ids)
        return self.inner.decode(token_ids)


def test_each_step_decodes_a_short_window_not_the_whole_output(byte_level: Tokenizer) -> None:
    ids = byte_level.encode("plain ascii words " * 60, add_special_tokens=False)
    counting = CountingDecoder(byte_level)
    built_text(counting, ids)
    # A full decode per step would read len^2 / 2 tokens; windows read a few per step.
    assert counting.decoded_tokens < 8 * len(ids) < len(ids) ** 2 / 2


def singles_of(decoder, vocab_size: int) -> list[str]:
    return [decoder.decode([t]) for t in range(vocab_size)]


def check_batch_matches_one_by_one(decoder, singles: list[str], samples: list[list[int]],
                                   prompts: list[list[int]] | None = None) -> None:
    """Samples of different lengths stepped together, a token per step each, as an engine's batch is; each
    after its prompt's last tokens if `prompts` are given."""
    prompts = prompts or [None] * len(samples)
    made = [IncrementalDetokenizer() if p is None else IncrementalDetokenizer.after_prompt(p) for p in prompts]
    batched = [dataclasses.replace(d) for d in made]
    alone = [dataclasses.replace(d) for d in made]
    for end in range(1, max(map(len, samples), default=0) + 1):
        live = [i for i, ids in enumerate(samples) if len(ids) >= end]
        pieces = step_batch(decoder.decode, singles, [batched[i] for i in live], [samples[i][:end] for i in live])
        assert pieces == [alone[i].step(decoder, samples[i][:end]) for i in live]
        assert [(d.prefix_offset, d.read_offset) for d in batched] == [(d.prefix_offset, d.read_offset) for d in alone]


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_a_batch_steps_each_sample_as_it_would_alone(byte_level: Tokenizer, data: st.DataObject) -> None:
    ids = st.lists(st.integers(0, byte_level.vocab_size - 1), max_size=30)
    samples = data.draw(st.lists(ids, max_size=6))
    # A short table too: ids past it (a model's vocabulary can outgrow its tokenizer's) are decoded.
    singles = data.draw(st.sampled_from([byte_level.token_texts(byte_level.vocab_size), singles_of(byte_level, 100)]))
    check_batch_matches_one_by_one(byte_level, singles, samples)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(0, METASPACE.vocab_size - 1), max_size=30), max_size=6))
def test_a_sentencepiece_batch_steps_each_sample_as_it_would_alone(samples: list[list[int]]) -> None:
    check_batch_matches_one_by_one(METASPACE, singles_of(METASPACE, METASPACE.vocab_size), samples)


class CallCounter:
    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, 0

    def decode(self, token_ids: list[int]) -> str:
        self.calls += 1
        return self.inner.decode(token_ids)


def test_a_batch_decodes_once_per_sample_per_step(byte_level: Tokenizer) -> None:
    ids = byte_level.encode("plain ascii words " * 20, add_special_tokens=False)
    counting = CallCounter(byte_level)
    singles = byte_level.token_texts(byte_level.vocab_size)
    detokenizers = [IncrementalDetokenizer() for _ in range(3)]
    step_batch(counting.decode, singles, detokenizers, [ids[:1]] * 3)
    for end in range(2, len(ids) + 1):
        before = counting.calls
        pieces = step_batch(counting.decode, singles, detokenizers, [ids[:end]] * 3)
        assert pieces[0]  # every token of plain ASCII adds text at once
        # The window's old token is looked up in the table; only the window with the new one is decoded.
        assert counting.calls - before == 3


# ----- after a prompt (a trained model's SentencePiece tokenizer) ------------------------------------------

# Prompts that end in a whole character; "" is the BOS token alone.
STORY_PROMPTS = ("Lily and Ben went to the park. They saw", "Once upon a time", "Grüße 🙂 aus Zürich", "")


@pytest.fixture(scope="module")
def stories() -> Tokenizer:
    return Tokenizer(shipped_model_dir())


def test_an_output_keeps_the_leading_space_it_has_after_its_prompt(stories: Tokenizer) -> None:
    prompt = stories.encode("They saw")
    output = stories.encode("They saw a big box", add_special_tokens=True)[len(prompt):]
    assert stories.decode(output) == "a big box"  # decoded alone, the first word loses its space
    assert built_text(stories, output, prompt)[0] == " a big box"
    assert built_text(stories, output)[0] == "a big box"  # no prompt: a whole decode, as before


def story_outputs(stories: Tokenizer, max_pieces: int) -> st.SearchStrategy[list[int]]:
    """Outputs of whole characters: pieces, special tokens and the byte tokens of encoded text. (Byte tokens
    that spell invalid UTF-8 are left out: the decoder makes a whole invalid run one U+FFFD per byte, which
    text streamed before the run ends cannot know; a model's bytes are then garbage anyway.)"""
    first_piece = 3 + 256  # after <unk>, <s>, </s> and the 256 byte tokens
    piece = st.integers(first_piece, stories.vocab_size - 1).map(lambda token: [token])
    special = st.integers(0, 2).map(lambda token: [token])
    text = st.text(max_size=3).map(lambda chars: stories.encode(chars, add_special_tokens=False))
    parts = st.lists(st.one_of(piece, special, text), max_size=max_pieces)
    return parts.map(lambda lists: [token for part in lists for token in part])


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_prompt_text_and_output_text_are_the_decode_of_prompt_and_output_tokens(stories: Tokenizer,
                                                                                data: st.DataObject) -> None:
    prompt = stories.encode(data.draw(st.sampled_from(STORY_PROMPTS)))
    ids = data.draw(story_outputs(stories, 20))
    final, pieces = built_text(stories, ids, prompt)
    whole = stories.decode(prompt + ids)
    assert stories.decode(prompt) + final == whole
    streamed = stories.decode(prompt)
    for piece in pieces:
        streamed += piece
        assert whole.startswith(streamed)


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_a_batch_after_prompts_steps_each_sample_as_it_would_alone(stories: Tokenizer, data: st.DataObject) -> None:
    samples = data.draw(st.lists(st.lists(st.integers(0, stories.vocab_size - 1), max_size=20), max_size=5))
    prompts = [stories.encode(data.draw(st.sampled_from(STORY_PROMPTS))) for _ in samples]
    check_batch_matches_one_by_one(stories, stories.token_texts(stories.vocab_size), samples, prompts)
