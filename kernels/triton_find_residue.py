"""Triton kernel: which listed KV blocks hold any non-zero byte, read in place, in one launch.

The audit check behind zero-on-free. Written apart from the zeroing kernel it checks (no shared code).
The KV tensor is read as 32-bit words, or 16-bit ones for blocks of an odd number of half words, so the
test is on raw bits: a stored -0.0 is residue like any other pattern. The grid is (block id x cache, chunk
of the block); a program that sees a non-zero word sets its block's flag to 1 (every writer writes the same
value, so no atomics are needed). Nothing is copied: the read streams the listed blocks once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

CHUNK_WORDS = 2048
MAX_GRID_Y = 65535


@triton.jit
def _mark_residue_kernel(
    words_ptr, block_id_ptr, flags_ptr, num_ids, num_blocks, block_words,
    CHUNK: tl.constexpr,
):
    item = tl.program_id(0)  # (cache, listed block) pair
    cache = item // num_ids
    block_id = tl.load(block_id_ptr + item % num_ids).to(tl.int64)
    # An id outside the cache reads nothing: its limit is 0 (a scalar-vs-block compare, not a scalar mask).
    limit = tl.where((block_id >= 0) & (block_id < num_blocks), block_words, 0)
    base = (cache.to(tl.int64) * num_blocks + block_id) * block_words
    dirty = tl.zeros([1], dtype=tl.int32)
    for chunk in range(tl.program_id(1), (block_words + CHUNK - 1) // CHUNK, tl.num_programs(1)):
        offsets = chunk * CHUNK + tl.arange(0, CHUNK)
        words = tl.load(words_ptr + base + offsets, mask=offsets < limit, other=0)
        dirty = tl.maximum(dirty, tl.max((words != 0).to(tl.int32), axis=0))
    one = tl.arange(0, 1)
    tl.store(flags_ptr + block_id + one, tl.full([1], 1, dtype=tl.int32), mask=one < dirty)


def mark_residue(kv_cache: Tensor, block_ids: Tensor, flags: Tensor) -> None:
    """Triton `mark_residue`; arguments already validated by `kernels.dispatch`."""
    num_caches, num_blocks = kv_cache.shape[0], kv_cache.shape[1]
    block_bytes = kv_cache[0, 0].numel() * kv_cache.element_size()
    word_dtype = torch.int32 if block_bytes % 4 == 0 else torch.int16
    words = kv_cache.view(-1).view(word_dtype)
    block_words = block_bytes // words.element_size()
    block_ids = block_ids.contiguous()
    num_ids = block_ids.shape[0]
    chunks = min(triton.cdiv(block_words, CHUNK_WORDS), MAX_GRID_Y)
    _mark_residue_kernel[(num_caches * num_ids, chunks)](
        words, block_ids, flags, num_ids, num_blocks, block_words, CHUNK=CHUNK_WORDS,
    )
