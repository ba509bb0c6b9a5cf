"""One sample being generated: its tokens, its place in the KV cache, its progress."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.overlap import placeholder
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from engine.pooling import PoolingParams
    from engine.sampler import SampleRequest
    from engine.structured import Guide


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # a stop token or stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(eq=False, slots=True)
class Sequence:
    """A request with `n` samples owns `n` sequences; they share the prompt's blocks by reference count."""

    seq_id: int
    request_id: str
    sample_index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int | None  # of the sample's draws; None when greedy
    max_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    emitted_token_count: int = 0  # output tokens already in a step's outputs (text: `engine.output_processor`)
    forks_pending: int = 0  # samples still to be forked from this one once its prompt is computed
    # Async scheduling: the row of the in-flight step's picked ids that holds this sample's next token,
    # whose position counts already but whose id the host has not read yet (`engine.overlap`).
    pending_row: int | None = None
    # Request-scoped state of its picks, dropped when it ends: its grammar matcher (`engine.structured`)
    # and its row of token counts (`engine.logits_processors`, taken at its first pick).
    guide: Guide | None = None
    penalty_slot: int | None = None
    # Its pick's request, made at its first pick and reused by the later ones of an unconstrained sample,
    # whose settings and slot stay: each step moves only its row and position (`LLMEngine._sample_request`).
    pick: SampleRequest | None = None
    # The request's place in arrival order (the scheduler's; its samples share it): the youngest is preempted first.
    arrival: int = 0
    # An embedding request's (`engine.pooling`): how it pools, and its running state on the device, dropped at its end.
    pooling: PoolingParams | None = None
    pooled: torch.Tensor | None = None

    @property
    def num_output_tokens(self) -> int:
        """Output tokens including a pending one: the position the next pick is for."""
        return len(self.output_token_ids) + (self.pending_row is not None)

    @property
    def num_tokens(self) -> int:
        # `num_output_tokens` spelled out: read several times per sample per step.
        return len(self.prompt_token_ids) + len(self.output_token_ids) + (self.pending_row is not None)

    @property
    def can_grow(self) -> bool:
        """Whether another token may follow; False once a pending token is its last one."""
        return self.num_output_tokens < self.max_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def tokens_between(self, start: int, end: int) -> list[int]:
        """Token ids at positions [start, end); a pending token's is its placeholder."""
        known = len(self.prompt_token_ids) + len(self.output_token_ids)
        if end > known:  # only the pending token lies past what the host has read
            return self._known_tokens(start, known) + [placeholder(self.pending_row)]
        return self._known_tokens(start, end)

    def token_at(self, position: int) -> int:
        """`tokens_between(position, position + 1)`'s one id, without the lists (a decode step's input)."""
        outputs = self.output_token_ids
        index = position - len(self.prompt_token_ids)
        if index < 0:
            return self.prompt_token_ids[position]
        if index < len(outputs):
            return outputs[index]
        return placeholder(self.pending_row)

    def _known_tokens(self, start: int, end: int) -> list[int]:
        prompt_len = len(self.prompt_token_ids)
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len : end - prompt_len]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - prompt_len]

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)

    def __repr__(self) -> str:
        # Deliberately no tokens or text: reprs end up in tracebacks.
        return (
            f"Sequence(seq_id={self.seq_id}, sample={self.sample_index}, status={self.status.value}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens}, blocks={len(self.block_table)})"
        )
