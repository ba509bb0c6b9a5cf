"""Output text built token by token, in time that does not grow with the length of the output.

Decoding a sample's whole output after every token costs O(length) per step and O(length^2) per
answer; at a batch of hundreds of long answers that alone is milliseconds of host time per step.
Here each step decodes only a short window: the tokens since text was last emitted plus the ones
before them, whose text is already out. Decoding the window with and without its new tokens and
keeping the difference gives exactly what a full decode adds: a tokenizer that drops the leading
space of a window's first token drops it from both decodes, and a character whose bytes are split
over tokens waits (as U+FFFD) until its last byte arrives.

The first window starts in the prompt (`IncrementalDetokenizer.after_prompt`, as vLLM's does): its last
few tokens are the old part, so the output's first token is decoded as it reads after the prompt. A
SentencePiece tokenizer drops the leading space only of a decode's first token, which is then the
prompt's, and prompt text + output text is the decode of prompt + output tokens ("They saw" + " a").

A step's samples are decoded together (`step_batch`), and a window's old part, usually one token, is
looked up in a table of every token's text instead of decoded: one decode per sample per step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

_INCOMPLETE = "\ufffd"
# Prompt tokens the first window starts with (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET): enough
# for the space rule and for a character whose bytes the prompt's last tokens split.
PROMPT_CONTEXT_TOKENS = 5


class Decoder(Protocol):
    def decode(self, token_ids: list[int]) -> str: ...


@dataclass(slots=True)
class IncrementalDetokenizer:
    """Where the next window starts (`prefix_offset`) and where its new tokens start (`read_offset`),
    both indices into the output's tokens. Until the first text is out the window starts in `context`,
    the prompt's last tokens: `prefix_offset` is then negative, -len(context)."""

    prefix_offset: int = 0
    read_offset: int = 0
    context: tuple[int, ...] = ()

    @classmethod
    def after_prompt(cls, prompt_ids: Sequence[int]) -> IncrementalDetokenizer:
        """A detokenizer whose first window starts with the prompt's last tokens."""
        context = tuple(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        return cls(-len(context), 0, context)

    def step(self, decoder: Decoder, token_ids: Sequence[int]) -> str:
        """The text the tokens since the last call add, or "" while it ends in an incomplete character."""
        return self._advance(decoder, token_ids, final=False)

    def flush(self, decoder: Decoder, token_ids: Sequence[int]) -> str:
        """Whatever text is still held back, incomplete characters included (the output has ended)."""
        return self._advance(decoder, token_ids, final=True)

    def _advance(self, decoder: Decoder, token_ids: Sequence[int], final: bool) -> str:
        if self.read_offset >= len(token_ids):
            return ""
        before = decoder.decode(self.window(token_ids, self.read_offset))
        after = decoder.decode(self.window(token_ids, len(token_ids)))
        return self._settle(before, after, len(token_ids), final)

    def window(self, token_ids: Sequence[int], end: int) -> list[int]:
        """The window's tokens up to output index `end`: the prompt's context first while it is in it."""
        if self.prefix_offset >= 0:
            return list(token_ids[self.prefix_offset : end])
        return [*self.context, *token_ids[:end]]

    def _settle(self, before: str, after: str, length: int, final: bool) -> str:
        """What the window adds, given its decodes without and with its new tokens; moves the window on."""
        if not final and (len(after) <= len(before) or after.endswith(_INCOMPLETE)):
            return ""
        # The next window starts at the new tokens, past the prompt's context.
        self.prefix_offset, self.read_offset, self.context = self.read_offset, length, ()
        return after[len(before) :]


def step_batch(decode: Callable[[list[int]], str], singles: Sequence[str],
               detokenizers: list[IncrementalDetokenizer], token_lists: list[list[int]]) -> list[str]:
    """`IncrementalDetokenizer.step` for a step's samples (each its detokenizer and its tokens).

    `singles[t]` is `decode([t])`: a window's old part is usually the one token of the previous step,
    so a step decodes once per sample rather than twice. `_settle` is spelled out: this runs per sample.
    """
    known = len(singles)
    pieces = []
    for detokenizer, ids in zip(detokenizers, token_lists):
        prefix, read, length = detokenizer.prefix_offset, detokenizer.read_offset, len(ids)
        if read >= length:
            pieces.append("")
            continue
        if prefix < 0:  # the first window, in the prompt's context: rare, so not spelled out
            window = detokenizer.window(ids, length)
            before, after = decode(window[: read - prefix]), decode(window)
        else:
            before = singles[ids[prefix]] if read - prefix == 1 and ids[prefix] < known else decode(ids[prefix:read])
            after = decode(ids[prefix:])
        if len(after) <= len(before) or after.endswith(_INCOMPLETE):
            pieces.append("")
            continue
        detokenizer.prefix_offset, detokenizer.read_offset = read, length
        if prefix < 0:
            detokenizer.context = ()
        pieces.append(after[len(before) :])
    return pieces
