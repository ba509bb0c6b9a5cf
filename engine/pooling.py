"""Embeddings: a prompt's final hidden states (after the final norm, before the LM head) pooled into one vector.

An embedding request is a prefill-only request: it runs through the same scheduler, chunks, KV blocks and
zeroing as generation, batched beside it, and ends when its prompt is computed, with no token picked.
Each chunk's rows are reduced where they lie (`pool_rows`) into the sequence's running state, so no hidden
state is kept past its step: mean pooling keeps a running sum, last-token pooling the latest row. The
state is dropped when the request ends, however it ends.

A finished vector crosses to the host in its step's one download (`engine.bridge`): the step's finished
vectors, made on the device (`PoolingStep.reduce`), ride it as one float32 segment (`EMBEDDINGS`), scrubbed
from the bridge's buffers once read, and are cut apart on the host (`unpack`) when the step is read.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.errors import RequestRejected
from engine.outputs import RequestMetrics

if TYPE_CHECKING:
    from engine.sequence import Sequence

# The finished vectors' segment in a step's download.
EMBEDDINGS = "pooling.embeddings"


class PoolingKind(str, enum.Enum):
    LAST = "last"  # the last prompt token's state (Qwen3-Embedding, e5-mistral)
    MEAN = "mean"  # the mean of every prompt token's state (sentence-transformers' mean pooling)


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """How one request's states become its embedding.

    `dimensions`: keep the first this many components (Matryoshka truncation), renormalized; None keeps all.
    """

    kind: PoolingKind = PoolingKind.LAST
    dimensions: int | None = None
    normalize: bool = True

    def validate(self, hidden_size: int) -> None:
        if self.dimensions is not None and not 1 <= self.dimensions <= hidden_size:
            raise RequestRejected("invalid_dimensions",
                                  f"dimensions must be between 1 and the model's {hidden_size}")


@dataclass(frozen=True, slots=True)
class PoolSpan:
    """One pooling chunk's rows [start, end) of a step's flat batch."""

    start: int
    end: int
    kind: PoolingKind


@dataclass(frozen=True, slots=True)
class EmbeddingOutput:
    """A finished embedding request: its vector and its metrics (sizes and timings only)."""

    request_id: str
    embedding: list[float]
    metrics: RequestMetrics

    def __repr__(self) -> str:
        # Deliberately no values: reprs end up in tracebacks.
        return f"EmbeddingOutput(request={self.request_id!r}, dimensions={len(self.embedding)})"


def pool_rows(hidden: torch.Tensor, spans: list[PoolSpan]) -> torch.Tensor:
    """Each span's reduction in fp32, a row per span: its rows' sum (mean pooling) or its last row."""
    return torch.stack([
        hidden[span.start:span.end].float().sum(0) if span.kind is PoolingKind.MEAN else hidden[span.end - 1].float()
        for span in spans
    ])


def accumulate(state: torch.Tensor | None, row: torch.Tensor, kind: PoolingKind) -> torch.Tensor:
    """A sequence's running state after one more chunk's reduction."""
    if state is None or kind is PoolingKind.LAST:
        return row
    return state + row


def embedding(state: torch.Tensor, num_tokens: int, params: PoolingParams) -> torch.Tensor:
    """The finished vector, on the state's device: averaged (mean), truncated to `dimensions`, then L2-normalized."""
    vector = state / num_tokens if params.kind is PoolingKind.MEAN else state
    if params.dimensions is not None:
        vector = vector[: params.dimensions]
    if params.normalize:
        vector = torch.nn.functional.normalize(vector, dim=0)
    return vector


@dataclass(eq=False, slots=True)
class PoolingStep:
    """A step's embedding chunks: each sequence's rows of the flat batch, reduced into its running state.

    Made before the step's chunks count as computed, reduced (`reduce`) after the forward: a sequence whose
    prompt the step completes is then `finished`, its vector `sizes` long in the step's vectors.
    """

    sequences: list[Sequence]
    spans: list[PoolSpan]
    finished: list[Sequence] = field(default_factory=list)  # in the order of their vectors
    sizes: list[int] = field(default_factory=list)

    def reduce(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Adds each chunk's rows to its state; the finished vectors, flat in one float32 device tensor
        for the step's download (None when none finished)."""
        vectors = []
        for seq, span, row in zip(self.sequences, self.spans, pool_rows(hidden, self.spans)):
            seq.pooled = accumulate(seq.pooled, row, span.kind)
            if seq.num_computed_tokens == len(seq.prompt_token_ids):
                vector = embedding(seq.pooled, len(seq.prompt_token_ids), seq.pooling)
                vectors.append(vector)
                self.finished.append(seq)
                self.sizes.append(vector.numel())  # the shape only: nothing is read from the device
        return torch.cat(vectors) if vectors else None  # fp32, as `pool_rows` makes every row


def unpack(values: list[float], sizes: list[int]) -> list[list[float]]:
    """The step's finished vectors, cut from their segment's host values."""
    vectors, start = [], 0
    for size in sizes:
        vectors.append(values[start : start + size])
        start += size
    return vectors


def model_pooling(model_dir: str | Path) -> PoolingKind | None:
    """The pooling a sentence-transformers folder states (`modules.json` -> its Pooling module's
    `config.json`), if it states last-token or mean pooling; None otherwise."""
    folder = Path(model_dir)
    try:
        modules = json.loads((folder / "modules.json").read_text())
        path = next(m["path"] for m in modules if str(m.get("type", "")).endswith("Pooling"))
        config = json.loads((folder / path / "config.json").read_text())
    except (OSError, ValueError, TypeError, KeyError, StopIteration):
        return None
    if config.get("pooling_mode_lasttoken"):
        return PoolingKind.LAST
    if config.get("pooling_mode_mean_tokens"):
        return PoolingKind.MEAN
    return None
