"""From a sample's tokens to the text a reader sees: detokenization, stop strings, holdback, deltas.

The engine core decides which token comes next; this decides what of it can be shown yet. Text is
held back while it ends in an incomplete character or in what may be the start of a stop string,
so that nothing streamed ever has to be taken back.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.detokenizer import step_batch
from engine.sequence import Sequence, TokenLogprob
from engine.tokenizer import Tokenizer

_INCOMPLETE = "\ufffd"  # what a character whose last bytes have not come yet decodes to


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs ~3x, once per sample per step
class NewOutput:
    """What a sample produced since its previous delta (never changed once made)."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...]


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._decode = tokenizer.decoder()
        self._singles: list[str] | None = None  # each token's text alone, built at the first batch

    @property
    def singles(self) -> list[str]:
        if self._singles is None:
            self._singles = self.tokenizer.token_texts(self.tokenizer.vocab_size)
        return self._singles

    def add_text(self, seq: Sequence) -> bool:
        """Decodes the sample's newest token; True if a stop string now ends its text (cut before it)."""
        seq.output_text += seq.detokenizer.step(self.tokenizer, seq.output_token_ids)
        return self._cut_at_stop(seq)

    def add_texts(self, seqs: list[Sequence]) -> list[bool]:
        """`add_text` for a step's samples at once: one decode each (`engine.detokenizer.step_batch`)."""
        pieces = step_batch(self._decode, self.singles, [seq.detokenizer for seq in seqs],
                            [seq.output_token_ids for seq in seqs])
        stopped = [False] * len(seqs)
        for index, (seq, piece) in enumerate(zip(seqs, pieces)):
            if piece:  # no new text: no new stop string either (the previous check found none)
                seq.output_text += piece
                if seq.params.stop:
                    stopped[index] = self._cut_at_stop(seq)
        return stopped

    @staticmethod
    def _cut_at_stop(seq: Sequence) -> bool:
        """True if a stop string now ends the sample's text, which is cut before it."""
        if not seq.params.stop:
            return False
        longest = max(len(s) for s in seq.params.stop)
        search_from = max(seq.emitted_text_len - longest, 0)
        hits = [i for i in (seq.output_text.find(s, search_from) for s in seq.params.stop) if i >= 0]
        if hits:
            seq.output_text = seq.output_text[: min(hits)]
        return bool(hits)

    def finish_text(self, seq: Sequence, cut_at_stop: bool) -> None:
        """The sample has ended: what the detokenizer held back is text too, unless a stop string cut it."""
        if not cut_at_stop:
            seq.output_text += seq.detokenizer.flush(self.tokenizer, seq.output_token_ids)

    def take(self, seq: Sequence) -> NewOutput | None:
        """The output since the last call that can be shown now; None when there is none (and not finished)."""
        finished, stops = seq.is_finished, seq.params.stop
        visible = seq.output_text
        if not finished:  # without stop strings, only an incomplete character is held back
            visible = holdback(visible, stops) if stops else visible.rstrip(_INCOMPLETE)
        text = visible[seq.emitted_text_len :]
        tokens = tuple(seq.output_token_ids[seq.emitted_token_count :])
        if not text and not tokens and not finished:
            return None
        logprobs = tuple(seq.logprobs[seq.emitted_token_count :]) if seq.logprobs else ()
        seq.emitted_text_len = len(visible)
        seq.emitted_token_count = len(seq.output_token_ids)
        return NewOutput(text, tokens, logprobs)


def holdback(text: str, stops: tuple[str, ...]) -> str:
    """Text safe to stream now: no half-decoded character, no tail that may begin a stop string."""
    text = text.rstrip(_INCOMPLETE)
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:length]):
                text = text[: len(text) - length]
                break
    return text
