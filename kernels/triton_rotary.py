"""Triton kernel: rotate-half (neox-style) rotary embedding of query and key, in one launch.

One program per token rotates all its query and key heads with the cos/sin of its position, read from the
precomputed caches [max_positions, head_dim / 2] (any frequency scaling, e.g. llama3, is already in them).
The cache values are rounded to the query dtype first, as the reference casts its tables, and the rotation
is computed in float32. A position outside the caches reads nothing and rotates by zero (the host-side
range check is skipped on CUDA, see `kernels.validation`). Query and key may be strided views (the split of
the stacked q/k/v projection): rows are read through their token and head strides.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _rotate_heads(
    source_ptr, target_ptr, token, source_token_stride, source_head_stride, target_token_stride, target_head_stride,
    cos, sin, NUM_HEADS: tl.constexpr, HALF: tl.constexpr, HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr,
):
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HALF_PAD)[None, :]
    mask = (heads < NUM_HEADS) & (dims < HALF)
    source = source_ptr + token * source_token_stride + heads * source_head_stride + dims
    target = target_ptr + token * target_token_stride + heads * target_head_stride + dims
    first = tl.load(source, mask=mask, other=0.0)
    second = tl.load(source + HALF, mask=mask, other=0.0)
    first_f, second_f = first.to(tl.float32), second.to(tl.float32)
    tl.store(target, (first_f * cos - second_f * sin).to(first.dtype), mask=mask)
    tl.store(target + HALF, (second_f * cos + first_f * sin).to(first.dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr, query_ptr, key_ptr, query_out_ptr, key_out_ptr, cos_ptr, sin_ptr, max_positions,
    query_token_stride, query_head_stride, key_token_stride, key_head_stride,
    query_out_token_stride, query_out_head_stride, key_out_token_stride, key_out_head_stride,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
    HEADS_PAD: tl.constexpr, KV_HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    # An out-of-cache position loads nothing: its limit is 0 (a scalar-vs-block compare, not a scalar mask).
    limit = tl.where((position >= 0) & (position < max_positions), HALF, 0)
    dims = tl.arange(0, HALF_PAD)
    dtype = query_ptr.dtype.element_ty
    cos = tl.load(cos_ptr + position * HALF + dims, mask=dims < limit, other=1.0).to(dtype).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + position * HALF + dims, mask=dims < limit, other=0.0).to(dtype).to(tl.float32)[None, :]
    _rotate_heads(query_ptr, query_out_ptr, token, query_token_stride, query_head_stride,
                  query_out_token_stride, query_out_head_stride, cos, sin, NUM_HEADS, HALF, HEADS_PAD, HALF_PAD)
    _rotate_heads(key_ptr, key_out_ptr, token, key_token_stride, key_head_stride,
                  key_out_token_stride, key_out_head_stride, cos, sin, NUM_KV_HEADS, HALF, KV_HEADS_PAD, HALF_PAD)


def rotary_embedding(
    positions: Tensor, query: Tensor, key: Tensor, cos_cache: Tensor, sin_cache: Tensor, inplace: bool
) -> tuple[Tensor, Tensor]:
    """Triton `rotary_embedding`; arguments already validated by `kernels.dispatch`."""
    query_out = query if inplace else torch.empty(query.shape, dtype=query.dtype, device=query.device)
    key_out = key if inplace else torch.empty(key.shape, dtype=key.dtype, device=key.device)
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    _rotary_kernel[(num_tokens,)](
        positions.contiguous(), query, key, query_out, key_out, cos_cache, sin_cache, cos_cache.shape[0],
        query.stride(0), query.stride(1), key.stride(0), key.stride(1),
        query_out.stride(0), query_out.stride(1), key_out.stride(0), key_out.stride(1),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HALF=head_dim // 2,
        HEADS_PAD=triton.next_power_of_2(num_heads), KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HALF_PAD=triton.next_power_of_2(head_dim // 2),
    )
    return query_out, key_out
