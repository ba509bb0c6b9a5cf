"""Drawing one token from each row's probabilities: by inverse transform (the default) or by an
exponential race (engines that speculate with a draft model).

**Inverse transform** (`inverse_draw`): a row's draw is the first token whose cumulative probability
reaches u·total, with u the row's one uniform at its (seed, output position)
(`engine.sampling_noise.draw_uniforms`). One random number per row: the race hashes, takes a log of and
divides the whole [rows, vocab] block every step, which was most of a sampled step's host time on a CPU
(and as many passes over the block on a GPU). The cumulative sum runs in two levels so that only one
pass reads the whole block: the vocabulary is cut into blocks of `block_width` tokens (strided:
`draw_order`), whose sums (float32, each of ~sqrt(vocab) terms) are summed cumulatively in float64
([rows, blocks]) to find the block the draw falls in; the same search then runs inside that block's own
probabilities ([rows, width], float64). A block's float32 sum is within about width·2^-24 of its mass,
relatively (2e-6 at width 32): a float64 sum of the whole block cost four times as much on a CPU (the
cast runs inside the reduction, unvectorized): 0.15 ms of a sampled step at batch 256. A token of
zero probability is never drawn, whatever the rounding: the block found has a cumulative sum above the
one before it, so a positive sum, and inside it the search stops at the first token whose running sum
reaches a positive remainder, which is a token that added to it. A remainder past the block's own running total (the two
sums round differently) is clamped to that total, which lands on the block's last positive token.

**Exponential race** (`race_draw`): argmax(p / E) with E ~ Exp(1) per token, from counter-based noise
per (seed, position, token). It costs a pass per op over the block, but it couples two distributions
drawn with the same noise almost as well as any coupling can (they agree with probability near
1 - TV(p, q)), while inverse transform couples them through their cumulative sums in token order,
which tokens of similar probability scattered across the vocabulary pull apart. A draft model's
sampled drafts are accepted exactly when they agree with the target's draw (`engine.spec_rejection`),
so a draft-model engine races: with a perturbed copy of the tiny model as draft, 0.49 of its drafts
were accepted racing and 0.07 inverting.

Every step of either is per row, so a row's draw does not depend on what shares its batch; an engine
draws with one kind everywhere (`EngineConfig.sampling_draw`): its sampler, its draft model and its
verification of drafts pick the same token for the same probabilities, seed and position.
"""

from __future__ import annotations

import functools
import math

import torch

from engine.sampling_noise import NoiseBuffers, draw_uniforms, negated_exponential_noise

INVERSE, RACE = "inverse", "race"
DRAWS = (INVERSE, RACE)


def draw(kind: str, probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
         noise: NoiseBuffers | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """([rows] whether a row is a distribution, [rows] int64 its draw) by `kind` (`DRAWS`).

    `probs` [rows, vocab] are non-negative, need not sum to one (filtered rows don't), and may hold NaN:
    a row is a distribution when its total is finite and positive. Other rows get some token in range,
    for the caller to replace (the sampler's greedy fallback). `noise`: the race's buffers, kept by a
    caller that races every step.
    """
    if kind == RACE:
        return race_draw(probs, seeds, positions, noise)
    return inverse_draw(probs, draw_uniforms(seeds, positions))


def race_draw(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
              noise: NoiseBuffers | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The exponential race: argmax(p / E), the first of ties. See `draw`."""
    # p / -E = -(p / E) exactly, so the least of these scores is the race's winner (one pass fewer than
    # negating the noise). Scores are <= 0, or NaN in every token of a row holding NaN: a row is a
    # distribution when its least score is below 0 (NaN is not; a row of no mass has 0 at best).
    scores = probs.div(negated_exponential_noise(seeds, positions, probs.shape[-1], noise))
    best = scores.amin(dim=-1, keepdim=True)
    keys = descending_keys(probs.shape[-1], probs.device)
    # A NaN row marks nothing, which reads as column `vocab`: the clamp keeps it in range, as `draw` promises.
    picks = first_index(torch.le(scores, best, out=scores), keys).clamp_(max=probs.shape[-1] - 1)
    return (best < 0).squeeze_(-1), picks


def first_index(marks: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """[rows] int64: the first column of each row of `marks` (1.0 there, 0.0 elsewhere; consumed) that is 1.0.

    Given the marks of each row's best value, that is what argmax picks (the first of tied values): on a
    CPU a max reduction and three elementwise passes cost less than half of one argmax, which is not
    vectorized. `keys` is vocab, vocab - 1, ..., 1 (`descending_keys`): the largest marked key is the
    first marked column.
    """
    # `torch.rsub` named: `int - tensor` goes through a Python wrapper first.
    return torch.rsub(marks.mul_(keys).amax(dim=-1).long(), keys.shape[0])


# Kept from step to step (not request data); a normal tensor even when first made under inference mode,
# so that a pick outside it reads it too, and only making it leaves inference mode (entering a mode costs
# tens of microseconds inside a step).
@functools.cache
@torch.inference_mode(False)
def descending_keys(vocab_size: int, device: torch.device) -> torch.Tensor:
    """`first_index`'s keys: vocab_size down to 1 (float32 counts exactly up to 2^24, far beyond any vocabulary)."""
    return torch.arange(vocab_size, 0, -1, dtype=torch.float32, device=device)


@functools.cache
def block_width(vocab_size: int) -> int:
    """Tokens per block: about sqrt(vocab), so both levels search about as many values.

    A divisor of the vocabulary when one is within a factor of 4 of its square root (most vocabularies
    have one: 32000, 128256, 151936), so every block is whole and the draw pads nothing; else the power
    of two nearest the root.
    """
    root = math.isqrt(vocab_size)
    divisors = [d for d in range(1, root + 1) if vocab_size % d == 0]
    best = min(divisors + [vocab_size // d for d in divisors], key=lambda d: abs(math.log(d / max(root, 1))))
    if root <= 4 * best and best <= 4 * max(root, 1):
        return best
    return 1 << max(0, round(vocab_size.bit_length() / 2))


def inverse_draw(probs: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse-transform draw of each row of `probs` at its uniform ([rows] float64, in (0, 1)). See `draw`.

    Block j holds tokens j, j + blocks, j + 2·blocks, ... (`draw_order`): summing a strided block is a
    sum across the block's columns, which vectorizes, where a contiguous block's sum would run along
    rows of a few dozen values. Each tensor op here costs more than the data it touches, so there are
    few of them: about twenty, whatever the batch and vocabulary.
    """
    rows, vocab = probs.shape
    width = block_width(vocab)
    blocks = -(-vocab // width)
    if vocab % width:  # the short last row of blocks: zeros, never drawn, keep every block as wide
        probs = torch.nn.functional.pad(probs, (0, width * blocks - vocab))
    # float64 [rows, blocks]: the mass up to each block's end, from float32 block sums (see the module's note).
    ends = probs.view(rows, width, blocks).sum(dim=1).double().cumsum_(dim=-1)
    total = ends[:, -1:]
    # Probabilities are at most 1 each (softmax's), so a total is finite unless it is NaN, which is not > 0.
    is_distribution = (total > 0).squeeze_(-1)
    # u < 1, so u·total <= total: a distribution's draw falls in some block. The clamp keeps other rows in range.
    target = uniforms.unsqueeze(-1) * total
    block = torch.searchsorted(ends, target).clamp_(max=blocks - 1)
    columns = torch.add(_block_columns(width, blocks, probs.device), block)
    running = probs.gather(-1, columns).cumsum(dim=-1, dtype=torch.float64)
    before = torch.nn.functional.pad(ends, (1, 0)).gather(-1, block)  # the mass before the block: 0 for the first
    remainder = torch.minimum(target.sub_(before), running[:, -1:])
    offset = torch.searchsorted(running, remainder).clamp_(max=width - 1)
    picks = torch.add(block, offset, alpha=blocks).squeeze_(-1)
    return is_distribution, picks.clamp_(max=vocab - 1) if vocab % width else picks


def draw_order(vocab_size: int) -> list[int]:
    """The token order whose cumulative sums the inverse-transform draw inverts: block by block, each
    block's tokens in id order. A draw picks the first token, in this order, whose running sum reaches
    u·total: what a reference computes to check it."""
    width = block_width(vocab_size)
    blocks = -(-vocab_size // width)
    return [j + blocks * i for j in range(blocks) for i in range(width) if j + blocks * i < vocab_size]


# Kept from step to step (not request data: 0, blocks, 2·blocks, ...); a normal tensor even when first
# made under inference mode, so that a draw outside it reads it too.
@functools.cache
@torch.inference_mode(False)
def _block_columns(width: int, blocks: int, device: torch.device) -> torch.Tensor:
    """[width] int64: a block's columns, less the block's own index."""
    return torch.arange(0, width * blocks, blocks, device=device)
