"""Triton kernel: the gated MLP's activation, silu(gate) * up, read from the stacked gate/up projection.

Grid (row, chunk of the intermediate width): each program reads its gate and up chunks from the two halves
of one row and writes one chunk of the product. SiLU is computed in float32 and rounded to the input dtype
before the product, as torch's `silu(gate) * up` rounds it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

CHUNK = 1024


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, width, row_stride, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    mask = cols < width
    gate = tl.load(gate_up_ptr + row * row_stride + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * row_stride + width + cols, mask=mask, other=0.0)
    as_float = gate.to(tl.float32)
    # Rounded where torch rounds; the product of two half-precision values is exact in float32.
    activated = (as_float * tl.sigmoid(as_float)).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * width + cols, (activated * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_and_mul(gate_up: Tensor) -> Tensor:
    """Triton `silu_and_mul`; arguments already validated by `kernels.dispatch`."""
    rows = gate_up.reshape(-1, gate_up.shape[-1])
    rows = rows if rows.stride(1) == 1 else rows.contiguous()
    width = rows.shape[1] // 2
    out = torch.empty(*gate_up.shape[:-1], width, dtype=gate_up.dtype, device=gate_up.device)
    _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(width, CHUNK))](rows, out, width, rows.stride(0), CHUNK=CHUNK)
    return out
