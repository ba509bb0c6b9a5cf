"""Owns the model and the KV tensor: builds one step's flat inputs, runs the model, zeroes blocks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels
from engine.config import EngineConfig
from engine.errors import EngineError
from engine.loader import load_model
from engine.models.layers import AttentionMetadata
from engine.scheduler import ScheduledChunk

_GIB = 1 << 30


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
        self.num_blocks = config.num_blocks or self._blocks_in_budget(config)
        if self.num_blocks < 1:
            raise EngineError("the KV budget holds no block; raise kv_cache_gib or gpu_memory_utilization")
        mc = self.model_config
        # One tensor for every layer's K and V: index 2*i is layer i's K, 2*i+1 its V. Allocated as zeros,
        # so blocks that were never used pass the residue check too.
        self.kv_cache = torch.zeros(
            2 * mc.num_hidden_layers, self.num_blocks, self.block_size, mc.num_key_value_heads, mc.head_dim,
            dtype=self.dtype, device=self.device,
        )

    def block_bytes(self) -> int:
        mc = self.model_config
        per_token = 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim
        return per_token * self.block_size * torch.empty((), dtype=self.dtype).element_size()

    def _blocks_in_budget(self, config: EngineConfig) -> int:
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = free * config.gpu_memory_utilization
        else:
            budget = config.kv_cache_gib * _GIB
        return int(budget // self.block_bytes())

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Runs one step and returns the logits of the rows that sample, in chunk order."""
        inputs = self.prepare(chunks)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.meta)
        return self.model.compute_logits(hidden.index_select(0, inputs.sample_rows))

    def prepare(self, chunks: list[ScheduledChunk]) -> StepInputs:
        """Builds the flat inputs on the host as lists and copies them to the device once."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu_seqlens = [0]
        context_lens: list[int] = []
        sample_rows: list[int] = []
        bs = self.block_size
        for chunk in chunks:
            seq = chunk.seq
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + chunk.num_tokens
            input_ids += seq.tokens_between(start, end)
            positions += range(start, end)
            table = seq.block_table
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            cu_seqlens.append(cu_seqlens[-1] + chunk.num_tokens)
            context_lens.append(end)
            if chunk.samples:
                sample_rows.append(cu_seqlens[-1] - 1)
        width = max(len(c.seq.block_table) for c in chunks)
        tables = [c.seq.block_table + [-1] * (width - len(c.seq.block_table)) for c in chunks]
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots, torch.int64),
            block_tables=self._tensor(tables, torch.int32),
            context_lens=self._tensor(context_lens, torch.int32),
            cu_seqlens_q=self._tensor(cu_seqlens, torch.int32),
            max_seqlen_q=max(c.num_tokens for c in chunks),
        )
        return StepInputs(
            self._tensor(input_ids, torch.int64), self._tensor(positions, torch.int64), meta,
            self._tensor(sample_rows, torch.int64),
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


def _dtype(name: str) -> torch.dtype:
    from engine.config import parse_dtype

    return parse_dtype(name)
