"""Triton kernel: write new tokens' K and V into their paged-cache slots.

One program per token copies its [num_kv_heads, head_dim] K and V rows. A slot of -1 (padding) or outside
the cache is skipped by masking, so a bad slot can never write outside the cache even when the host-side
range check is skipped (CUDA, see `kernels.validation`).
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    num_slots,
    key_token_stride, key_head_stride, value_token_stride, value_head_stride,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    # A skipped or out-of-cache slot writes nothing: its head limit is 0.
    head_limit = tl.where((slot >= 0) & (slot < num_slots), NUM_KV_HEADS, 0)
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, DIM_PAD)
    mask = (heads[:, None] < head_limit) & (dims[None, :] < HEAD_DIM)
    key_offsets = token.to(tl.int64) * key_token_stride + heads[:, None] * key_head_stride + dims[None, :]
    value_offsets = token.to(tl.int64) * value_token_stride + heads[:, None] * value_head_stride + dims[None, :]
    cache_offsets = slot * (NUM_KV_HEADS * HEAD_DIM) + heads[:, None] * HEAD_DIM + dims[None, :]
    tl.store(k_cache_ptr + cache_offsets, tl.load(key_ptr + key_offsets, mask=mask), mask=mask)
    tl.store(v_cache_ptr + cache_offsets, tl.load(value_ptr + value_offsets, mask=mask), mask=mask)


def store_kv(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Triton `store_kv`; arguments already validated by `kernels.dispatch`."""
    num_tokens, num_kv_heads, head_dim = key.shape
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    slot_mapping = slot_mapping.contiguous()  # read as pointer + token
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        k_cache.shape[0] * k_cache.shape[1],
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads), DIM_PAD=triton.next_power_of_2(head_dim),
    )
