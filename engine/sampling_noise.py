"""Counter-based randomness for sampling: pure functions of (seed, output position[, token]).

No generator holds state between steps: what a sample draws at one output position is computed from
its 62-bit seed and that position, so it is the same whatever else shares the batch, in whatever
order, and the same on CPU and CUDA. The two draws (`engine.sampling_draw`) use it differently:
- the inverse-transform draw inverts one uniform per row, the row key's own top bits (`draw_uniforms`);
- the exponential race races noise per token (`exponential_noise`): 32 bits per (row key, token id).
The acceptance test of drafts (`engine.spec_rejection`) hashes the key with a counter no token uses.

- a row key per (seed, position): splitmix64's finaliser over `seed + (position + 1)·γ`, in int64
  torch ops whose wrap-around on overflow is the same on both devices;
- 32 bits per counter (a token's is its id + 1): the key's low half plus `counter·γ32` through Wellons'
  lowbias32 (two multiplies, three xor-shifts), with the key's high half xored in between the
  multiplies, so the whole 64-bit key selects the bits (no two rows' noise is a shifted copy of each
  other unless their keys agree in all 64 bits). int32 ops cost half of int64 ones on a CPU and a
  fraction on GPUs without 64-bit multipliers; the race's block works in place in preallocated
  buffers (`NoiseBuffers`).

A uniform takes 31 of the 32 bits: u = (k + 1/2)·2^-31, never 0 and never 1 (float32 clamps it under
1). The race's noise is -log1p(-u): small noise, which decides races, comes from small u, where float32
is finely spaced and u is exact down to 2^-32. What the 2^-31 grid changes in a race is far below
float32's own rounding of the probabilities being raced (2^-24 relative).
"""

from __future__ import annotations

import functools

import torch

_U64 = 1 << 64


def _as_int64(constant: int) -> int:
    """The signed int64 holding the same 64 bits as an unsigned constant."""
    return constant - _U64 if constant >= 1 << 63 else constant


def _as_int32(constant: int) -> int:
    """The signed int32 holding the same 32 bits as an unsigned constant."""
    return constant - (1 << 32) if constant >= 1 << 31 else constant


GOLDEN_GAMMA = _as_int64(0x9E3779B97F4A7C15)  # splitmix64's counter step
GOLDEN_GAMMA_32 = 0x9E3779B9  # its upper half: the per-token counter step
_MIX_1 = _as_int64(0xBF58476D1CE4E5B9)
_MIX_2 = _as_int64(0x94D049BB133111EB)
_LOWBIAS_1 = _as_int32(0x7FEB352D)  # lowbias32's multipliers
_LOWBIAS_2 = _as_int32(0x846CA68B)
_UNIFORM_BITS = 31
_BELOW_ONE = 1.0 - 2.0**-24  # the largest float32 under 1: a uniform of 1 would make the noise infinite
ACCEPTANCE_COUNTER = 0  # the counter the acceptance uniform hashes a row key with: token index -1's


def mix64(values: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on every element: a bijection of 64-bit patterns that scatters nearby inputs.

    Works in place on `values`, which must be the caller's own fresh tensor.
    """
    scratch = torch.empty_like(values)
    _xor_shift_(values, 30, 64, scratch).mul_(_MIX_1)
    _xor_shift_(values, 27, 64, scratch).mul_(_MIX_2)
    return _xor_shift_(values, 31, 64, scratch)


def _xor_shift_(values: torch.Tensor, bits: int, width: int, scratch: torch.Tensor) -> torch.Tensor:
    """values ^= values >>> bits: torch's `>>` copies the sign bit, so a mask makes the shift logical."""
    torch.bitwise_right_shift(values, bits, out=scratch)
    return values.bitwise_xor_(scratch.bitwise_and_((1 << (width - bits)) - 1))


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[rows] int64: one key per (seed, output position), from which each token's bits are hashed."""
    # seed + (position + 1)·γ, wrapping as int64 does, in two ops: one multiply-add, then γ.
    return mix64(torch.add(seeds, positions, alpha=GOLDEN_GAMMA).add_(GOLDEN_GAMMA))


def _halves(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, 1] int32 each: a key's low and high 32 bits (shifts, so no cast ever has to wrap)."""
    low = torch.bitwise_left_shift(keys, 32).bitwise_right_shift_(32).to(torch.int32)
    high = torch.bitwise_right_shift(keys, 32).to(torch.int32)
    return low.unsqueeze(-1), high.unsqueeze(-1)


def token_steps(vocab_size: int, device: torch.device, first: int = 1) -> torch.Tensor:
    """[vocab] int32: (token + first)·γ32 mod 2^32 for each token id, the per-token counters."""
    steps = torch.arange(first, vocab_size + first, dtype=torch.int64, device=device) * GOLDEN_GAMMA_32
    # The low 32 bits, sign-extended: exactly representable in int32.
    return torch.bitwise_left_shift(steps, 32).bitwise_right_shift_(32).to(torch.int32)


class NoiseBuffers:
    """The noise block's tensors, kept from step to step so that no step allocates them.

    What `exponential_noise` returns is a view of `noise`, valid until its next call with these
    buffers; it holds nothing but noise (no request data), and is rewritten whole each step.
    """

    def __init__(self) -> None:
        self.bits = self.noise = self.steps = None

    # Normal tensors even when first taken under inference mode: a sampler used outside it (tests,
    # tools) writes them in place, which an inference tensor refuses.
    @torch.inference_mode(False)
    def take(self, rows: int, vocab_size: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """[rows, vocab] int32 bits, int32 scratch and float32 noise; [vocab] int32 counters.

        The scratch is the noise's memory seen as int32: the hash is done with it before the noise is written.
        """
        if self.steps is None or self.steps.shape[0] != vocab_size or self.steps.device != device:
            self.steps = token_steps(vocab_size, device)
            self.bits = None
        if self.bits is None or self.bits.shape[0] < rows:
            size = max(rows, 2 * (0 if self.bits is None else self.bits.shape[0]))
            self.bits = torch.empty((size, vocab_size), dtype=torch.int32, device=device)
            self.noise = torch.empty((size, vocab_size), dtype=torch.float32, device=device)
        noise = self.noise[:rows]
        return self.bits[:rows], noise.view(torch.int32), noise, self.steps


def token_bits(keys: torch.Tensor, vocab_size: int, buffers: NoiseBuffers | None = None) -> torch.Tensor:
    """[rows, vocab] int32: 32 random bits per (row key, token id)."""
    bits, scratch, _, steps = (buffers or NoiseBuffers()).take(keys.shape[0], vocab_size, keys.device)
    return _hash_(bits, steps, keys, scratch)


def _hash_(bits: torch.Tensor, steps: torch.Tensor, keys: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """`bits` [rows, n] := lowbias32(key low half + counter), the key's high half xored in between."""
    low, high = _halves(keys)
    torch.add(steps, low, out=bits)
    _xor_shift_(bits, 16, 32, scratch).mul_(_LOWBIAS_1)
    _xor_shift_(bits, 15, 32, scratch).bitwise_xor_(high).mul_(_LOWBIAS_2)
    return _xor_shift_(bits, 16, 32, scratch)


def uniform_from_bits(bits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """float32 in (0, 1) from 31 of each int32's bits: (k + 1/2)·2^-31, clamped under 1.

    Consumes `bits` (it is masked in place). Scaling by a power of two is exact, and the one rounding
    add is IEEE on every device.
    """
    return _negated_uniform(bits, out).neg_()


def _negated_uniform(bits: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """-u for `uniform_from_bits`' u, which is what log1p takes: one pass fewer than negating u."""
    bits.bitwise_and_((1 << _UNIFORM_BITS) - 1)
    out = torch.empty(bits.shape, dtype=torch.float32, device=bits.device) if out is None else out
    return out.copy_(bits).add_(0.5).mul_(-(2.0**-_UNIFORM_BITS)).clamp_(min=-_BELOW_ONE)


def exponential_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int,
                      buffers: NoiseBuffers | None = None) -> torch.Tensor:
    """[rows, vocab] float32 Exp(1) draws, each a pure function of (seed, position, token id).

    With `buffers`, a view of them (valid until their next use); without, a tensor of its own.
    """
    return negated_exponential_noise(seeds, positions, vocab_size, buffers).neg_()


def negated_exponential_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int,
                              buffers: NoiseBuffers | None = None) -> torch.Tensor:
    """-E for `exponential_noise`'s E, bit for bit (negation is exact), one pass fewer: a race may divide
    by it and take the least score, argmin(p / -E) being argmax(p / E)."""
    buffers = buffers or NoiseBuffers()
    keys = row_keys(seeds, positions)
    bits, scratch, noise, steps = buffers.take(keys.shape[0], vocab_size, keys.device)
    negated = _negated_uniform(_hash_(bits, steps, keys, scratch), noise)
    # -log(1 - u) rather than -log(u): small noise, which decides races, comes from small u, where
    # float32 is finely spaced.
    return negated.log1p_()


def row_bits(seeds: torch.Tensor, positions: torch.Tensor, counter: int) -> torch.Tensor:
    """[rows, 1] int32: 32 random bits per (seed, position) from one counter of the row's key."""
    keys = row_keys(seeds, positions)
    bits = torch.empty((keys.shape[0], 1), dtype=torch.int32, device=keys.device)
    return _hash_(bits, token_steps(1, keys.device, first=counter), keys, torch.empty_like(bits))


def row_uniforms(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[rows] float32 in (0, 1): the acceptance test's uniform at each (seed, position) (`engine.spec_rejection`)."""
    return uniform_from_bits(row_bits(seeds, positions, ACCEPTANCE_COUNTER)).squeeze(-1)


def draw_uniforms(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[rows] float64 in (0, 1): the uniform a draw at each (seed, position) inverts (`engine.sampling_draw`).

    The key's top 31 bits k, as (k + 1/2)·2^-31, exact in float64: the draw's resolution is 2^-31 of a
    row's mass. No counter is hashed: a draw runs every step for every drawing row, and the key's own
    bits are splitmix64's output already. The acceptance uniform at the same position is independent of
    them: for any fixed high half of a key, its bits are a bijection of the key's low half.
    """
    bits = torch.bitwise_right_shift(row_keys(seeds, positions), 64 - _UNIFORM_BITS).bitwise_and_(
        (1 << _UNIFORM_BITS) - 1)
    # 2^-32 + k·2^-31 in one op, promoted to float64: exact, as k < 2^31.
    return torch.add(_half_step(bits.device), bits, alpha=2.0**-_UNIFORM_BITS)


# A constant kept from step to step (no request data); a normal tensor even when first made under
# inference mode, so that a draw outside it reads it too.
@functools.cache
@torch.inference_mode(False)
def _half_step(device: torch.device) -> torch.Tensor:
    """[1] float64: half a step of the uniforms' 2^-31 grid, which centres each uniform in its step."""
    return torch.full((1,), 2.0 ** -(_UNIFORM_BITS + 1), dtype=torch.float64, device=device)
