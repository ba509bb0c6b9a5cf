"""Turns logits into tokens: greedy, temperature, top-k, top-p, min-p, per-sample seeded generators.

Each sample draws from its own generator, so a seeded request picks the same tokens whatever
else shares its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams
from engine.sequence import TokenLogprob


@dataclass(slots=True)
class SampleRequest:
    """One token to pick: which logits row, under which settings, from which generator."""

    row: int
    params: SamplingParams
    generator: torch.Generator | None


class Sampler:
    def __call__(self, logits: torch.Tensor, requests: list[SampleRequest]) -> list[tuple[int, TokenLogprob | None]]:
        logits = logits.float()
        rows = torch.tensor([r.row for r in requests], dtype=torch.long, device=logits.device)
        picked = logits.index_select(0, rows)
        tokens = self._pick(picked, requests)
        logprobs = self._logprobs(picked, tokens, requests)
        return list(zip(tokens, logprobs))

    def _pick(self, logits: torch.Tensor, requests: list[SampleRequest]) -> list[int]:
        greedy = logits.argmax(dim=-1).tolist()
        return [
            greedy[i] if r.params.greedy else self._draw(logits[i], r.params, r.generator)
            for i, r in enumerate(requests)
        ]

    def _draw(self, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
        probs = torch.softmax(logits / params.temperature, dim=-1)
        probs = filter_probs(probs, params)
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p, using only this sample's generator.
        noise = torch.empty_like(probs).exponential_(generator=generator)
        drawn = (probs / noise).argmax()
        # One host sync for both: the draw stands only if `probs` is a distribution at all.
        return int(torch.where(_is_distribution(probs), drawn, _most_likely(logits)))

    def _logprobs(
        self, logits: torch.Tensor, tokens: list[int], requests: list[SampleRequest]
    ) -> list[TokenLogprob | None]:
        wanted = [r.params.logprobs is not None for r in requests]
        if not any(wanted):
            return [None] * len(requests)
        log_probs = torch.log_softmax(logits, dim=-1)
        results: list[TokenLogprob | None] = []
        for i, request in enumerate(requests):
            if not wanted[i]:
                results.append(None)
                continue
            top = torch.topk(log_probs[i], request.params.logprobs) if request.params.logprobs else None
            alternatives = tuple(zip(top.indices.tolist(), top.values.tolist())) if top is not None else ()
            results.append(TokenLogprob(tokens[i], float(log_probs[i, tokens[i]]), alternatives))
        return results


def _is_distribution(probs: torch.Tensor) -> torch.Tensor:
    """Finite, non-negative and not all zero: anything else draws an arbitrary token (NaN wins argmax)."""
    return torch.isfinite(probs).all() & (probs >= 0).all() & (probs.sum() > 0)


def _most_likely(logits: torch.Tensor) -> torch.Tensor:
    """The greedy pick, NaN logits ranked last: what a distribution collapsed onto one token means.

    Needed only where scaled logits overflow, when one token holds all the mass; failing the request
    instead would cut off a stream its caller has partly received, for no better answer.
    """
    return torch.nan_to_num(logits, nan=-torch.inf).argmax()


def filter_probs(probs: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Zeroes the probabilities that top-k, top-p and min-p exclude (the most likely token always stays)."""
    if params.top_k and params.top_k < probs.shape[-1]:
        kth = torch.topk(probs, params.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, 0.0)
    if params.min_p > 0.0:
        probs = torch.where(probs >= params.min_p * probs.max(), probs, 0.0)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        keep_sorted = before < params.top_p * sorted_probs.sum()
        keep = torch.zeros_like(keep_sorted).scatter(0, order, keep_sorted)
        probs = torch.where(keep, probs, 0.0)
    return probs
