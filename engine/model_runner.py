"""Owns the model and the KV tensor: builds one step's flat inputs, runs the model, zeroes blocks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels
from engine.config import EngineConfig
from engine.cuda_graphs import (
    DecodeGraphs,
    cuda_graphs_enabled,
    free_device_bytes,
    graph_batch_sizes,
    graph_memory_reserve,
    measure_graph_memory,
)
from engine.errors import EngineError
from engine.loader import load_model
from engine.models.layers import AttentionMetadata
from engine.overlap import fill_placeholders
from engine.scheduler import ScheduledChunk

_GIB = 1 << 30


@dataclass(slots=True)
class StepLists:
    """One step's flat inputs as host lists, built before anything is copied to the device."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    cu_seqlens_q: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]  # a row per sequence, padded with -1 to the widest
    sample_rows: list[int]
    max_seqlen_q: int

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # rows of the flat batch whose logits pick a token


class ModelRunner:
    def __init__(self, model_dir: str, config: EngineConfig) -> None:
        self.device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = None if config.dtype is None else _dtype(config.dtype)
        self.model = load_model(model_dir, dtype, self.device)
        self.model_config = self.model.config
        self.dtype = next(self.model.parameters()).dtype
        self.block_size = config.block_size
        max_model_len = min(config.max_model_len or 1 << 62, self.model_config.max_context)
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        # Decode steps of up to this many sequences replay a CUDA graph (none: every step runs eagerly).
        most_seqs = min(config.max_num_seqs, config.max_num_batched_tokens)
        self.graph_batch_sizes = graph_batch_sizes(most_seqs) if cuda_graphs_enabled(config, self.device) else []
        self.free_bytes_after_load = 0  # CUDA: device memory free once the weights are loaded
        self.memory_budget_bytes = 0  # CUDA: what the KV pool and the graphs may take together
        self.graph_reserve_bytes = 0  # kept out of the KV pool for the graphs, measured before it is sized
        self.graph_memory_bytes = 0  # what capturing the graphs took
        self.num_blocks = config.num_blocks or self._blocks_in_budget(config)
        if self.num_blocks < 1:
            raise EngineError("the KV budget holds no block; raise kv_cache_gib or gpu_memory_utilization")
        # One tensor for every layer's K and V: index 2*i is layer i's K, 2*i+1 its V. Allocated as zeros,
        # so blocks that were never used pass the residue check too.
        self.kv_cache = torch.zeros(self._kv_shape(self.num_blocks), dtype=self.dtype, device=self.device)
        self.graphs = self._capture_graphs() if self.graph_batch_sizes else None

    def _kv_shape(self, num_blocks: int) -> tuple[int, ...]:
        mc = self.model_config
        return (2 * mc.num_hidden_layers, num_blocks, self.block_size, mc.num_key_value_heads, mc.head_dim)

    def block_bytes(self) -> int:
        mc = self.model_config
        per_token = 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim
        return per_token * self.block_size * torch.empty((), dtype=self.dtype).element_size()

    def _blocks_in_budget(self, config: EngineConfig) -> int:
        if self.device.type != "cuda":
            return int(config.kv_cache_gib * _GIB // self.block_bytes())
        self.free_bytes_after_load = free_device_bytes(self.device)
        self.memory_budget_bytes = int(self.free_bytes_after_load * config.gpu_memory_utilization)
        if self.graph_batch_sizes:
            # The graphs need the real KV tensor, so they are captured after it; their memory is measured
            # first over a stand-in cache and kept out of the pool, so both stay within the budget.
            measured = measure_graph_memory(self.model, self._kv_shape(1), self.dtype, self.graph_batch_sizes,
                                            self.max_blocks_per_seq, self.device)
            self.graph_reserve_bytes = graph_memory_reserve(measured)
        return (self.memory_budget_bytes - self.graph_reserve_bytes) // self.block_bytes()

    def _capture_graphs(self) -> DecodeGraphs:
        before = free_device_bytes(self.device)
        graphs = DecodeGraphs(self.model, self.kv_cache, self.graph_batch_sizes, self.max_blocks_per_seq)
        self.graph_memory_bytes = before - free_device_bytes(self.device)
        return graphs

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk], in_flight_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Runs one step and returns the logits of the rows that sample, in chunk order.

        A step in which every sequence adds one token replays a CUDA graph when graphs are on; any other
        step runs eagerly. `in_flight_ids`: the picked ids of the step still in flight, which supply the
        pending tokens' ids on the device (`engine.overlap`); given whenever a chunk has a pending token.
        """
        lists = step_lists(chunks, self.block_size)
        batch_size = None if self.graphs is None else self.graphs.batch_size_for(lists)
        if batch_size is None:
            inputs = self._to_device(lists)
            if in_flight_ids is not None:
                fill_placeholders(inputs.input_ids, in_flight_ids)
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.meta)
            return self.model.compute_logits(hidden.index_select(0, inputs.sample_rows))
        hidden = self.graphs.replay(lists, batch_size, in_flight_ids)
        return self.model.compute_logits(hidden.index_select(0, self._tensor(lists.sample_rows, torch.int64)))

    @torch.inference_mode()
    def clear_step_buffers(self) -> None:
        """Resets the graphs' step buffers to padding; the engine calls this whenever it has nothing to run."""
        if self.graphs is not None:
            self.graphs.clear()

    def prepare(self, chunks: list[ScheduledChunk]) -> StepInputs:
        """Builds the flat inputs on the host as lists and copies them to the device once."""
        return self._to_device(step_lists(chunks, self.block_size))

    def _to_device(self, lists: StepLists) -> StepInputs:
        meta = AttentionMetadata(
            slot_mapping=self._tensor(lists.slot_mapping, torch.int64),
            block_tables=self._tensor(lists.block_tables, torch.int32),
            context_lens=self._tensor(lists.context_lens, torch.int32),
            cu_seqlens_q=self._tensor(lists.cu_seqlens_q, torch.int32),
            max_seqlen_q=lists.max_seqlen_q,
        )
        return StepInputs(
            self._tensor(lists.input_ids, torch.int64), self._tensor(lists.positions, torch.int64), meta,
            self._tensor(lists.sample_rows, torch.int64),
        )

    def _tensor(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        tensor = torch.tensor(values, dtype=dtype)
        if self.device.type == "cuda":
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor

    def copy_block(self, source: int, destination: int) -> None:
        """Copies one block's K and V in every layer (copy on write of a block shared by samples)."""
        self.kv_cache[:, destination].copy_(self.kv_cache[:, source])

    def zero_blocks(self, block_ids: list[int]) -> None:
        # Host ids: the range check needs no device round trip.
        kernels.zero_blocks(self.kv_cache, block_ids)

    def find_residue(self, block_ids: list[int]) -> list[int]:
        if not block_ids:
            return []
        return kernels.find_residue(self.kv_cache, block_ids)


def step_lists(chunks: list[ScheduledChunk], block_size: int) -> StepLists:
    """One step's flat inputs as host lists: each chunk's new tokens, their positions and cache slots."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    cu_seqlens = [0]
    context_lens: list[int] = []
    sample_rows: list[int] = []
    for chunk in chunks:
        seq = chunk.seq
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + chunk.num_tokens
        input_ids += seq.tokens_between(start, end)
        positions += range(start, end)
        table = seq.block_table
        slots += [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
        cu_seqlens.append(cu_seqlens[-1] + chunk.num_tokens)
        context_lens.append(end)
        if chunk.samples:
            sample_rows.append(cu_seqlens[-1] - 1)
    width = max(len(c.seq.block_table) for c in chunks)
    tables = [c.seq.block_table + [-1] * (width - len(c.seq.block_table)) for c in chunks]
    return StepLists(input_ids, positions, slots, cu_seqlens, context_lens, tables, sample_rows,
                     max(c.num_tokens for c in chunks))


def _dtype(name: str) -> torch.dtype:
    from engine.config import parse_dtype

    return parse_dtype(name)
