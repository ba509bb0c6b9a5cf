"""Input checks shared by both kernel backends, run before anything is launched or written.

Structural checks (ranks, shapes, dtypes, devices, contiguity) read only tensor metadata and cost nothing.
Value checks (slot and block-id ranges, sequence offsets) need the tensors' contents: they run when the
index tensors live on the CPU, where reading them is cheap. On CUDA they are skipped for `store_kv` and
`paged_attention`, because reading device memory from the host would stall the stream on every layer of
every step; there the Triton kernels mask out-of-range slots and block ids instead, so a bad index can
never write (or read) outside the cache. `zero_blocks` is the exception: its ids are always range-checked,
since an out-of-range id must be refused before anything is zeroed (one host sync per engine step, see
`check_block_ids`).
The layer kernels (RMSNorm, SiLU-and-mul, rotary embedding) follow the same rule: shapes and dtypes always,
positions only on the CPU; on CUDA the rotary kernel reads nothing for a position outside its caches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from kernels.errors import KernelInputError

CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SLOT_DTYPES = (torch.int32, torch.int64)


def _require(condition: bool, message: str | Callable[[], str]) -> None:
    """Raise KernelInputError unless condition holds; a callable message is only formatted on failure."""
    if not condition:
        raise KernelInputError(message() if callable(message) else message)


def _shape(tensor: Tensor) -> str:
    return "[" + ", ".join(str(size) for size in tensor.shape) + "]"


def _same_device(names_and_tensors: dict[str, Tensor]) -> None:
    devices = {name: tensor.device for name, tensor in names_and_tensors.items()}
    _require(
        len(set(devices.values())) == 1,
        lambda: "all tensors must be on one device; got "
        + ", ".join(f"{name} on {device}" for name, device in devices.items())
        + ": move them to the cache's device",
    )


def check_cache_pair(k_cache: Tensor, v_cache: Tensor) -> None:
    """k_cache and v_cache: contiguous [num_blocks, block_size, num_kv_heads, head_dim], same shape and dtype."""
    _require(k_cache.dim() == 4, lambda: f"k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got {_shape(k_cache)}")
    _require(v_cache.shape == k_cache.shape, lambda: f"v_cache shape {_shape(v_cache)} differs from k_cache {_shape(k_cache)}")
    _require(k_cache.dtype in CACHE_DTYPES, lambda: f"cache dtype must be float16, bfloat16 or float32, got {k_cache.dtype}")
    _require(v_cache.dtype == k_cache.dtype, lambda: f"v_cache dtype {v_cache.dtype} differs from k_cache {k_cache.dtype}")
    _require(
        k_cache.is_contiguous() and v_cache.is_contiguous(),
        "k_cache and v_cache must be contiguous (views of one layer of the engine's KV tensor)",
    )
    _require(k_cache.shape[0] > 0 and k_cache.shape[1] > 0, lambda: f"cache has no slots: {_shape(k_cache)}")


def check_store_kv(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Validate `store_kv`'s arguments (see `kernels.dispatch.store_kv`)."""
    check_cache_pair(k_cache, v_cache)
    _require(key.dim() == 3, lambda: f"key must be [num_tokens, num_kv_heads, head_dim], got {_shape(key)}")
    _require(value.shape == key.shape, lambda: f"value shape {_shape(value)} differs from key {_shape(key)}")
    _require(
        key.shape[1:] == k_cache.shape[2:],
        lambda: f"key heads/head_dim {_shape(key)} do not match the cache {_shape(k_cache)}",
    )
    _require(
        key.dtype == k_cache.dtype and value.dtype == k_cache.dtype,
        lambda: f"key/value dtypes {key.dtype}/{value.dtype} must equal the cache dtype {k_cache.dtype}",
    )
    _require(slot_mapping.dtype in SLOT_DTYPES, lambda: f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    _require(
        slot_mapping.dim() == 1 and slot_mapping.shape[0] == key.shape[0],
        lambda: f"slot_mapping must be [num_tokens={key.shape[0]}], got {_shape(slot_mapping)}",
    )
    _same_device({"key": key, "value": value, "k_cache": k_cache, "v_cache": v_cache, "slot_mapping": slot_mapping})
    if slot_mapping.device.type == "cpu" and slot_mapping.numel() > 0:
        num_slots = k_cache.shape[0] * k_cache.shape[1]
        low, high = (int(bound) for bound in torch.aminmax(slot_mapping))
        _require(
            low >= -1 and high < num_slots,
            lambda: f"slot_mapping holds slots outside [-1, {num_slots}) for a cache of {k_cache.shape[0]} blocks "
            f"of {k_cache.shape[1]}: slot = block_id * block_size + offset, -1 to skip",
        )


def check_paged_attention(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    cu_seqlens_q: Tensor,
    max_seqlen_q: int,
) -> None:
    """Validate `paged_attention`'s arguments (see `kernels.dispatch.paged_attention`)."""
    check_cache_pair(k_cache, v_cache)
    _require(query.dim() == 3, lambda: f"query must be [num_q_tokens, num_heads, head_dim], got {_shape(query)}")
    _require(query.dtype == k_cache.dtype, lambda: f"query dtype {query.dtype} must equal the cache dtype {k_cache.dtype}")
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    _require(head_dim == k_cache.shape[3], lambda: f"query head_dim {head_dim} differs from the cache's {k_cache.shape[3]}")
    _require(
        num_heads > 0 and num_heads % num_kv_heads == 0,
        lambda: f"num_heads {num_heads} must be a positive multiple of num_kv_heads {num_kv_heads}",
    )
    for name, tensor, rank in (("block_tables", block_tables, 2), ("context_lens", context_lens, 1), ("cu_seqlens_q", cu_seqlens_q, 1)):
        _require(tensor.dtype == torch.int32, lambda: f"{name} must be int32, got {tensor.dtype}")
        _require(tensor.dim() == rank, lambda: f"{name} must have {rank} dimension(s), got {_shape(tensor)}")
    num_seqs = context_lens.shape[0]
    _require(block_tables.shape[0] == num_seqs, lambda: f"block_tables has {block_tables.shape[0]} rows for {num_seqs} sequences")
    _require(cu_seqlens_q.shape[0] == num_seqs + 1, lambda: f"cu_seqlens_q must be [num_seqs + 1 = {num_seqs + 1}], got {_shape(cu_seqlens_q)}")
    _require(isinstance(max_seqlen_q, int) and max_seqlen_q >= 0, "max_seqlen_q must be a non-negative int")
    _same_device({"query": query, "k_cache": k_cache, "block_tables": block_tables,
                  "context_lens": context_lens, "cu_seqlens_q": cu_seqlens_q})
    if context_lens.device.type == "cpu":
        _check_sequence_values(query.shape[0], k_cache, block_tables, context_lens, cu_seqlens_q, max_seqlen_q)


def _check_sequence_values(
    num_q_tokens: int, k_cache: Tensor, block_tables: Tensor, context_lens: Tensor, cu_seqlens_q: Tensor, max_seqlen_q: int
) -> None:
    # Host lists: a handful of Python comparisons per sequence cost less than a dozen tiny tensor ops.
    num_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
    offsets, contexts = cu_seqlens_q.tolist(), context_lens.tolist()
    _require(offsets[0] == 0 and offsets[-1] == num_q_tokens,
             lambda: f"cu_seqlens_q must start at 0 and end at num_q_tokens = {num_q_tokens}")
    q_lens = [end - start for start, end in zip(offsets, offsets[1:])]
    if not q_lens:
        return
    _require(min(q_lens) >= 0, "cu_seqlens_q must be non-decreasing")
    _require(max(q_lens) <= max_seqlen_q, lambda: f"a sequence has more new tokens than max_seqlen_q = {max_seqlen_q}")
    _require(all(context >= q_len for context, q_len in zip(contexts, q_lens)),
             "context_lens must count the new tokens too (context_len >= new tokens of the sequence)")
    capacity = block_tables.shape[1] * block_size
    _require(max(contexts) <= capacity,
             lambda: f"a context is longer than block_tables can address ({block_tables.shape[1]} blocks of {block_size})")
    widest = -(-max(contexts) // block_size)
    used_blocks = torch.tensor([-(-context // block_size) for context in contexts])
    used = block_tables[:, :widest][torch.arange(widest)[None, :] < used_blocks[:, None]]
    if used.numel() > 0:
        low, high = (int(bound) for bound in torch.aminmax(used))
        _require(low >= 0 and high < num_blocks,
                 lambda: f"block_tables holds block ids outside [0, {num_blocks}) within a sequence's context")


def as_block_id_tensor(block_ids: Tensor | Sequence[int]) -> Tensor:
    """Block ids as a 1-D int64 tensor, left where they are (host sequences become host tensors)."""
    if not isinstance(block_ids, Tensor):
        _require(all(isinstance(block_id, int) for block_id in block_ids), "block_ids must be ints")
        return torch.tensor(list(block_ids), dtype=torch.int64)
    _require(block_ids.dtype in SLOT_DTYPES, lambda: f"block_ids must be int32 or int64, got {block_ids.dtype}")
    _require(block_ids.dim() == 1, lambda: f"block_ids must be 1-D, got {_shape(block_ids)}")
    return block_ids.to(torch.int64)


def check_kv_tensor(kv_cache: Tensor) -> None:
    """The engine's whole KV tensor: contiguous [num_caches, num_blocks, block_size, num_kv_heads, head_dim]."""
    _require(
        kv_cache.dim() == 5,
        lambda: f"kv_cache must be [num_caches, num_blocks, block_size, num_kv_heads, head_dim], got {_shape(kv_cache)}",
    )
    _require(kv_cache.dtype in CACHE_DTYPES, lambda: f"kv_cache dtype must be float16, bfloat16 or float32, got {kv_cache.dtype}")
    _require(kv_cache.is_contiguous(), "kv_cache must be contiguous (the engine's single KV tensor)")


def check_block_ids(kv_cache: Tensor, block_ids: Tensor) -> None:
    """Every id must name a block of the cache. Ids on CUDA are read back (two numbers, one sync per step)."""
    if block_ids.numel() == 0:
        return
    num_blocks = kv_cache.shape[1]
    low, high = (int(bound) for bound in torch.aminmax(block_ids))
    _require(low >= 0 and high < num_blocks, lambda: f"block ids must lie in [0, {num_blocks}); some do not: no block was touched")


# ----- layer kernels: RMSNorm, SiLU-and-mul, rotary embedding ---------------------------------------------

MAX_NORM_WIDTH = 1 << 16  # one Triton program holds a whole row


def check_rms_norm(hidden: Tensor, weight: Tensor, residual: Tensor | None = None) -> None:
    """Validate `rms_norm` / `add_rms_norm` (see `kernels.dispatch`)."""
    if _rms_norm_inputs_fit(hidden, weight, residual):
        return  # the common case, in one expression: run on every norm of every layer
    _explain_rms_norm(hidden, weight, residual)


def _rms_norm_inputs_fit(hidden: Tensor, weight: Tensor, residual: Tensor | None) -> bool:
    shape, dtype, device = hidden.shape, hidden.dtype, hidden.device
    return (len(shape) >= 1 and 0 < shape[-1] <= MAX_NORM_WIDTH and dtype in CACHE_DTYPES
            and weight.shape == shape[-1:] and weight.dtype == dtype and weight.device == device
            and (residual is None
                 or (residual.shape == shape and residual.dtype == dtype and residual.device == device)))


def _explain_rms_norm(hidden: Tensor, weight: Tensor, residual: Tensor | None) -> None:
    """The rule `_rms_norm_inputs_fit` found broken, by name."""
    _require(hidden.dim() >= 1 and 0 < hidden.shape[-1] <= MAX_NORM_WIDTH,
             lambda: f"hidden must be [..., width] with 0 < width <= {MAX_NORM_WIDTH}, got {_shape(hidden)}")
    _require(hidden.dtype in CACHE_DTYPES, lambda: f"hidden dtype must be float16, bfloat16 or float32, got {hidden.dtype}")
    _require(weight.shape == hidden.shape[-1:],
             lambda: f"weight must be [{hidden.shape[-1]}] (the normalised width), got {_shape(weight)}")
    _require(weight.dtype == hidden.dtype, lambda: f"weight dtype {weight.dtype} must equal hidden's {hidden.dtype}")
    tensors = {"hidden": hidden, "weight": weight}
    if residual is not None:
        _require(residual.shape == hidden.shape, lambda: f"residual shape {_shape(residual)} differs from hidden {_shape(hidden)}")
        _require(residual.dtype == hidden.dtype, lambda: f"residual dtype {residual.dtype} differs from hidden's {hidden.dtype}")
        tensors["residual"] = residual
    _same_device(tensors)


def check_silu_and_mul(gate_up: Tensor) -> None:
    """Validate `silu_and_mul` (see `kernels.dispatch`)."""
    _require(gate_up.dim() >= 1 and gate_up.shape[-1] > 0 and gate_up.shape[-1] % 2 == 0,
             lambda: f"gate_up must be [..., 2 * width] (gate then up), got {_shape(gate_up)}")
    _require(gate_up.dtype in CACHE_DTYPES, lambda: f"gate_up dtype must be float16, bfloat16 or float32, got {gate_up.dtype}")


def check_rotary_embedding(positions: Tensor, query: Tensor, key: Tensor, cos_cache: Tensor, sin_cache: Tensor) -> None:
    """Validate `rotary_embedding` (see `kernels.dispatch`)."""
    _require(query.dim() == 3, lambda: f"query must be [num_tokens, num_heads, head_dim], got {_shape(query)}")
    _require(key.dim() == 3 and key.shape[0] == query.shape[0] and key.shape[2] == query.shape[2],
             lambda: f"key must be [num_tokens, num_kv_heads, head_dim] like query {_shape(query)}, got {_shape(key)}")
    _require(query.shape[2] % 2 == 0, lambda: f"head_dim must be even to rotate halves, got {query.shape[2]}")
    _require(query.dtype in CACHE_DTYPES and key.dtype == query.dtype,
             lambda: f"query/key dtypes {query.dtype}/{key.dtype} must be one of float16, bfloat16, float32, and equal")
    _require(query.stride(-1) == 1 and key.stride(-1) == 1, "query and key must be contiguous in head_dim (stride 1)")
    half = query.shape[2] // 2
    _require(cos_cache.dim() == 2 and cos_cache.shape[1] == half and sin_cache.shape == cos_cache.shape,
             lambda: f"cos/sin caches must both be [max_positions, head_dim / 2 = {half}], got {_shape(cos_cache)} "
             f"and {_shape(sin_cache)}")
    _require(cos_cache.dtype in CACHE_DTYPES and sin_cache.dtype == cos_cache.dtype,
             lambda: f"cos/sin cache dtypes {cos_cache.dtype}/{sin_cache.dtype} must be one float dtype")
    _require(cos_cache.is_contiguous() and sin_cache.is_contiguous(), "cos/sin caches must be contiguous")
    _require(positions.dtype in SLOT_DTYPES and positions.shape == query.shape[:1],
             lambda: f"positions must be int32 or int64 [num_tokens = {query.shape[0]}], got {positions.dtype} {_shape(positions)}")
    _same_device({"positions": positions, "query": query, "key": key, "cos_cache": cos_cache, "sin_cache": sin_cache})
    if positions.device.type == "cpu" and positions.numel() > 0:
        low, high = (int(bound) for bound in torch.aminmax(positions))
        _require(low >= 0 and high < cos_cache.shape[0],
                 lambda: f"positions must lie in [0, {cos_cache.shape[0]}), the length of the cos/sin caches")
