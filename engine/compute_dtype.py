"""Which dtype the engine computes in: the model's own where the device computes it natively, else float32.

`EngineConfig.dtype` unset means the checkpoint's `torch_dtype`, kept where the device has native arithmetic
for it: a bf16 checkpoint stays bf16 on a CPU with AVX-512 BF16 or AMX (half the bytes each step reads, and
faster matrix products), and is widened to float32 on one without, where torch would emulate bf16 op by op.
float32 checkpoints (every test model) stay float32, so exactness against `transformers` is untouched.
An explicit dtype is always honoured, and refused by name where the device cannot compute it at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import parse_dtype
from engine.errors import EngineError


@dataclass(frozen=True, slots=True)
class DtypeChoice:
    """The dtype the engine loads its weights and KV in, and why (`veil generate` prints it)."""

    dtype: torch.dtype
    reason: str
    widened: bool = False  # the checkpoint's own dtype was widened to float32 (the one case a user is told)

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def native_dtypes(device: torch.device) -> frozenset[torch.dtype]:
    """The floating dtypes `device` has native arithmetic for (float32 everywhere)."""
    if device.type == "cuda":
        half = {torch.float16} | ({torch.bfloat16} if torch.cuda.is_bf16_supported() else set())
        return frozenset({torch.float32} | half)
    if device.type != "cpu":
        return frozenset({torch.float32})
    native = {torch.float32}
    if torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported():
        native.add(torch.bfloat16)
    if torch.cpu._is_amx_fp16_supported():
        native.add(torch.float16)
    return frozenset(native)


def choose_dtype(requested: str | None, model_dtype: torch.dtype, device: torch.device,
                 native: frozenset[torch.dtype] | None = None) -> DtypeChoice:
    """The engine's dtype for `EngineConfig.dtype` (`requested`) and the checkpoint's `model_dtype`.

    `native`: what the device computes natively (default: `native_dtypes(device)`; tests pass their own).
    """
    native = native_dtypes(device) if native is None else native
    if requested is not None:
        dtype = parse_dtype(requested)
        if device.type == "cuda" and dtype not in native:
            raise EngineError(f"dtype {requested!r} is not supported by this GPU; use float32 or float16")
        return DtypeChoice(dtype, "set by the engine's dtype")
    if model_dtype in native:
        return DtypeChoice(model_dtype, f"the model's own; {device.type} computes it natively")
    own = str(model_dtype).removeprefix("torch.")
    return DtypeChoice(torch.float32, f"the model's {own} widened: this {device.type} has no native {own} arithmetic",
                       widened=True)
