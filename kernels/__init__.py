"""KV-path kernels: store K/V into pages, paged attention with grouped-query heads, zero freed blocks.

Every kernel has a Triton implementation (CUDA, or the Triton interpreter on CPU) and a torch reference
with the same signature, which is both the CPU production path and the test oracle. Call them through
this package: `kernels.dispatch` validates the inputs and picks the implementation.
"""

from kernels.dispatch import (
    find_residue,
    force,
    paged_attention,
    selected_backend,
    store_kv,
    zero_blocks,
)
from kernels.errors import KernelBackendError, KernelError, KernelInputError

__all__ = [
    "KernelBackendError",
    "KernelError",
    "KernelInputError",
    "find_residue",
    "force",
    "paged_attention",
    "selected_backend",
    "store_kv",
    "zero_blocks",
]
