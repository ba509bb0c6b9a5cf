"""The one dispatch point for the kernels: validate, then run Triton or the torch reference.

KV path: `store_kv`, `paged_attention`, `zero_blocks`, and the residue check (`find_residue`, `count_residue`,
`residue_flags`). Layers: `rms_norm`, `add_rms_norm`,
`silu_and_mul`, `rotary_embedding`.

Backend choice, first match wins:
1. `force("triton" | "reference" | "native")`, a context manager for tests and tools;
2. the environment variable `VEIL_KERNELS=triton|reference|native` (read at each call; once per forward inside
   `kernels.one_forward()`);
3. the tensors' device: Triton on CUDA; on a CPU with AVX-512 BF16 `native`, elsewhere the reference.

`native` is the reference for every kernel here but `paged_attention`, which it runs compiled over bf16 and
float32 caches (`kernels.cpu_decode.paged_attention`: every new token read in place, where the reference
gathers and pads), plus the decoder's compiled batch-1 decode forward (`kernels.cpu_decode`), which the model
runs in place of its eager layers where it covers the step.

Triton on a CPU runs only in the Triton interpreter, so `TRITON_INTERPRET=1` must be set before the first
Triton call; the Triton modules are imported lazily on that call, which is when Triton reads the variable.
Validation runs before either backend, so both raise the same `KernelInputError`
(what is checked where, and why some value checks are skipped on CUDA: `kernels.validation`).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from kernels import cpu_decode, per_forward, reference, validation
from kernels.errors import KernelBackendError

BACKENDS = ("triton", "reference", "native")
_forced_backend: ContextVar[str | None] = ContextVar("veil_kernels_forced_backend", default=None)


@contextmanager
def force(backend: str) -> Iterator[None]:
    """Run the kernels called inside the block on `backend` ("triton" or "reference")."""
    _check_backend_name(backend, "force()")
    token = _forced_backend.set(backend)
    try:
        yield
    finally:
        _forced_backend.reset(token)


def selected_backend(device: torch.device) -> str:
    """The backend a kernel call on tensors of `device` would use now."""
    forced = _forced_backend.get()
    if forced is not None:
        return forced
    # Read at each call, but once per forward inside `kernels.one_forward()` (a layer's several kernels alike).
    from_env = per_forward.once("VEIL_KERNELS", _backend_from_env)
    if from_env:
        _check_backend_name(from_env, "VEIL_KERNELS")
        return from_env
    if device.type == "cuda":
        return "triton"
    return "native" if cpu_decode.supported_cpu() else "reference"


def runs_native_decode(device: torch.device) -> bool:
    """Whether a batch-1 decode forward on `device` runs the compiled CPU forward (`kernels.cpu_decode`): the
    backend is `native` and the library is built (compiled on the first call). Where it cannot be built, the
    default falls back to the eager forward, and an explicitly chosen `native` is refused."""
    if device.type != "cpu" or selected_backend(device) != "native":
        return False
    built = cpu_decode.build()
    if built.library is not None:
        return True
    if _forced_backend.get() == "native" or _backend_from_env() == "native":
        raise KernelBackendError(f"the native CPU decode is not available: {built.reason}")
    return False


def _backend_from_env() -> str:
    return os.environ.get("VEIL_KERNELS", "").strip().lower()


def _check_backend_name(name: str, source: str) -> None:
    if name not in BACKENDS:
        raise KernelBackendError(f"{source} names an unknown kernel backend; use one of {', '.join(BACKENDS)}")


def _triton_module(name: str, device: torch.device) -> ModuleType:
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "") not in ("1", "true", "True"):
        raise KernelBackendError(
            f"Triton kernels need a CUDA device; on {device.type} set TRITON_INTERPRET=1 before the first "
            "kernel call to run them in the Triton interpreter, or use the reference backend"
        )
    return importlib.import_module(f"kernels.triton_{name}")


def _implementation(kernel: str, module: str, device: torch.device) -> Any:
    """The function `kernel` of the backend selected for `device`: from `kernels.triton_<module>` or the reference."""
    if selected_backend(device) == "triton":
        return getattr(_triton_module(module, device), kernel)
    return getattr(reference, kernel)


def store_kv(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Write the new tokens' K and V into their cache slots.

    key/value: [num_tokens, num_kv_heads, head_dim]; k_cache/v_cache: [num_blocks, block_size, num_kv_heads,
    head_dim], one layer's views of the engine's KV tensor; slot_mapping: int32 or int64 [num_tokens] with
    slot = block_id * block_size + offset, and -1 to skip the token (padding).
    """
    per_forward.check_once(("store_kv", id(slot_mapping), _layout(key, value, k_cache, v_cache)),
                           validation.check_store_kv, key, value, k_cache, v_cache, slot_mapping)
    if key.shape[0] == 0:
        return
    if selected_backend(k_cache.device) == "triton":
        _triton_module("store_kv", k_cache.device).store_kv(key, value, k_cache, v_cache, slot_mapping)
    else:
        reference.store_kv(key, value, k_cache, v_cache, slot_mapping)


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
    """Attention of the new query tokens against their sequences' paged K/V cache.

    query: [num_q_tokens, num_heads, head_dim], the new tokens of all sequences concatenated;
    cu_seqlens_q: int32 [num_seqs + 1] offsets into query; block_tables: int32 [num_seqs, max_blocks_per_seq],
    padded with -1 (entries past ceil(context_len / block_size) are never dereferenced);
    context_lens: int32 [num_seqs], tokens of each sequence now in the cache INCLUDING the new ones.
    Query token j of sequence s (q_len = cu[s+1] - cu[s]) sits at position context_lens[s] - q_len + j and
    attends to cache positions 0..that position inclusive. Query head h uses kv head h // (num_heads //
    num_kv_heads). Returns [num_q_tokens, num_heads, head_dim] in query's dtype, accumulated in float32.
    """
    per_forward.check_once(("paged_attention", id(block_tables), id(context_lens), id(cu_seqlens_q), max_seqlen_q,
                            _layout(query, k_cache, v_cache)),
                           validation.check_paged_attention, query, k_cache, v_cache, block_tables, context_lens,
                           cu_seqlens_q, max_seqlen_q)
    args = (query, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, max_seqlen_q, float(scale))
    if selected_backend(query.device) == "triton":
        return _triton_module("paged_attention", query.device).paged_attention(*args)
    if cpu_decode.covers_attention(*args[:6]) and runs_native_decode(query.device):
        return cpu_decode.paged_attention(*args)  # read in place: no gathered copy, no padding, no mask
    return reference.paged_attention(*args)


# The KV path's and rotary's checks run once per forward inside `kernels.one_forward()` (`per_forward.check_once`):
# the layers after the first pass the same step metadata and caches of positions (the same tensors, unchanged
# for the forward: the key holds their ids) and their own tensors laid out alike (`_layout`), so the first
# layer's checks, which read the metadata's values, hold for them too.


def _layout(*tensors: Tensor) -> tuple:
    """What the checks read of a tensor besides the metadata's values: shape, strides, dtype, device."""
    return tuple([(tensor.shape, tensor.stride(), tensor.dtype, tensor.device) for tensor in tensors])


def zero_blocks(kv_cache: Tensor, block_ids: Tensor | Sequence[int], *, ids_in_range: bool = False) -> None:
    """Zero every listed block in every cache of the engine's KV tensor, in one launch.

    kv_cache: the whole contiguous KV tensor [num_caches, num_blocks, block_size, num_kv_heads, head_dim]
    (cache 2*i is layer i's K, 2*i+1 its V). block_ids: int32/int64 tensor or a host sequence of ints;
    duplicates are harmless. Out-of-range ids raise `KernelInputError` before anything is written; checking
    ids that live on a CUDA device reads two numbers back (a crossing), so the engine checks its ids on the
    host before it uploads them and says so with `ids_in_range` (ids already on the cache's device).
    """
    validation.check_kv_tensor(kv_cache)
    ids = _ids_for(kv_cache, block_ids, ids_in_range)
    if ids.numel() == 0:
        return
    if selected_backend(kv_cache.device) == "triton":
        _triton_module("zero_blocks", kv_cache.device).zero_blocks(kv_cache, ids)
    else:
        reference.zero_blocks(kv_cache, ids)


def find_residue(kv_cache: Tensor, block_ids: Tensor | Sequence[int]) -> list[int]:
    """The ids among block_ids (first occurrence order) whose bytes are not all zero in some cache.

    The residue check for tests and the audit: a reduction over the listed blocks where they lie, reading back
    one flag per listed id (see `residue_flags`).
    """
    ids = _checked_block_ids(kv_cache, block_ids)
    if ids.numel() == 0:
        return []
    on_device = ids.to(kv_cache.device)
    dirty = _residue_flags(kv_cache, on_device).index_select(0, on_device).tolist()
    return list(dict.fromkeys(block_id for block_id, is_dirty in zip(ids.tolist(), dirty) if is_dirty))


def count_residue(kv_cache: Tensor, block_ids: Tensor | Sequence[int], *, ids_in_range: bool = False) -> Tensor:
    """How many distinct listed blocks hold any non-zero byte: a 0-d int64 tensor left on the cache's device,
    so a caller reads it only when it needs the number (the engine: in a step's download)."""
    return residue_flags(kv_cache, block_ids, ids_in_range=ids_in_range).sum()


def residue_flags(kv_cache: Tensor, block_ids: Tensor | Sequence[int], *, ids_in_range: bool = False) -> Tensor:
    """int32 [num_blocks] on the cache's device: 1 for each listed block with a non-zero byte (raw bits, so
    -0.0 counts) in any cache, 0 elsewhere. Computed where the blocks lie, never copying the listed set at
    once; on CUDA by a Triton kernel written apart from the zeroing kernel it checks. `ids_in_range`:
    as for `zero_blocks`."""
    validation.check_kv_tensor(kv_cache)
    return _residue_flags(kv_cache, _ids_for(kv_cache, block_ids, ids_in_range))


def _ids_for(kv_cache: Tensor, block_ids: Tensor | Sequence[int], ids_in_range: bool) -> Tensor:
    """The ids as an int64 tensor on the cache's device, range-checked unless the caller did so already."""
    ids = validation.as_block_id_tensor(block_ids)
    if ids_in_range and ids.device == kv_cache.device:
        return ids
    validation.check_block_ids(kv_cache, ids)
    return _upload(ids, kv_cache.device)


def _upload(ids: Tensor, device: torch.device) -> Tensor:
    """Host ids on device without waiting (kernel tests and tools; the engine's ids come through its bridge)."""
    if device.type == "cuda" and ids.device.type == "cpu":
        return ids.pin_memory().to(device, non_blocking=True)
    return ids.to(device)


def _residue_flags(kv_cache: Tensor, block_ids: Tensor) -> Tensor:
    flags = torch.zeros(kv_cache.shape[1], dtype=torch.int32, device=kv_cache.device)
    if block_ids.numel() > 0:
        _implementation("mark_residue", "find_residue", kv_cache.device)(kv_cache, block_ids, flags)
    return flags


def _checked_block_ids(kv_cache: Tensor, block_ids: Tensor | Sequence[int]) -> Tensor:
    validation.check_kv_tensor(kv_cache)
    ids = validation.as_block_id_tensor(block_ids)
    validation.check_block_ids(kv_cache, ids)
    return ids


def rms_norm(hidden: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dimension of hidden [..., width], times weight [width]; a new tensor.

    The mean square is taken in float32 and the normalised value rounded to hidden's dtype before the weight
    multiplies it, as Hugging Face's Llama does.
    """
    validation.check_rms_norm(hidden, weight)
    if hidden.numel() == 0:
        return torch.empty_like(hidden)
    return _implementation("rms_norm", "rms_norm", hidden.device)(hidden, weight, float(eps))


def add_rms_norm(hidden: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(rms_norm(residual + hidden), residual + hidden) in one pass: the decoder's residual add and the norm
    that follows it. Both come back as new tensors; the sum is rounded to hidden's dtype, as the decoder adds."""
    validation.check_rms_norm(hidden, weight, residual)
    if hidden.numel() == 0:
        return torch.empty_like(hidden), torch.empty_like(hidden)
    return _implementation("add_rms_norm", "rms_norm", hidden.device)(hidden, residual, weight, float(eps))


def silu_and_mul(gate_up: Tensor) -> Tensor:
    """silu(gate) * up for gate_up [..., 2 * width] holding gate then up (the stacked projection's output)."""
    validation.check_silu_and_mul(gate_up)
    if gate_up.numel() == 0:
        return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)
    return _implementation("silu_and_mul", "silu_and_mul", gate_up.device)(gate_up)


def rotary_embedding(
    positions: Tensor, query: Tensor, key: Tensor, cos_cache: Tensor, sin_cache: Tensor, inplace: bool = False
) -> tuple[Tensor, Tensor]:
    """Rotate-half (neox-style) rotary embedding of query [tokens, heads, dim] and key [tokens, kv_heads, dim].

    positions: int32/int64 [tokens]; cos_cache/sin_cache: [max_positions, dim / 2], precomputed with any
    frequency scaling (llama3) and rounded to the query dtype before use. query and key may be strided views
    (unit stride in dim). `inplace` overwrites and returns them; otherwise new tensors come back.
    """
    per_forward.check_once(("rotary_embedding", id(positions), id(cos_cache), id(sin_cache),
                            _layout(query, key)),
                           validation.check_rotary_embedding, positions, query, key, cos_cache, sin_cache)
    if query.shape[0] == 0:
        return (query, key) if inplace else (torch.empty_like(query), torch.empty_like(key))
    rotate = _implementation("rotary_embedding", "rotary", query.device)
    return rotate(positions, query, key, cos_cache, sin_cache, inplace)
