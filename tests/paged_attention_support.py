"""Paged-attention batches drawn by Hypothesis and a naive float64 attention: the oracle of every CPU attention
kernel (`kernels.reference`, `kernels.cpu_decode`)."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from kernels.paged_batch import PagedBatch, build_paged_batch

# The reference rounds a float32 result once to the output dtype: at most one ulp of |out| < 4.
OUTPUT_TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3.2e-2}


def naive_attention(batch: PagedBatch) -> torch.Tensor:
    """softmax(q k^T * scale) v per query row and head, in float64, reading pages one position at a time."""
    block_size = batch.k_cache.shape[1]
    group = batch.query.shape[1] // batch.k_cache.shape[2]
    out = torch.zeros(batch.query.shape, dtype=torch.float64)
    offsets, contexts = batch.cu_seqlens_q.tolist(), batch.context_lens.tolist()
    for seq, context_len in enumerate(contexts):
        pages = [int(batch.block_tables[seq, position // block_size]) for position in range(context_len)]
        keys = torch.stack([batch.k_cache[page, pos % block_size] for pos, page in enumerate(pages)]).double()
        values = torch.stack([batch.v_cache[page, pos % block_size] for pos, page in enumerate(pages)]).double()
        q_len = offsets[seq + 1] - offsets[seq]
        for j in range(q_len):
            visible = context_len - q_len + j + 1
            for head in range(batch.query.shape[1]):
                q = batch.query[offsets[seq] + j, head].double()
                scores = keys[:visible, head // group] @ q * batch.scale
                out[offsets[seq] + j, head] = torch.softmax(scores, 0) @ values[:visible, head // group]
    return out


@st.composite
def batches(draw: st.DrawFn, decode: bool) -> PagedBatch:
    block_size = draw(st.sampled_from([1, 4, 8, 16]))
    num_seqs = draw(st.integers(1, 4))
    exact = st.sampled_from([block_size, 2 * block_size])
    contexts = draw(st.lists(st.one_of(st.just(1), st.integers(1, 30), exact), min_size=num_seqs, max_size=num_seqs))
    query_lens = [1] * num_seqs if decode else [draw(st.integers(0, context)) for context in contexts]
    num_kv_heads = draw(st.sampled_from([1, 2]))
    return build_paged_batch(
        contexts, query_lens, num_heads=num_kv_heads * draw(st.sampled_from([1, 2, 4, 8])),
        num_kv_heads=num_kv_heads, head_dim=draw(st.sampled_from([8, 16])), block_size=block_size,
        dtype=draw(st.sampled_from(list(OUTPUT_TOLERANCE))), stale_id=draw(st.sampled_from([None, 0, 10**6])),
        generator=torch.Generator().manual_seed(draw(st.integers(0, 2**31))),
    )
