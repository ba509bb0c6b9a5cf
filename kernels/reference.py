"""Torch implementations of the KV-path kernels: the CPU production path and the Triton kernels' test oracle.

Same signatures as `kernels.dispatch`; inputs are assumed valid (the dispatch layer checks them).
Attention is computed in float32 whatever the cache dtype and cast back, as the Triton kernels do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def store_kv(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Write token i's K/V into slot slot_mapping[i] of the paged caches; slot -1 skips the token."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].to(torch.int64)
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key[keep])
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value[keep])


def zero_blocks(kv_cache: Tensor, block_ids: Tensor) -> None:
    """Zero the listed blocks in every cache of the engine's KV tensor, in one indexed fill."""
    kv_cache.index_fill_(1, block_ids.to(device=kv_cache.device, dtype=torch.int64), 0)


def find_residue(kv_cache: Tensor, block_ids: Tensor) -> list[int]:
    """The listed ids (first occurrence order) whose bytes are not all zero in some cache.

    Compares raw bytes, so a stored -0.0 counts as residue just as any other non-zero pattern does.
    """
    ids = block_ids.to(device=kv_cache.device, dtype=torch.int64)
    raw = kv_cache.view(torch.uint8).view(kv_cache.shape[0], kv_cache.shape[1], -1)
    dirty = (raw.index_select(1, ids) != 0).any(dim=2).any(dim=0)
    return list(dict.fromkeys(int(block_id) for block_id, is_dirty in zip(ids.tolist(), dirty.tolist()) if is_dirty))


def paged_attention(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    cu_seqlens_q: Tensor,
    max_seqlen_q: int,
    scale: float,
) -> Tensor:
    """Attention of the new query tokens over each sequence's paged context (see `kernels.dispatch`)."""
    if query.shape[0] == 0:
        return torch.empty_like(query)
    if max_seqlen_q == 1 and query.shape[0] == context_lens.shape[0]:
        # Every sequence has exactly one new token: one gather and one batched attention call.
        return _decode(query, k_cache, v_cache, block_tables, context_lens, scale)
    return _prefill(query, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, scale)


def _live_block_tables(block_tables: Tensor, context_lens: Tensor, block_size: int, num_table_blocks: int) -> Tensor:
    """block_tables[:, :num_table_blocks] as int64, entries past each context replaced by block 0 (masked later).

    Padding (-1) and stale entries past ceil(context_len / block_size) are never used as addresses.
    """
    columns = torch.arange(num_table_blocks, device=block_tables.device)
    used_blocks = (context_lens.to(torch.int64) + block_size - 1) // block_size
    live = columns[None, :] < used_blocks[:, None]
    return torch.where(live, block_tables[:, :num_table_blocks].to(torch.int64), 0)


def _gather(cache: Tensor, tables: Tensor, length: int) -> Tensor:
    """[num_seqs, num_table_blocks] block ids -> [num_seqs, num_kv_heads, length, head_dim] in float32."""
    num_seqs = tables.shape[0]
    pages = cache[tables].reshape(num_seqs, -1, cache.shape[2], cache.shape[3])[:, :length]
    return pages.transpose(1, 2).float()


def _decode(
    query: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, context_lens: Tensor, scale: float
) -> Tensor:
    block_size = k_cache.shape[1]
    max_context = int(context_lens.max())
    num_table_blocks = (max_context + block_size - 1) // block_size
    tables = _live_block_tables(block_tables, context_lens, block_size, num_table_blocks)
    keys = _gather(k_cache, tables, max_context)
    values = _gather(v_cache, tables, max_context)
    positions = torch.arange(max_context, device=query.device)
    visible = (positions[None, :] < context_lens[:, None].to(torch.int64))[:, None, None, :]
    # A group's query heads ride as query rows of their KV head: K/V are used as gathered, never repeated.
    num_seqs, num_kv_heads = query.shape[0], k_cache.shape[2]
    queries = query.float().reshape(num_seqs, num_kv_heads, -1, query.shape[2])
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=visible, scale=scale)
    return out.reshape(query.shape).to(query.dtype)


def _prefill(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    cu_seqlens_q: Tensor,
    scale: float,
) -> Tensor:
    block_size = k_cache.shape[1]
    out = torch.empty_like(query)
    offsets = cu_seqlens_q.tolist()
    contexts = context_lens.tolist()
    for seq, context_len in enumerate(contexts):
        start, end = offsets[seq], offsets[seq + 1]
        if end == start:
            continue
        num_table_blocks = (context_len + block_size - 1) // block_size
        tables = block_tables[seq : seq + 1, :num_table_blocks].to(torch.int64)
        keys = _gather(k_cache, tables, context_len)
        values = _gather(v_cache, tables, context_len)
        out[start:end] = _attend_causal(query[start:end], keys, values, context_len, scale).to(query.dtype)
    return out


def _attend_causal(queries: Tensor, keys: Tensor, values: Tensor, context_len: int, scale: float) -> Tensor:
    """queries [q_len, heads, dim] sit at the last q_len positions of a context of context_len tokens."""
    q_len = queries.shape[0]
    query_positions = torch.arange(context_len - q_len, context_len, device=queries.device)
    key_positions = torch.arange(context_len, device=queries.device)
    visible = key_positions[None, :] <= query_positions[:, None]
    batched = queries.float().transpose(0, 1).unsqueeze(0)  # [1, heads, q_len, dim]
    out = F.scaled_dot_product_attention(batched, keys, values, attn_mask=visible, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)
