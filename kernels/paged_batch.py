"""Synthetic paged-attention batches with random data, for the kernels' tests and benchmarks.

Builds what the engine would hand to `paged_attention`: a KV cache whose pages are scattered in random
order, block tables padded with -1, context lengths and query offsets. Entries past a sequence's context
may be filled with a stale id, as an engine that reuses table rows could leave them, to prove the kernels
never read them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True, slots=True)
class PagedBatch:
    """One `paged_attention` call's inputs (the cache already holds every context token)."""

    query: Tensor
    k_cache: Tensor
    v_cache: Tensor
    block_tables: Tensor
    context_lens: Tensor
    cu_seqlens_q: Tensor
    max_seqlen_q: int
    scale: float

    def args(self) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, int, float]:
        """Positional arguments for `kernels.paged_attention`."""
        return (self.query, self.k_cache, self.v_cache, self.block_tables, self.context_lens,
                self.cu_seqlens_q, self.max_seqlen_q, self.scale)


def build_paged_batch(
    context_lens: Sequence[int],
    query_lens: Sequence[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    spare_blocks: int = 2,
    spare_table_columns: int = 1,
    stale_id: int | None = None,
    generator: torch.Generator | None = None,
) -> PagedBatch:
    """A batch whose sequence s has context_lens[s] cached tokens, the last query_lens[s] of them new.

    Pages are assigned in a random order out of a cache with `spare_blocks` unused blocks; tables get
    `spare_table_columns` extra columns, filled with `stale_id` (or -1 when None). Data is drawn on
    `device`, from `generator` when given (which must live on that device).
    """
    device = torch.device(device)
    blocks_per_seq = [-(-context // block_size) for context in context_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    order = torch.randperm(num_blocks, generator=generator, device=device).tolist()
    width = max(blocks_per_seq, default=0) + spare_table_columns
    tables = torch.full((len(context_lens), width), -1 if stale_id is None else stale_id, dtype=torch.int32)
    next_block = 0
    for seq, count in enumerate(blocks_per_seq):
        tables[seq, :count] = torch.tensor(order[next_block : next_block + count], dtype=torch.int32)
        next_block += count
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=generator, device=device, dtype=dtype)
    v_cache = torch.randn(cache_shape, generator=generator, device=device, dtype=dtype)
    offsets = [0]
    for query_len in query_lens:
        offsets.append(offsets[-1] + query_len)
    query = torch.randn((offsets[-1], num_heads, head_dim), generator=generator, device=device, dtype=dtype)
    return PagedBatch(
        query=query, k_cache=k_cache, v_cache=v_cache,
        block_tables=tables.to(device),
        context_lens=torch.tensor(list(context_lens), dtype=torch.int32, device=device),
        cu_seqlens_q=torch.tensor(offsets, dtype=torch.int32, device=device),
        max_seqlen_q=max(query_lens, default=0), scale=head_dim**-0.5,
    )
