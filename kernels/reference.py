"""Torch implementations of the kernels: the CPU production path and the Triton kernels' test oracle.

Same signatures as `kernels.dispatch`; inputs are assumed valid (the dispatch layer checks them).
Attention accumulates in float32 whatever the cache dtype and is cast back, as the Triton kernels do (on a
CPU a bf16 cache goes to SDPA as it is: `_attention_dtype`). The layer
kernels (RMSNorm, SiLU-and-mul, rotary embedding) round exactly where Hugging Face's Llama does, op for op,
so on a CPU the engine computes what `transformers` computes, and no slower than plain torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels import per_forward


def store_kv(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Write token i's K/V into slot slot_mapping[i] of the paged caches; slot -1 skips the token.

    Which tokens are kept, and where they go, is the same in every layer: inside
    `kernels.per_forward.one_forward()` the first layer works it out for all."""
    rows, slots = per_forward.once(("kv slots", id(slot_mapping)), lambda: _kept_slots(slot_mapping))
    if rows is not None:
        key, value = key.index_select(0, rows), value.index_select(0, rows)
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value)


def _kept_slots(slot_mapping: Tensor) -> tuple[Tensor | None, Tensor]:
    """(the rows of the tokens kept, or None when all are; their slots as int64)."""
    keep = slot_mapping >= 0
    if bool(keep.all()):
        return None, slot_mapping.to(torch.int64)
    rows = keep.nonzero().flatten()
    return rows, slot_mapping.index_select(0, rows).to(torch.int64)


def zero_blocks(kv_cache: Tensor, block_ids: Tensor) -> None:
    """Zero the listed blocks in every cache of the engine's KV tensor, in one indexed fill."""
    kv_cache.index_fill_(1, block_ids.to(device=kv_cache.device, dtype=torch.int64), 0)


# The residue check reads at most this many bytes of the cache per copy, however many blocks are listed.
RESIDUE_CHUNK_BYTES = 64 << 20
_WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)


def mark_residue(kv_cache: Tensor, block_ids: Tensor, flags: Tensor) -> None:
    """Set flags[block_id] = 1 for every listed block with a non-zero byte in some cache; others stay as they are.

    Compares raw bytes, so a stored -0.0 counts as residue just as any other non-zero pattern does. The listed
    blocks are gathered a chunk at a time (at most RESIDUE_CHUNK_BYTES), never all at once: a full pool
    would otherwise need a copy as large as the cache itself.
    """
    block_bytes = kv_cache[0, 0].numel() * kv_cache.element_size()
    word = next(dtype for dtype in _WORDS if block_bytes % torch.empty((), dtype=dtype).element_size() == 0)
    words = kv_cache.view(torch.uint8).view(kv_cache.shape[0], kv_cache.shape[1], -1).view(word)
    ids = block_ids.to(device=kv_cache.device, dtype=torch.int64)
    per_chunk = max(1, RESIDUE_CHUNK_BYTES // (kv_cache.shape[0] * block_bytes))
    for start in range(0, ids.shape[0], per_chunk):
        chunk = ids[start : start + per_chunk]
        dirty = words.index_select(1, chunk).ne(0).any(dim=2).any(dim=0)
        flags.index_fill_(0, chunk[dirty], 1)


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
    """Attention of the new query tokens over each sequence's paged context (see `kernels.dispatch`): the CPU path.

    Batched, with no Python loop over sequences: the step's decode tokens (one new token each) go through
    one masked attention call, its prefill chunks through another, each gathering its sequences' pages
    with one index and padding them to the group's longest context. Decode and chunks are kept apart because
    padding a decode token's query to the longest chunk would multiply its work by that chunk's length.
    A group whose padded K/V would pass GATHER_BUDGET_BYTES is cut, by context length, into calls that
    each fit it: short contexts (the common decode step) make one call, long ones a few.
    The plan (groups, block ids, masks) depends on the step's metadata only, so inside
    `kernels.per_forward.one_forward()` the first layer makes it and the others reuse it.
    Same results as `paged_attention_per_sequence`, the test oracle.
    """
    if query.shape[0] == 0:
        return torch.empty_like(query)
    dtype = _attention_dtype(k_cache)
    key = ("attention plan", id(block_tables), id(context_lens), id(cu_seqlens_q), query.shape[0], tuple(k_cache.shape),
           dtype)
    plan = per_forward.once(key, lambda: _plan(query.shape[0], k_cache.shape, dtype.itemsize, block_tables,
                                               context_lens, cu_seqlens_q))
    if len(plan) == 1 and plan[0].in_order:
        return _attend_group(query, k_cache, v_cache, plan[0], scale, dtype).to(query.dtype)
    out = torch.empty_like(query)
    for group in plan:
        out.index_copy_(0, group.write_rows, _attend_group(query, k_cache, v_cache, group, scale, dtype).to(query.dtype))
    return out


def _attention_dtype(cache: Tensor) -> torch.dtype:
    """What the batched kernel gathers K/V and queries in: float32, but bf16 as it is on a CPU. There SDPA's
    kernel accumulates bf16 in float32 itself (rounding the softmax weights to bf16, as transformers' bf16
    attention on a CPU does), and a float32 copy of every gathered page cost about a fifth of the attention's
    time at batch 64 (`benchmarks/engine_host.py`)."""
    return torch.bfloat16 if cache.dtype == torch.bfloat16 and cache.device.type == "cpu" else torch.float32


# The K/V one attention call gathers, at most (a single sequence may exceed it): sized to stay in a core's
# cache, since gathered K/V read again from memory cost more than the calls saved by one larger batch.
GATHER_BUDGET_BYTES = 2 << 20


@dataclass(frozen=True, slots=True)
class _Group:
    """One masked attention call: which blocks it gathers, which query rows it reads and writes, its mask."""

    block_ids: Tensor  # [num_seqs * width] int64: each sequence's blocks, padded with its first (masked out)
    num_seqs: int
    length: int  # the context every sequence of the group is gathered to: width * block_size, or a lone one's own
    visible: Tensor | None  # the attention mask, broadcast over heads; None where every gathered slot is visible
    read_rows: Tensor  # query rows gathered (padding rows repeat the last real one)
    write_rows: Tensor  # output rows written: the real ones
    real: Tensor | None  # prefill: which of the [num_seqs, q_len] gathered rows are real; decode: None
    q_len: int
    in_order: bool = False  # reads and writes every query row in order: no gather or scatter of rows needed


def _plan(num_tokens: int, cache_shape: torch.Size, itemsize: int, block_tables: Tensor, context_lens: Tensor,
          cu_seqlens_q: Tensor) -> list[_Group]:
    # Host tensors on this path (CUDA runs Triton's kernel): reading them back costs no crossing.
    offsets = cu_seqlens_q.tolist()
    contexts = context_lens.tolist()
    query_lens = [end - start for start, end in zip(offsets, offsets[1:])]
    if query_lens == [1]:  # one sequence's decode token (batch 1): its blocks, its whole context, in order
        block_ids = block_tables[0, : -(-contexts[0] // cache_shape[1])].to(torch.int64)
        first = cu_seqlens_q[:1].to(torch.int64)
        return [_Group(block_ids, 1, contexts[0], None, first, first, None, 1, True)]
    lens_q = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    block_size = cache_shape[1]
    kv_row_bytes = 2 * cache_shape[2] * cache_shape[3] * itemsize  # one token's K and V, as gathered
    groups: list[_Group] = []
    for selected, is_member in ((lens_q == 1, lambda n: n == 1), (lens_q > 1, lambda n: n > 1)):
        members = sorted((context, seq) for seq, (context, n) in enumerate(zip(contexts, query_lens)) if is_member(n))
        if not members:
            continue
        rows = selected.nonzero().flatten()
        rows = rows.index_select(0, context_lens.index_select(0, rows).argsort(stable=True))  # by context length
        sorted_contexts = [context for context, _ in members]
        for start, end in _groups(sorted_contexts, block_size, kv_row_bytes, GATHER_BUDGET_BYTES):
            # Each group's queries are padded to its own longest chunk, not the step's: rows past a chunk's end
            # are computed and dropped, and a group of short prompts beside a long one would pay for its length.
            q_len = max(query_lens[seq] for _, seq in members[start:end])
            groups.append(_group(num_tokens, block_size, block_tables, context_lens, cu_seqlens_q, rows[start:end],
                                 sorted_contexts[end - 1], q_len))
    return groups


def _groups(sorted_contexts: list[int], block_size: int, row_bytes: int, budget: int) -> list[tuple[int, int]]:
    """Consecutive [start, end) ranges of the length-sorted sequences, each gathering at most `budget` bytes
    of K/V padded to its longest context (at least one sequence each): short contexts share one call."""
    groups, start = [], 0
    for index, context in enumerate(sorted_contexts):
        padded = -(-context // block_size) * block_size
        if index > start and (index - start + 1) * padded * row_bytes > budget:
            groups.append((start, index))
            start = index
    groups.append((start, len(sorted_contexts)))
    return groups


def _group(num_tokens: int, block_size: int, block_tables: Tensor, context_lens: Tensor, cu_seqlens_q: Tensor,
           rows: Tensor, longest: int, q_len: int) -> _Group:
    """The plan of one call for the sequences `rows`, whose contexts are at most `longest` and query lengths
    at most `q_len` (1: each has exactly one new token)."""
    device = context_lens.device
    pick = (lambda t: t.index_select(0, rows))  # noqa: E731 (each metadata tensor, for the group's rows)
    num_seqs = rows.shape[0]
    width = -(-longest // block_size)
    lens = pick(context_lens).to(torch.int64)
    # Entries past a context may be -1 or stale, even out of range: read the sequence's own first block there
    # instead, masked out below. Masked is not enough to keep another sequence's data out: a weight of 0 times a
    # NaN is NaN. (Zeroing the padded slots after the gather cost about a sixth of a 16-sequence call.)
    in_context = torch.arange(width, device=device)[None, :] * block_size < lens[:, None]
    tables = pick(block_tables[:, :width]).to(torch.int64)
    block_ids = torch.where(in_context, tables, tables[:, :1]).flatten()
    starts = pick(cu_seqlens_q[:-1]).to(torch.int64)
    columns = torch.arange(width * block_size, device=device)
    if q_len == 1:
        in_order = num_seqs == num_tokens and bool((starts == torch.arange(num_seqs, device=device)).all())
        if bool((lens == longest).all()):  # one context length (batch 1): gather exactly it, seen whole, no mask
            return _Group(block_ids, num_seqs, longest, None, starts, starts, None, 1, in_order)
        visible = (columns[None, :] < lens[:, None])[:, None, None, :]
        return _Group(block_ids, num_seqs, width * block_size, visible, starts, starts, None, 1, in_order)
    ends = pick(cu_seqlens_q[1:]).to(torch.int64)
    steps = torch.arange(q_len, device=device)
    tokens = starts[:, None] + steps[None, :]  # [seqs, q_len]; past a sequence's end: padding rows
    real = tokens < ends[:, None]
    positions = (lens - (ends - starts))[:, None] + steps[None, :]
    # A padding row sees what its position would (finite, never all-masked); its output is dropped.
    visible = (columns[None, None, :] <= positions[:, :, None])[:, None]
    return _Group(block_ids, num_seqs, width * block_size, visible, tokens.clamp(max=num_tokens - 1).flatten(),
                  tokens[real], real, q_len)


def _attend_group(query: Tensor, k_cache: Tensor, v_cache: Tensor, group: _Group, scale: float,
                  dtype: torch.dtype) -> Tensor:
    """One attention call as `group` plans it, over K/V and queries in `dtype`: the rows `group.write_rows`
    of the output, [rows, num_heads, head_dim] in `dtype`."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    keys, values = _batched_pages(k_cache, v_cache, group)
    if keys.dtype != dtype:
        keys, values = keys.to(dtype), values.to(dtype)
    gathered = query if group.in_order else query.index_select(0, group.read_rows)
    if gathered.dtype != dtype:
        gathered = gathered.to(dtype)
    if group.real is None:
        # Query heads of one KV head are adjacent: view them as that head's rows (no copy of K/V per head).
        grouped = gathered.view(group.num_seqs, k_cache.shape[2], -1, head_dim)
        attended = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=group.visible, scale=scale)
        return attended.reshape(group.num_seqs, num_heads, head_dim)
    padded = gathered.view(group.num_seqs, group.q_len, num_heads, head_dim).transpose(1, 2)
    attended = F.scaled_dot_product_attention(padded, keys, values, attn_mask=group.visible, scale=scale,
                                              enable_gqa=True)
    return attended.transpose(1, 2)[group.real]


def _batched_pages(k_cache: Tensor, v_cache: Tensor, group: _Group) -> tuple[Tensor, Tensor]:
    """The group's blocks of both caches, each [num_seqs, num_kv_heads, length, head_dim] (the first `length`
    slots of a sequence's blocks), in the cache's dtype."""
    pair = _cache_pair(k_cache, v_cache)
    if pair is None:
        keys, values = (_gathered(cache.view(1, cache.shape[0], -1), k_cache.shape, group)[0]
                        for cache in (k_cache, v_cache))
        return keys, values
    keys, values = _gathered(pair, k_cache.shape, group).unbind(0)  # the engine's V follows its K: one gather
    return keys, values


def _cache_pair(k_cache: Tensor, v_cache: Tensor) -> Tensor | None:
    """k_cache and v_cache as one [2, num_blocks, block elements] view where v_cache is the block of memory right
    after k_cache (a layer's caches in the engine's KV tensor); None otherwise. Both are contiguous and alike
    (validated)."""
    size = k_cache.numel()
    if (v_cache.data_ptr() != k_cache.data_ptr() + size * k_cache.element_size()
            or v_cache.untyped_storage().data_ptr() != k_cache.untyped_storage().data_ptr()):
        return None
    block = k_cache.stride(0)
    return k_cache.as_strided((2, k_cache.shape[0], block), (size, block, 1))


def _gathered(caches: Tensor, cache_shape: torch.Size, group: _Group) -> Tensor:
    """The group's blocks of each of caches [n, num_blocks, block elements] (caches of `cache_shape`), as
    [n, num_seqs, num_kv_heads, length, head_dim]."""
    # Rows of a block-per-row view: index_select copies each whole block at once (several times faster than on
    # the 5-D view).
    pages = caches.index_select(1, group.block_ids).view(caches.shape[0], group.num_seqs, -1, *cache_shape[2:])
    if pages.shape[2] != group.length:
        pages = pages[:, :, : group.length]
    return pages.transpose(2, 3)


def paged_attention_per_sequence(query: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                                 context_lens: Tensor, cu_seqlens_q: Tensor, max_seqlen_q: int, scale: float) -> Tensor:
    """`paged_attention` one sequence at a time, each over exactly its context: the test oracle.

    Its blocks are gathered with one `index_select` into exactly its context length, and a decode token
    needs no mask at all: the plainest statement of what the batched kernel must compute.
    """
    out = torch.empty_like(query)
    if query.shape[0] == 0:
        return out
    offsets = cu_seqlens_q.tolist()
    contexts = context_lens.tolist()
    block_size = k_cache.shape[1]
    for seq, context_len in enumerate(contexts):
        start, end = offsets[seq], offsets[seq + 1]
        if end == start:
            continue
        ids = block_tables[seq, : (context_len + block_size - 1) // block_size].to(torch.int64)
        keys = _pages(k_cache, ids, context_len)
        values = _pages(v_cache, ids, context_len)
        out[start:end] = _attend(query[start:end], keys, values, scale).to(query.dtype)
    return out


def _pages(cache: Tensor, block_ids: Tensor, length: int) -> Tensor:
    """The first `length` slots of the listed blocks as [num_kv_heads, length, head_dim] in float32."""
    pages = cache.index_select(0, block_ids).view(-1, cache.shape[2], cache.shape[3])[:length]
    return pages.transpose(0, 1).float()


def _attend(queries: Tensor, keys: Tensor, values: Tensor, scale: float) -> Tensor:
    """queries [q_len, heads, dim] are the last q_len positions of the context in keys/values [kv_heads, L, dim]."""
    q_len, num_heads, head_dim = queries.shape
    num_kv_heads, context_len = keys.shape[0], keys.shape[1]
    if q_len == 1:
        # Query heads h of one KV head are adjacent: view them as that head's rows. Everything is visible.
        grouped = queries.float().view(num_kv_heads, num_heads // num_kv_heads, head_dim)
        out = F.scaled_dot_product_attention(grouped, keys, values, scale=scale)
        return out.reshape(1, num_heads, head_dim)
    query_positions = torch.arange(context_len - q_len, context_len, device=queries.device)
    visible = torch.arange(context_len, device=queries.device)[None, :] <= query_positions[:, None]
    batched = queries.float().transpose(0, 1)  # [heads, q_len, dim]
    out = F.scaled_dot_product_attention(batched, keys, values, attn_mask=visible, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)


def rms_norm(hidden: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dimension: normalised in float32, rounded to the input dtype, times the weight."""
    # torch's rms_norm without a weight computes x * rsqrt(mean(x^2) + eps) in float32 and rounds it to x's
    # dtype, bit for bit the op-by-op formula (test_kernels_layers checks it against transformers' module),
    # in one call instead of seven; the weight multiplies after the rounding, as transformers does.
    # (torch.rms_norm is what F.rms_norm calls, less its Python wrapper: 25 calls a decode step.)
    return weight * torch.rms_norm(hidden, hidden.shape[-1:], eps=eps)


def add_rms_norm(hidden: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(RMSNorm of residual + hidden, residual + hidden): the new residual stream comes back with its norm."""
    new_residual = residual + hidden
    return rms_norm(new_residual, weight, eps), new_residual


def silu_and_mul(gate_up: Tensor) -> Tensor:
    """silu(gate) * up, where gate and up are the two halves of the last dimension."""
    width = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :width]).mul_(gate_up[..., width:])


def rotary_embedding(
    positions: Tensor, query: Tensor, key: Tensor, cos_cache: Tensor, sin_cache: Tensor, inplace: bool
) -> tuple[Tensor, Tensor]:
    """Rotate-half rotary embedding of query [tokens, heads, dim] and key [tokens, kv_heads, dim].

    cos_cache/sin_cache: [max_positions, dim / 2], rounded to the query dtype before use. With `inplace`,
    query and key are overwritten and returned; otherwise new tensors come back. The step's rows of the
    caches are the same in every layer: inside `kernels.per_forward.one_forward()` the first layer's are kept.
    """
    key_rows = ("rotary rows", id(positions), id(cos_cache), id(sin_cache), query.dtype)
    cos, sin = per_forward.once(key_rows, lambda: _rotary_rows(positions, cos_cache, sin_cache, query.dtype))
    both = _side_by_side(query, key)
    if both is None:
        return _rotate(query, cos, sin, inplace), _rotate(key, cos, sin, inplace)
    # The decoder's query and key are neighbouring views of its one projection: rotated as one tensor, half
    # the launches (each head's values are computed exactly as apart).
    rotated = _rotate(both, cos, sin, inplace)
    if inplace:
        return query, key
    return rotated[:, : query.shape[1]], rotated[:, query.shape[1] :]


def _side_by_side(query: Tensor, key: Tensor) -> Tensor | None:
    """query and key as one [tokens, heads + kv_heads, dim] view where key's heads follow query's in memory,
    row by row, without overlapping the next row (the merged projection's q and k); None otherwise."""
    heads, head_dim = query.shape[1], query.shape[2]
    stride = query.stride()
    if (key.stride() != stride or stride[1] != head_dim or stride[0] < (heads + key.shape[1]) * head_dim
            or key.data_ptr() != query.data_ptr() + heads * head_dim * query.element_size()
            or key.untyped_storage().data_ptr() != query.untyped_storage().data_ptr()):
        return None
    return query.as_strided((query.shape[0], heads + key.shape[1], head_dim), stride)


def _rotary_rows(positions: Tensor, cos_cache: Tensor, sin_cache: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The positions' cos and sin at full head width, the sine's second half negated: rounded to `dtype` first,
    as Hugging Face rounds them, then widened, which is exact."""
    cos = cos_cache[positions].to(dtype)
    sin = sin_cache[positions].to(dtype)
    return torch.cat((cos, cos), dim=-1).unsqueeze(1), torch.cat((sin, -sin), dim=-1).unsqueeze(1)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, inplace: bool) -> Tensor:
    """x * cos + rotate_half(x) * sin as Hugging Face computes it, rounding alike, in four ops and no copy of x:
    rotate_half(x) * sin is (-x2 * s, x1 * s), which is exactly x * (s, -s) = (x1 * s, -x2 * s) with its halves
    swapped (rolled by half the width), added to x * cos (`sin` holds (s, -s))."""
    swapped = (x * sin).roll(x.shape[-1] // 2, -1)
    return (x.mul_(cos) if inplace else x * cos).add_(swapped)
