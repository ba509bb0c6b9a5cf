"""Triton kernels: paged attention over the KV cache, grouped-query heads packed so one K/V load serves a group.

Decode (one new token per sequence) splits each context into partitions (split-K): a program per
(sequence, kv head, partition) computes an unnormalised partial result and its log-sum-exp terms, and a
small merge kernel combines the partitions. Long contexts thus spread over the whole GPU even at small
batch. When one partition covers every context the program normalises and writes the output itself.

Prefill and chunked prefill (many new tokens after a cached context) use one program per (sequence, kv
head, tile of new tokens), causal within the new tokens and full over the context before them.

Both walk the cache a tile of token positions at a time and find each position's page through the block
table, so any block size works and table entries past a sequence's context are never read. Softmax runs in
base 2 with float32 accumulation; scores are masked with -inf, never by branching.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

# Positions per tile. On a GPU a 64-token tile keeps enough K/V loads in flight; in the interpreter (CPU
# tests) smaller tiles and partitions make small contexts exercise the multi-tile and split-K paths.
GPU_TILE, CPU_TILE = 64, 16
GPU_MIN_PARTITION, CPU_MIN_PARTITION = 512, 16
CPU_COMPUTE_UNITS = 4  # the interpreter's stand-in for a GPU's streaming multiprocessors
MAX_SPLITS = 64
PREFILL_ROWS = 64  # query rows (new tokens x heads of a group) per prefill program
LOG2_E = 1.4426950408889634


@triton.jit
def _load_tile(cache_ptr, table_row_ptr, positions, in_range, kv_head, dims, num_blocks,
               BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Rows [positions, kv_head, :] of a paged cache; positions outside in_range (or bad ids) load as 0."""
    block_ids = tl.load(table_row_ptr + positions // BLOCK_SIZE, mask=in_range, other=0).to(tl.int64)
    valid = in_range & (block_ids >= 0) & (block_ids < num_blocks)
    slots = block_ids * BLOCK_SIZE + positions % BLOCK_SIZE
    offsets = (slots * NUM_KV_HEADS + kv_head) * HEAD_DIM
    mask = valid[:, None] & (dims[None, :] < HEAD_DIM)
    return tl.load(cache_ptr + offsets[:, None] + dims[None, :], mask=mask, other=0.0)


# Reductions go through tl.reduce with Triton's own combine functions rather than tl.max / tl.sum (and
# tl.full replaces tl.zeros): the same code when compiled, and the interpreter then runs them even when
# `triton` itself was imported before TRITON_INTERPRET was set (as importing transformers' models does).
@triton.jit
def _max(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._elementwise_max)


@triton.jit
def _sum(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._sum_combine)


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b accumulated in float32. UPCAST multiplies in float32: the interpreter cannot multiply bfloat16."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _decode_kernel(
    query_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, cu_seqlens_ptr,
    out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr,
    scale_log2, num_blocks, partition_size,
    query_token_stride, query_head_stride, out_token_stride, out_head_stride, table_stride,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    token = tl.load(cu_seqlens_ptr + seq)
    if tl.load(cu_seqlens_ptr + seq + 1) == token:
        return  # no new token for this sequence in this step
    context_len = tl.load(context_lens_ptr + seq)
    start = split * partition_size
    end = tl.minimum(start + partition_size, context_len)

    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, DIM_PAD)
    heads = kv_head * GROUP + rows
    row_mask = (rows[:, None] < GROUP) & (dims[None, :] < HEAD_DIM)
    q_offsets = token.to(tl.int64) * query_token_stride + heads[:, None] * query_head_stride + dims[None, :]
    q = tl.load(query_ptr + q_offsets, mask=row_mask, other=0.0)

    table_row_ptr = block_tables_ptr + seq.to(tl.int64) * table_stride
    running_max = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    running_sum = tl.full([GROUP_PAD], 0.0, dtype=tl.float32)
    acc = tl.full([GROUP_PAD, DIM_PAD], 0.0, dtype=tl.float32)
    for tile_start in range(start, end, TILE):
        positions = tile_start + tl.arange(0, TILE)
        in_range = positions < end
        k = _load_tile(k_cache_ptr, table_row_ptr, positions, in_range, kv_head, dims, num_blocks,
                       BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        scores = _dot(q, tl.trans(k), PRECISION, UPCAST) * scale_log2
        scores = tl.where(in_range[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, _max(scores, 1))
        probs = tl.exp2(scores - new_max[:, None])
        rescale = tl.exp2(running_max - new_max)
        running_sum = running_sum * rescale + _sum(probs, 1)
        v = _load_tile(v_cache_ptr, table_row_ptr, positions, in_range, kv_head, dims, num_blocks,
                       BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        acc = acc * rescale[:, None] + _dot(probs.to(v.dtype), v, PRECISION, UPCAST)
        running_max = new_max

    if NUM_SPLITS == 1:
        out = acc / running_sum[:, None]
        out_offsets = token.to(tl.int64) * out_token_stride + heads[:, None] * out_head_stride + dims[None, :]
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=row_mask)
    else:
        part_rows = (token.to(tl.int64) * (NUM_KV_HEADS * GROUP) + heads) * NUM_SPLITS + split
        tl.store(part_max_ptr + part_rows, running_max, mask=rows < GROUP)
        tl.store(part_sum_ptr + part_rows, running_sum, mask=rows < GROUP)
        tl.store(part_out_ptr + part_rows[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_mask)


@triton.jit
def _merge_kernel(
    out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, out_token_stride, out_head_stride,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    """Combine the partitions of one (token, head): weights 2^(max_i - max) rescale each partial sum."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, DIM_PAD)
    part_rows = (token.to(tl.int64) * NUM_HEADS + head) * NUM_SPLITS + splits
    present = splits < NUM_SPLITS
    maxes = tl.load(part_max_ptr + part_rows, mask=present, other=float("-inf"))
    sums = tl.load(part_sum_ptr + part_rows, mask=present, other=0.0)
    weights = tl.exp2(maxes - _max(maxes, 0))  # empty partitions have max -inf: weight 0
    mask = present[:, None] & (dims[None, :] < HEAD_DIM)
    partial = tl.load(part_out_ptr + part_rows[:, None] * HEAD_DIM + dims[None, :], mask=mask, other=0.0)
    out = _sum(partial * weights[:, None], 0) / _sum(sums * weights, 0)
    out_offsets = token.to(tl.int64) * out_token_stride + head * out_head_stride + dims
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


@triton.jit
def _prefill_kernel(
    query_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, cu_seqlens_ptr, out_ptr,
    scale_log2, num_blocks,
    query_token_stride, query_head_stride, out_token_stride, out_head_stride, table_stride,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, QUERY_TILE: tl.constexpr, ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    query_tile = tl.program_id(2)
    first_token = tl.load(cu_seqlens_ptr + seq)
    q_len = tl.load(cu_seqlens_ptr + seq + 1) - first_token
    if query_tile * QUERY_TILE >= q_len:
        return
    context_len = tl.load(context_lens_ptr + seq)

    # Row r holds new token query_tile * QUERY_TILE + r // GROUP, query head kv_head * GROUP + r % GROUP.
    rows = tl.arange(0, ROWS)
    dims = tl.arange(0, DIM_PAD)
    q_index = query_tile * QUERY_TILE + rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    row_valid = (rows < QUERY_TILE * GROUP) & (q_index < q_len)
    q_positions = context_len - q_len + q_index
    row_mask = row_valid[:, None] & (dims[None, :] < HEAD_DIM)
    tokens = (first_token + q_index).to(tl.int64)
    q = tl.load(query_ptr + tokens[:, None] * query_token_stride + heads[:, None] * query_head_stride + dims[None, :],
                mask=row_mask, other=0.0)

    kv_end = tl.minimum(context_len, context_len - q_len + (query_tile + 1) * QUERY_TILE)
    table_row_ptr = block_tables_ptr + seq.to(tl.int64) * table_stride
    running_max = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    running_sum = tl.full([ROWS], 0.0, dtype=tl.float32)
    acc = tl.full([ROWS, DIM_PAD], 0.0, dtype=tl.float32)
    for tile_start in range(0, kv_end, TILE):
        positions = tile_start + tl.arange(0, TILE)
        in_range = positions < kv_end
        k = _load_tile(k_cache_ptr, table_row_ptr, positions, in_range, kv_head, dims, num_blocks,
                       BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        scores = _dot(q, tl.trans(k), PRECISION, UPCAST) * scale_log2
        visible = in_range[None, :] & (positions[None, :] <= q_positions[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(running_max, _max(scores, 1))
        probs = tl.exp2(scores - new_max[:, None])
        rescale = tl.exp2(running_max - new_max)
        running_sum = running_sum * rescale + _sum(probs, 1)
        v = _load_tile(v_cache_ptr, table_row_ptr, positions, in_range, kv_head, dims, num_blocks,
                       BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        acc = acc * rescale[:, None] + _dot(probs.to(v.dtype), v, PRECISION, UPCAST)
        running_max = new_max

    out = acc / running_sum[:, None]
    tl.store(out_ptr + tokens[:, None] * out_token_stride + heads[:, None] * out_head_stride + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask)


def decode_plan(num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device) -> tuple[int, int]:
    """(num_splits, partition_size) for decode over contexts of at most max_context tokens.

    max_context is the block tables' capacity, an upper bound known on the host without a device sync (so
    the plan, like the grid, depends on shapes only and decode can be captured in a CUDA graph); partitions
    past a sequence's context exit at once.
    """
    tile, min_partition = (GPU_TILE, GPU_MIN_PARTITION) if device.type == "cuda" else (CPU_TILE, CPU_MIN_PARTITION)
    most = max(1, min(MAX_SPLITS, triton.cdiv(max_context, min_partition)))
    splits = balanced_splits(max(1, num_seqs * num_kv_heads), _compute_units(device), most)
    partition = triton.cdiv(triton.cdiv(max_context, splits), tile) * tile
    return triton.cdiv(max_context, partition), partition


def balanced_splits(programs_per_split: int, units: int, most: int) -> int:
    """The fewest splits giving every compute unit at least two programs, spread within 10% of evenly.

    Decode is bandwidth-bound and its programs are of equal length, so the unit with the most programs
    sets the time: with p programs on u units, work is balanced to (p / u) / ceil(p / u). If no split count
    up to `most` fills the device, take the best-balanced one that does, else the most parallel one.
    """
    best, best_balance = most, 0.0
    for splits in range(1, most + 1):
        programs = programs_per_split * splits
        if programs < 2 * units:
            continue
        balance = (programs / units) / -(-programs // units)
        if balance >= 0.9:
            return splits
        if balance > best_balance:
            best, best_balance = splits, balance
    return best


def _compute_units(device: torch.device) -> int:
    if device.type != "cuda":
        return CPU_COMPUTE_UNITS
    return _multiprocessor_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _multiprocessor_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _precision(dtype: torch.dtype) -> str:
    # float32 caches get exact float32 products; tf32 would drift from the reference beyond its tolerance.
    return "ieee" if dtype == torch.float32 else "tf32"


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
    """Triton `paged_attention`; arguments already validated by `kernels.dispatch`."""
    out = torch.empty_like(query)
    if query.shape[0] == 0 or context_lens.shape[0] == 0:
        return out
    if query.stride(-1) != 1:
        query = query.contiguous()
    # The kernels index these by pointer + position: unit strides are required (a no-op when already so,
    # which keeps CUDA-graph captured buffers in place).
    block_tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    context_lens, cu_seqlens_q = context_lens.contiguous(), cu_seqlens_q.contiguous()
    run = _decode if max_seqlen_q == 1 else _prefill
    run(query, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, max_seqlen_q, scale, out)
    return out


def _shape_constants(query: Tensor, k_cache: Tensor) -> dict[str, object]:
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    return dict(
        NUM_KV_HEADS=num_kv_heads, GROUP=query.shape[1] // num_kv_heads, HEAD_DIM=head_dim,
        DIM_PAD=max(16, triton.next_power_of_2(head_dim)), BLOCK_SIZE=k_cache.shape[1],
        TILE=GPU_TILE if query.is_cuda else CPU_TILE, PRECISION=_precision(query.dtype),
        UPCAST=query.dtype == torch.bfloat16 and not query.is_cuda,
    )


def _decode(query: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, context_lens: Tensor,
            cu_seqlens_q: Tensor, max_seqlen_q: int, scale: float, out: Tensor) -> None:
    constants = _shape_constants(query, k_cache)
    num_seqs, num_heads = context_lens.shape[0], query.shape[1]
    max_context = block_tables.shape[1] * k_cache.shape[1]
    num_splits, partition = decode_plan(num_seqs, k_cache.shape[2], max_context, query.device)
    part_shape = (query.shape[0], num_heads, num_splits) if num_splits > 1 else (1, 1, 1)
    part_out = query.new_empty((*part_shape, k_cache.shape[3]), dtype=torch.float32)
    part_max = query.new_empty(part_shape, dtype=torch.float32)
    part_sum = query.new_empty(part_shape, dtype=torch.float32)
    _decode_kernel[(num_seqs, k_cache.shape[2], num_splits)](
        query, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, out, part_out, part_max, part_sum,
        scale * LOG2_E, k_cache.shape[0], partition,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        GROUP_PAD=max(16, triton.next_power_of_2(constants["GROUP"])), NUM_SPLITS=num_splits, **constants,
    )
    if num_splits > 1:
        _merge_kernel[(query.shape[0], num_heads)](
            out, part_out, part_max, part_sum, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=constants["HEAD_DIM"], DIM_PAD=constants["DIM_PAD"],
            NUM_SPLITS=num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits),
        )


def _prefill(query: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, context_lens: Tensor,
             cu_seqlens_q: Tensor, max_seqlen_q: int, scale: float, out: Tensor) -> None:
    constants = _shape_constants(query, k_cache)
    rows = max(PREFILL_ROWS, triton.next_power_of_2(constants["GROUP"]))
    query_tile = rows // constants["GROUP"]
    grid = (context_lens.shape[0], k_cache.shape[2], triton.cdiv(max_seqlen_q, query_tile))
    _prefill_kernel[grid](
        query, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, out,
        scale * LOG2_E, k_cache.shape[0],
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        QUERY_TILE=query_tile, ROWS=rows, **constants,
    )
