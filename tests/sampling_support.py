"""The draw held to in sampling tests, computed apart from `engine.sampling_draw`: one flat float64
cumulative sum per row (no blocks) in the draw's token order, and the first token whose running sum
reaches u·total."""

from __future__ import annotations

import numpy as np
import torch

from engine.sampling_draw import draw_order
from engine.sampling_noise import draw_uniforms


def uniform_at(seed: int, position: int) -> float:
    """The draw's uniform at (seed, output position): `test_engine_sampling` holds its bits to pure Python."""
    return float(draw_uniforms(torch.tensor([seed]), torch.tensor([position]))[0])


def reference_draw(probs, seed: int, position: int) -> int:
    """The token a draw from `probs` (one row, non-negative, a positive finite total) picks at (seed, position)."""
    return flat_draw(probs, uniform_at(seed, position))


def flat_draw(probs, uniform: float) -> int:
    """The token whose running sum, in the draw's token order, first reaches u·total."""
    order = draw_order(len(probs))
    running = np.cumsum(np.asarray(probs, dtype=np.float64)[order])
    return order[int(np.searchsorted(running, uniform * running[-1], side="left"))]
