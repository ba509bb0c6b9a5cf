"""The draw held to in sampling tests, computed apart from `engine.sampling_draw`: one flat float64
cumulative sum per row (no blocks), and the first token whose running sum reaches u·total."""

from __future__ import annotations

import numpy as np
import torch

from engine.sampling_noise import draw_uniforms


def uniform_at(seed: int, position: int) -> float:
    """The draw's uniform at (seed, output position): `test_engine_sampling` holds its bits to pure Python."""
    return float(draw_uniforms(torch.tensor([seed]), torch.tensor([position]))[0])


def reference_draw(probs, seed: int, position: int) -> int:
    """The token a draw from `probs` (one row, non-negative, a positive finite total) picks at (seed, position)."""
    running = np.cumsum(np.asarray(probs, dtype=np.float64))
    return int(np.searchsorted(running, uniform_at(seed, position) * running[-1], side="left"))
