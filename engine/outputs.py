"""What the engine hands back: per-step deltas for streaming, and whole outputs for offline batches."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sequence import FinishReason, TokenLogprob


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    """Sizes and timings only, for usage reporting and coarse audit buckets."""

    prompt_tokens: int
    output_tokens: int
    arrival_time: float
    first_token_time: float | None
    finish_time: float


# What one sample produced in a token step (`LLMEngine.step_tokens`), before any text: request id,
# sample index, its new token ids, their logprobs (empty unless asked for), its finish reason if it
# ended, and the request's metrics on the last sample's last. A tuple: one per sample per step, made
# in the core's step loop and pickled across the core's pipe.
TokenOutput = tuple[str, int, list[int], "list[TokenLogprob] | tuple[()]", "FinishReason | None",
                    "RequestMetrics | None"]


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs ~4x, paid per sample per step
class StreamDelta:
    """New output of one sample since the previous step (never changed once made)."""

    request_id: str
    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    logprobs: tuple[TokenLogprob, ...] = ()
    metrics: RequestMetrics | None = None  # set on the last delta of the whole request

    @property
    def request_finished(self) -> bool:
        return self.metrics is not None

    def __repr__(self) -> str:
        return f"StreamDelta(request={self.request_id!r}, index={self.index}, tokens={len(self.token_ids)}, finish={self.finish_reason})"


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def add(self, delta: StreamDelta) -> None:
        self.text += delta.text
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs
        self.finish_reason = delta.finish_reason or self.finish_reason

    def __repr__(self) -> str:
        return f"CompletionOutput(index={self.index}, tokens={len(self.token_ids)}, finish={self.finish_reason})"


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    outputs: list[CompletionOutput]
    metrics: RequestMetrics | None = None

    @property
    def finished(self) -> bool:
        return self.metrics is not None

    def add(self, delta: StreamDelta) -> None:
        while len(self.outputs) <= delta.index:
            self.outputs.append(CompletionOutput(index=len(self.outputs)))
        self.outputs[delta.index].add(delta)
        if delta.metrics is not None:
            self.metrics = delta.metrics
