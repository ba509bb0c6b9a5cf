"""Triton kernel: zero freed KV blocks in every layer's K and V cache, in one launch per engine step.

The KV tensor is reinterpreted as 32-bit words, or 16-bit ones for blocks of an odd number of half
words (zero is all-zero bytes in every dtype), and the grid is
(block id x cache, chunk of the block): every program writes one contiguous chunk, so the launch streams
zeros at memset speed however many blocks and layers are freed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

CHUNK_WORDS = 2048  # 8 KiB of zeros per program (32-bit words): long enough runs for full-width stores, enough programs to fill the GPU
MAX_GRID_Y = 65535


@triton.jit
def _zero_blocks_kernel(
    cache_ptr, block_id_ptr, num_ids, num_blocks, block_words,
    CHUNK: tl.constexpr,
):
    item = tl.program_id(0)  # (cache, listed block) pair
    cache = item // num_ids
    block_id = tl.load(block_id_ptr + item % num_ids).to(tl.int64)
    # An id outside the cache writes nothing: its limit is 0 (a scalar-vs-block compare, not a scalar mask).
    limit = tl.where((block_id >= 0) & (block_id < num_blocks), block_words, 0)
    base = (cache.to(tl.int64) * num_blocks + block_id) * block_words
    for chunk in range(tl.program_id(1), (block_words + CHUNK - 1) // CHUNK, tl.num_programs(1)):
        offsets = chunk * CHUNK + tl.arange(0, CHUNK)
        mask = offsets < limit
        tl.store(cache_ptr + base + offsets, tl.full([CHUNK], 0, dtype=cache_ptr.dtype.element_ty), mask=mask)


def zero_blocks(kv_cache: Tensor, block_ids: Tensor) -> None:
    """Triton `zero_blocks`; arguments already validated by `kernels.dispatch`."""
    num_caches, num_blocks = kv_cache.shape[0], kv_cache.shape[1]
    block_bytes = kv_cache[0, 0].numel() * kv_cache.element_size()
    word_dtype = torch.int32 if block_bytes % 4 == 0 else torch.int16
    words = kv_cache.view(-1).view(word_dtype)
    block_words = block_bytes // words.element_size()
    block_ids = block_ids.contiguous()  # read as pointer + index
    num_ids = block_ids.shape[0]
    chunks = min(triton.cdiv(block_words, CHUNK_WORDS), MAX_GRID_Y)
    _zero_blocks_kernel[(num_caches * num_ids, chunks)](
        words, block_ids, num_ids, num_blocks, block_words, CHUNK=CHUNK_WORDS,
    )
