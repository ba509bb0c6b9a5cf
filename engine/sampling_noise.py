"""Counter-based noise for the sampler's exponential race: a pure function of (seed, position, token).

No generator holds state between steps: the noise of one sample at one output position is computed
from its 62-bit seed, that position and each token id, so it is the same whatever else shares the
batch, in whatever order, and the same on CPU and CUDA. The hash is splitmix64's finaliser over the
counter `seed + (position + 1)·γ`, then over `that + (token + 1)·γ`, in int64 torch ops whose
wrap-around on overflow is the same on both devices.
"""

from __future__ import annotations

import torch

_U64 = 1 << 64


def _as_int64(constant: int) -> int:
    """The signed int64 holding the same 64 bits as an unsigned constant."""
    return constant - _U64 if constant >= 1 << 63 else constant


GOLDEN_GAMMA = _as_int64(0x9E3779B97F4A7C15)  # splitmix64's counter step
_MIX_1 = _as_int64(0xBF58476D1CE4E5B9)
_MIX_2 = _as_int64(0x94D049BB133111EB)
_HALF_BITS = 24  # each half of the uniform: an int below 2**24 converts to float32 exactly
_HALF_MASK = (1 << _HALF_BITS) - 1
_BELOW_ONE = 1.0 - 2.0**-24  # the largest float32 under 1: a uniform of 1 would make the noise infinite


def mix64(values: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on every element: a bijection of 64-bit patterns that scatters nearby inputs.

    Works in place on `values`, which must be the caller's own fresh tensor: the noise block is the
    largest tensor of a step, so no pass allocates another.
    """
    scratch = torch.empty_like(values)
    _xor_shift_(values, 30, scratch).mul_(_MIX_1)
    _xor_shift_(values, 27, scratch).mul_(_MIX_2)
    return _xor_shift_(values, 31, scratch)


def _xor_shift_(values: torch.Tensor, bits: int, scratch: torch.Tensor) -> torch.Tensor:
    """values ^= values >>> bits: torch's `>>` copies the sign bit, so a mask makes the shift logical."""
    torch.bitwise_right_shift(values, bits, out=scratch)
    return values.bitwise_xor_(scratch.bitwise_and_((1 << (64 - bits)) - 1))


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[rows] int64: one key per (seed, output position), from which each token's bits are hashed."""
    return mix64(seeds + (positions + 1) * GOLDEN_GAMMA)


def token_bits(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, vocab] int64: 64 random bits per (row key, token id)."""
    token_steps = torch.arange(1, vocab_size + 1, dtype=torch.int64, device=keys.device) * GOLDEN_GAMMA
    return mix64(keys.unsqueeze(-1) + token_steps)


def uniform_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """float32 in (0, 1) from the top 48 bits, with float32's relative precision near 0.

    Every step but one add is exact, and IEEE addition rounds alike on every device.
    """
    # Masking to 24 bits drops whatever sign bits the arithmetic shift brought in.
    high = ((bits >> (64 - _HALF_BITS)) & _HALF_MASK).float()
    low = ((bits >> (64 - 2 * _HALF_BITS)) & _HALF_MASK).float()
    fraction = low.add_(0.5).mul_(2.0**-_HALF_BITS)
    return high.add_(fraction).mul_(2.0**-_HALF_BITS).clamp_(max=_BELOW_ONE)


def exponential_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, vocab] float32 Exp(1) draws, each a pure function of (seed, position, token id)."""
    uniform = uniform_from_bits(token_bits(row_keys(seeds, positions), vocab_size))
    # -log(1 - u) rather than -log(u): small noise, which decides races, comes from small u, where
    # float32 is finely spaced.
    return uniform.neg_().log1p_().neg_()
