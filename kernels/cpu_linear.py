"""Matrix products on a CPU over weights prepacked once, in oneDNN's blocked layout.

`F.linear` on a bf16 weight repacks or reads it in a layout its kernel streams poorly: on the 46M `bench`
model a batch-1 decode step's products ran at about 13 GB/s, against about 30 GB/s over the same weights
prepacked (`benchmarks/engine_host.py --dtypes`), with bit-identical results (the same oneDNN kernel,
handed its layout ready). Only bf16 is packed: float32 packed products sum in another order than
`F.linear`, which would cost the exactness with `transformers` that the fp32 tests hold the engine to.
The packed copy lives beside the dense weight, which the rest of the engine reads (tied embeddings,
checkpoint layouts, byte counts): a packed model holds its projections twice in host memory.
"""

from __future__ import annotations

import torch
from torch import Tensor

PACKED_DTYPES = (torch.bfloat16,)


def can_pack(weight: Tensor) -> bool:
    """Whether `weight` [out, in] is one this module packs: a bf16 CPU tensor, oneDNN in this torch build and
    native bf16 arithmetic in this CPU."""
    return (weight.device.type == "cpu" and weight.dtype in PACKED_DTYPES and weight.dim() == 2
            and torch.backends.mkldnn.is_available() and _native_bf16())


def _native_bf16() -> bool:
    # Without AVX-512 BF16 or AMX oneDNN's bf16 products are emulated, or refused on older instruction sets.
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def pack(weight: Tensor) -> Tensor:
    """`weight` in oneDNN's layout for products with inputs of any number of rows (an opaque tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def linear(hidden: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    """`F.linear(hidden, weight, bias)` over `pack(weight)`: the same values, bit for bit."""
    return torch.ops.mkldnn._linear_pointwise(hidden, packed, bias, "none", [], "")
