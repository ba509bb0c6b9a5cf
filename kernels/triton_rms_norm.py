"""Triton kernel: RMSNorm of each row, optionally after adding the residual stream (one pass over memory).

One program per row. The sum of squares is taken in float32 and the normalised row is rounded to the input
dtype before the weight multiplies it, as the decoder's reference (and Hugging Face's) does. With a residual,
the row is first `hidden + residual` in the input dtype; that sum is written out as the new residual stream,
as vLLM's fused_add_rms_norm does, so the next layer needs no separate add.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _rms_norm_kernel(
    hidden_ptr, residual_ptr, weight_ptr, out_ptr, new_residual_ptr,
    width, hidden_row_stride, residual_row_stride, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    hidden = tl.load(hidden_ptr + row * hidden_row_stride + cols, mask=mask, other=0.0)
    dtype = hidden.dtype
    # Arithmetic in float32, each result rounded to the input dtype where the reference rounds it: a sum
    # or product of two half-precision values is exact in float32, so one rounding matches torch's op.
    as_float = hidden.to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * residual_row_stride + cols, mask=mask, other=0.0)
        summed = (as_float + residual.to(tl.float32)).to(dtype)
        tl.store(new_residual_ptr + row * width + cols, summed, mask=mask)
        as_float = summed.to(tl.float32)
    inverse_rms = tl.rsqrt(tl.sum(as_float * as_float, axis=0) / width + eps)
    normed = (as_float * inverse_rms).to(dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * width + cols, (normed * weight).to(dtype), mask=mask)


def _rows(tensor: Tensor) -> Tensor:
    """[rows, width] with unit stride along the row (a copy only when the tensor is not already so)."""
    rows = tensor.reshape(-1, tensor.shape[-1])
    return rows if rows.stride(1) == 1 else rows.contiguous()


def _launch(hidden: Tensor, residual: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor | None]:
    rows = _rows(hidden)
    out = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)
    residual_rows = None if residual is None else _rows(residual)
    new_residual = None if residual is None else torch.empty_like(out)
    width = rows.shape[1]
    _rms_norm_kernel[(rows.shape[0],)](
        rows, rows if residual_rows is None else residual_rows, weight, out,
        out if new_residual is None else new_residual,
        width, rows.stride(0), 0 if residual_rows is None else residual_rows.stride(0), float(eps),
        HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(width),
    )
    return out, new_residual


def rms_norm(hidden: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Triton `rms_norm`; arguments already validated by `kernels.dispatch`."""
    return _launch(hidden, None, weight, eps)[0]


def add_rms_norm(hidden: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Triton `add_rms_norm`; arguments already validated by `kernels.dispatch`."""
    out, new_residual = _launch(hidden, residual, weight, eps)
    assert new_residual is not None
    return out, new_residual
