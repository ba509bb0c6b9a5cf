"""From a sample's tokens to the text a reader sees: detokenization, stop strings, holdback, deltas.

The engine core decides which token comes next (`LLMEngine.step_tokens`); this stage decides what of
it can be shown yet. It runs beside the core, not in its step loop: in-process `LLMEngine.step` feeds
it each token step, and on a node the core client runs it on its reader thread while the core process
steps on (vLLM V1's split). Text is held back while it ends in an incomplete character or in what may
be the start of a stop string, so that nothing streamed ever has to be taken back.

A stop string is found here, so a sample it ends is ended here: its text is cut before it, the tokens
after the one that completed it are dropped, and the core is asked to stop the sample (`process`'s
second result). The sample's last delta waits for the core's word that it ended, so the request's last
delta (the one with metrics) still follows every other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from engine.detokenizer import PROMPT_CONTEXT_TOKENS, IncrementalDetokenizer, step_batch
from engine.outputs import RequestMetrics, StreamDelta, TokenOutput
from engine.sampling_params import SamplingParams
from engine.sequence import FinishReason, TokenLogprob
from engine.tokenizer import Tokenizer

_INCOMPLETE = "\ufffd"  # what a character whose last bytes have not come yet decodes to


@dataclass(eq=False, slots=True)
class SampleText:
    """One sample's text and what of it has gone out; only this stage holds it."""

    request_id: str
    index: int
    stops: tuple[str, ...]
    token_ids: list[int] = field(default_factory=list)  # kept: none after a stop string's last token
    logprobs: list[TokenLogprob] = field(default_factory=list)
    text: str = ""
    detokenizer: IncrementalDetokenizer = field(default_factory=IncrementalDetokenizer)
    emitted_text_len: int = 0
    emitted_token_count: int = 0
    stopped: bool = False  # a stop string ended it: the core's later tokens are dropped
    finish_reason: FinishReason | None = None  # set once its last delta is made
    decoder: KeepingDecoder | None = None  # None: the usual decode, every special token left out


@dataclass(frozen=True, slots=True)
class KeepingDecoder:
    """A request's decode that keeps some special tokens in its text (`SamplingParams.kept_special_tokens`)."""

    decode: Callable[[list[int]], str]


@dataclass(eq=False, slots=True)
class _RequestText:
    stops: tuple[str, ...]
    decoder: KeepingDecoder | None = None
    # The prompt's last tokens, each sample's first detokenizer window (`IncrementalDetokenizer.after_prompt`).
    prompt_tail: Sequence[int] = ()
    # Made as the core's outputs name them: `n` is the client's word until the core has accepted it.
    samples: list[SampleText] = field(default_factory=list)

    def sample(self, request_id: str, index: int) -> SampleText:
        while len(self.samples) <= index:
            detokenizer = IncrementalDetokenizer.after_prompt(self.prompt_tail)
            self.samples.append(SampleText(request_id, len(self.samples), self.stops, detokenizer=detokenizer,
                                           decoder=self.decoder))
        return self.samples[index]


# A sample a step's outputs spoke of: it, its request, and the core's word on its end.
_Touched = tuple[SampleText, _RequestText, FinishReason | None, RequestMetrics | None]

class OutputProcessor:
    """The text stage: requests are added when submitted and forgotten at their last delta."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._decode = tokenizer.decoder()
        self._singles: list[str] | None = None  # each token's text alone, built at the first batch
        # request id -> its samples' text. Added and forgotten from other threads than `process`'s:
        # each is one dict operation, atomic in CPython.
        self._requests: dict[str, _RequestText] = {}
        self._stopped: list[SampleText] = []  # by a stop string in the call of `process` under way

    @property
    def singles(self) -> list[str]:
        if self._singles is None:
            self._singles = self.tokenizer.token_texts(self.tokenizer.vocab_size)
        return self._singles

    def add(self, request_id: str, params: SamplingParams, prompt_ids: Sequence[int] = ()) -> None:
        """`prompt_ids`: the prompt's tokens, of which the text's first decode takes the last few, so that
        the output's first token reads as it does after the prompt (its leading space kept)."""
        kept = params.kept_special_tokens
        decoder = KeepingDecoder(self.tokenizer.keeping_decoder(kept)) if kept else None
        self._requests[request_id] = _RequestText(params.stop, decoder, tuple(prompt_ids[-PROMPT_CONTEXT_TOKENS:]))

    def forget(self, request_id: str) -> None:
        """Drops the request's text (aborted or failed): later outputs for it are ignored."""
        self._requests.pop(request_id, None)

    def clear(self) -> None:
        self._requests.clear()

    def __len__(self) -> int:
        return len(self._requests)

    def process(self, outputs: list[TokenOutput]) -> tuple[list[StreamDelta], list[tuple[str, int]]]:
        """A token step's outputs as deltas, and the samples (request id, index) a stop string ended
        that the core must now stop."""
        touched: list[_Touched] = []
        batch: list[SampleText] = []  # one new token each, decoded together
        singly: list[tuple[SampleText, int]] = []  # several new tokens and stop strings: token by token
        requests = self._requests
        for request_id, index, tokens, logprobs, finish, metrics in outputs:
            request = requests.get(request_id)
            if request is None:  # forgotten: aborted, or its last delta is out
                continue
            samples = request.samples
            sample = samples[index] if index < len(samples) else request.sample(request_id, index)
            if tokens and not sample.stopped:  # after a stop string, the core's later tokens are dropped
                if len(tokens) > 1 and sample.stops:
                    singly.append((sample, len(sample.token_ids)))
                else:
                    batch.append(sample)
                sample.token_ids += tokens
                if logprobs:
                    sample.logprobs += logprobs
            touched.append((sample, request, finish, metrics))
        self._add_texts(batch)
        for sample, start in singly:
            self._add_tokenwise(sample, start)
        deltas = self._deltas(touched)
        # Asked once, and only of samples the core has not ended on its own meanwhile.
        stops = [(s.request_id, s.index) for s in self._stopped if s.finish_reason is None]
        self._stopped = []
        return deltas, stops

    def _add_texts(self, samples: list[SampleText]) -> None:
        """Decodes a step's new tokens, one decode per sample (`engine.detokenizer.step_batch`)."""
        if not samples:
            return
        usual = [s for s in samples if s.decoder is None]
        keeping = [s for s in samples if s.decoder is not None]
        pieces = step_batch(self._decode, self.singles, [s.detokenizer for s in usual], [s.token_ids for s in usual])
        for sample in keeping:  # their own decode, and no table of single tokens' text (it leaves specials out)
            pieces += step_batch(sample.decoder.decode, (), [sample.detokenizer], [sample.token_ids])
        for sample, piece in zip(usual + keeping, pieces):
            if piece:  # no new text: no new stop string either (the previous check found none)
                sample.text += piece
                if sample.stops and _cut_at_stop(sample):
                    sample.stopped = True
                    self._stopped.append(sample)

    def _add_tokenwise(self, sample: SampleText, start: int) -> None:
        """Several tokens at once (a speculative step) for a sample with stop strings: decoded one by one,
        so that the tokens after the one that completes a stop string are dropped."""
        tokens = sample.token_ids
        for end in range(start + 1, len(tokens) + 1):
            sample.text += sample.detokenizer.step(sample.decoder or self.tokenizer, tokens[:end])
            if _cut_at_stop(sample):
                sample.stopped = True
                self._stopped.append(sample)
                del tokens[end:], sample.logprobs[end:]
                return

    def _deltas(self, touched: list[_Touched]) -> list[StreamDelta]:
        deltas = []
        take = self._take
        for sample, request, finish, metrics in touched:
            if sample.finish_reason is not None:
                continue  # its last delta is out
            if finish is not None:  # the core ended it: a stop string found in the same tokens wins
                if not sample.stopped:  # text held back by the detokenizer is text too, unless cut at a stop
                    sample.text += sample.detokenizer.flush(sample.decoder or self.tokenizer, sample.token_ids)
                sample.finish_reason = FinishReason.STOP if sample.stopped else finish
            elif sample.stopped:
                continue  # its last delta waits for the core's word that it ended
            delta = take(sample)
            if delta is None:
                continue
            if metrics is not None:  # the core ended the request: this is its last delta
                delta.metrics = self._request_metrics(sample.request_id, request, metrics)
            deltas.append(delta)
        return deltas

    def _request_metrics(self, request_id: str, request: _RequestText, metrics: RequestMetrics) -> RequestMetrics:
        """The core's metrics, counting only the tokens kept (none after a stop string); forgets the request."""
        self._requests.pop(request_id, None)
        kept = sum(len(s.token_ids) for s in request.samples)
        return metrics if metrics.output_tokens == kept else dataclasses.replace(metrics, output_tokens=kept)

    @staticmethod
    def _take(sample: SampleText) -> StreamDelta | None:
        """The output since the last delta that can be shown now; None when there is none (and not finished)."""
        finished, stops = sample.finish_reason is not None, sample.stops
        visible = sample.text
        if not finished:  # without stop strings, only an incomplete character is held back
            visible = holdback(visible, stops) if stops else visible.rstrip(_INCOMPLETE)
        count = sample.emitted_token_count
        text = visible[sample.emitted_text_len :]
        tokens = tuple(sample.token_ids[count:])
        if not text and not tokens and not finished:
            return None
        logprobs = tuple(sample.logprobs[count:]) if sample.logprobs else ()
        sample.emitted_text_len = len(visible)
        sample.emitted_token_count = len(sample.token_ids)
        return StreamDelta(sample.request_id, sample.index, text, tokens, sample.finish_reason, logprobs)


def _cut_at_stop(sample: SampleText) -> bool:
    """True if a stop string now ends the sample's text, which is cut before it."""
    longest = max(len(s) for s in sample.stops)
    search_from = max(sample.emitted_text_len - longest, 0)
    hits = [i for i in (sample.text.find(s, search_from) for s in sample.stops) if i >= 0]
    if hits:
        sample.text = sample.text[: min(hits)]
    return bool(hits)


def holdback(text: str, stops: tuple[str, ...]) -> str:
    """Text safe to stream now: no half-decoded character, no tail that may begin a stop string."""
    text = text.rstrip(_INCOMPLETE)
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:length]):
                text = text[: len(text) - length]
                break
    return text
