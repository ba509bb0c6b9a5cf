"""Kernels: the KV path (store K/V into pages, paged attention with grouped-query heads, zero freed blocks,
check them for residue) and the decoder's layers (RMSNorm with the residual add, SiLU-and-mul, rotary embedding).

Every kernel has a Triton implementation (CUDA, or the Triton interpreter on CPU) and a torch reference
with the same signature, which is both the CPU production path and the test oracle. Call them through
this package: `kernels.dispatch` validates the inputs and picks the implementation.
"""

from kernels.dispatch import (
    add_rms_norm,
    count_residue,
    find_residue,
    force,
    paged_attention,
    residue_flags,
    rms_norm,
    rotary_embedding,
    runs_native_decode,
    selected_backend,
    silu_and_mul,
    store_kv,
    zero_blocks,
)
from kernels.errors import KernelBackendError, KernelError, KernelInputError
from kernels.per_forward import one_forward

__all__ = [
    "KernelBackendError",
    "KernelError",
    "KernelInputError",
    "add_rms_norm",
    "count_residue",
    "find_residue",
    "force",
    "one_forward",
    "paged_attention",
    "residue_flags",
    "rms_norm",
    "rotary_embedding",
    "runs_native_decode",
    "selected_backend",
    "silu_and_mul",
    "store_kv",
    "zero_blocks",
]
