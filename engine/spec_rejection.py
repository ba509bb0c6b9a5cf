"""Verifying drafts: speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023), batched over rows.

A row proposes `length` draft tokens d_1..d_length, drawn from the draft's distributions q_i (one-hot
when the draft is deterministic, as n-gram drafts are); the target computed its distributions p_i at
those positions and one more in the same forward. Draft d_i is accepted with probability
min(1, p_i(d_i) / q_i(d_i)), in order; at the first rejection the token comes from
normalize(max(0, p_i - q_i)) instead, and when all are accepted a bonus token comes from p_{length+1}.
Every token emitted then has exactly the target's distribution. Greedy rows accept a draft exactly when
it is the target's argmax, so they emit the tokens plain greedy decoding does; drawing rows with
deterministic drafts accept one exactly when it is the target's own draw, which is the same rule and
emits the tokens plain sampling does (`verify_deterministic`).

The randomness is the sampler's counter-based randomness (`engine.sampling_noise`), drawn by the engine's
kind (`engine.sampling_draw`), a pure function of (seed, output position), so a seeded row's result never
depends on what shares its batch.
"""

from __future__ import annotations

import torch

from engine.sampling_draw import INVERSE, draw
from engine.sampling_noise import row_uniforms


def acceptance_uniforms(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[rows] float32 in (0, 1): the acceptance test's uniform at each (seed, output position).

    It hashes a counter of its own, so it is independent of the draw of a replacement at the same
    position (`engine.sampling_noise.row_uniforms`).
    """
    return row_uniforms(seeds, positions)


def accepted_counts(accept: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """[rows] how many drafts each row accepts: the run of accepted ones from the first, within its length."""
    steps = torch.arange(accept.shape[1], device=accept.device)
    accept = accept & (steps < lengths.unsqueeze(-1))
    return accept.long().cumprod(dim=1).sum(dim=1)


def verify_greedy(logits: torch.Tensor, drafts: torch.Tensor, lengths: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy rows: ([rows, k+1] tokens, [rows] how many of them are emitted), logits [rows, k+1, vocab].

    NaN logits rank last, as in the sampler's greedy pick.
    """
    best = torch.nan_to_num(logits, nan=-torch.inf).argmax(dim=-1)
    counts = accepted_counts(drafts == best[:, :-1], lengths) + 1
    return best, counts  # the accepted drafts equal the argmax there, so `best` holds every emitted token


def verify_deterministic(probs: torch.Tensor, drafts: torch.Tensor, lengths: torch.Tensor, seeds: torch.Tensor,
                         positions: torch.Tensor, fallback: torch.Tensor | None = None, kind: str = INVERSE
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Drawing rows whose drafts are deterministic (q one-hot, as n-gram drafts are): the rule above,
    with the target's own draws as its randomness.

    Each position draws the token plain sampling would draw there (the sampler's draw, of the engine's
    `kind`, over the same randomness), and a draft is accepted exactly when it is that token. Its chance
    is p(d), which is min(1, p(d)/q(d)) for a one-hot q, and a rejected position's draw is p conditioned
    on not being d, which is normalize(max(0, p - q)): the rule's distribution, with every emitted token
    the one plain sampling emits for that seed and position. So a seeded sample's tokens do not depend on its drafts
    (nor on the budget and pool that sized them), as they do not depend on its batch.

    probs: [rows, k+1, vocab] filtered, unnormalized, as the sampler draws from them; fallback: [rows, k+1]
    the token of each position whose probabilities are no distribution (the sampler's greedy fallback).
    """
    rows, width, vocab = probs.shape
    steps = torch.arange(width, device=probs.device)
    is_distribution, drawn = draw(kind, probs.reshape(rows * width, vocab), seeds.repeat_interleave(width),
                                  (positions.unsqueeze(-1) + steps).reshape(-1))
    drawn = drawn.view(rows, width)
    if fallback is not None:
        drawn = torch.where(is_distribution.view(rows, width), drawn, fallback)
    return drawn, accepted_counts(drafts == drawn[:, :-1], lengths) + 1


def verify_sampled(probs: torch.Tensor, drafts: torch.Tensor, lengths: torch.Tensor, seeds: torch.Tensor,
                   positions: torch.Tensor, draft_probs: torch.Tensor | None = None, kind: str = INVERSE
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Drawing rows whose drafts were drawn from distributions (a draft model's): ([rows, k+1] tokens,
    [rows] how many of them are emitted).

    probs: [rows, k+1, vocab] the target's probabilities (filtered; they need not sum to one);
    drafts: [rows, k] int64 (any value past a row's length); lengths: [rows] drafts per row;
    seeds, positions: [rows] each row's seed and the output position of its first token;
    draft_probs: [rows, k, vocab] the draft's distributions, or None when every draft is deterministic.
    """
    rows, width, _ = probs.shape
    k = width - 1
    probs = probs / probs.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(probs.dtype).tiny)
    steps = torch.arange(width, device=probs.device)
    draft_positions = (positions.unsqueeze(-1) + steps[:k]).reshape(-1)
    uniforms = acceptance_uniforms(seeds.repeat_interleave(k), draft_positions).view(rows, k)
    p_draft = probs[:, :k].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    q_draft = 1.0 if draft_probs is None else draft_probs.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    # u < p/q without dividing: a q of 0 (a draft its distribution could not give) then accepts where p > 0.
    accepted = accepted_counts(uniforms * q_draft < p_draft, lengths)
    picked = _replacement(probs, drafts, draft_probs, accepted, lengths)
    _, token = draw(kind, picked, seeds, positions + accepted)
    tokens = torch.cat([drafts, drafts[:, :1]], dim=1).scatter(1, accepted.unsqueeze(-1), token.unsqueeze(-1))
    return tokens, accepted + 1


def _replacement(probs: torch.Tensor, drafts: torch.Tensor, draft_probs: torch.Tensor | None,
                 accepted: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """[rows, vocab] what the token after the accepted drafts is drawn from: the residual max(0, p - q)
    where a draft was rejected, the target's own p where every draft was accepted (the bonus token)."""
    rows, width, vocab = probs.shape
    at = torch.arange(rows, device=probs.device)
    target = probs[at, accepted]
    if width == 1:  # no drafts: the bonus token alone
        return target
    rejected = accepted < lengths
    draft_at = accepted.clamp(max=width - 2)  # a row that accepted all has no draft here; `rejected` ignores it
    if draft_probs is None:
        draft = torch.zeros_like(target).scatter_(-1, drafts[at, draft_at].unsqueeze(-1), 1.0)
    else:
        draft = draft_probs[at, draft_at]
    residual = (target - draft).clamp_min_(0.0)
    # Float rounding can leave no mass where the draft matched the target exactly: fall back to p.
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, target)
    return torch.where(rejected.unsqueeze(-1), residual, target)
