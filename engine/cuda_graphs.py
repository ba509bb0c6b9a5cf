"""CUDA graphs for decode: a step in which every sequence adds one token replays a captured graph.

On a GPU the engine is host-bound: a decode step launches some 700 kernels, and launching them takes
longer than running them. A step whose chunks are all one token long replays instead the graph captured
for the smallest batch size that holds it, after copying the step's inputs into the first rows of fixed
buffers and padding the rest. Prefill and mixed steps run eagerly, as before.

Graphs are captured for batch sizes 1, 2, 4, ... up to the most sequences a step can hold, the largest
first, all in one memory pool (one graph runs at a time, so their temporaries may overlap). What a
captured forward does is frozen at capture, so every replay must be able to run it unchanged:
- Shapes. A graph of batch b always runs b rows. A padded row adds token 0 at position 0 with slot -1
  (`store_kv` writes nothing for it) and a one-token context in a table row of -1 (attention loads
  zeros for an id outside the cache), so its output is finite and it never touches a block of the pool.
- The decode attention's split-K plan and grid. They depend only on the block tables' width, which for
  the graphs is the widest table a sequence can have (max_model_len), not on the step's contexts: the
  plan fixed at capture holds for every context up to that length, and partitions past a sequence's
  context exit at once. Eager steps keep the plan fitted to their widest table.
- No host reads. The Triton kernels read nothing back, and `kernels.validation` reads tensor values
  only for CPU tensors, which a graph never holds; the step's host lists are checked here instead,
  before they are packed (`check_decode_lists`).
The step's rows and block tables reach the buffers through the step's one upload (`engine.bridge`):
`DecodeGraphs.pack` adds them as segments, and `replay` copies the segments' device views into the
buffers (device to device) before the replay. On a CPU the same packing and loading run over buffers
of their own, with the forward run eagerly over them instead of replayed (`capture=False`, for tests).
Sampling stays outside: a graph ends with the final hidden states, and the runner projects the rows that
sample to logits as an eager step does.

The step buffers hold the latest step's token ids, positions, slots and hidden states. Rows beyond the
latest batch are reset to padding at every replay, and all rows once the engine has nothing left to run
(`DecodeGraphs.clear`), so nothing of a finished request stays there once the engine is idle.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

import kernels
from engine.bridge import Upload
from engine.config import EngineConfig
from engine.errors import EngineError
from engine.models.layers import AttentionMetadata
from engine.overlap import fill_placeholders

if TYPE_CHECKING:
    from engine.model_runner import StepLists

# What a padded row holds; the graphs' buffers hold these wherever no step's values are.
PAD_TOKEN, PAD_POSITION, PAD_SLOT, PAD_CONTEXT, PAD_BLOCK = 0, 0, -1, 1, -1
# The graph path's segments in a step's upload.
GRAPH_LONGS, GRAPH_CONTEXTS, GRAPH_SAMPLE_ROWS = "graph.longs", "graph.contexts", "graph.rows"
# The graphs' memory is measured over a stand-in cache before the KV pool is sized. The real capture may
# round its allocations differently (the allocator's segments are 2 or 20 MiB) and load kernel variants
# compiled for the real cache's size, so the pool leaves this much more room.
GRAPH_MEMORY_MARGIN = 1.1
GRAPH_MEMORY_SLACK_BYTES = 64 << 20


def graph_memory_reserve(measured_bytes: int) -> int:
    """What the KV pool leaves for graphs measured at measured_bytes over the stand-in cache."""
    return math.ceil(measured_bytes * GRAPH_MEMORY_MARGIN) + GRAPH_MEMORY_SLACK_BYTES


def cuda_graphs_enabled(config: EngineConfig, device: torch.device) -> bool:
    """Whether decode steps replay graphs: by default on CUDA with the Triton kernels, never elsewhere."""
    wanted = config.cuda_graphs
    if wanted is False:
        return False
    if device.type != "cuda":
        if wanted:
            raise EngineError(f"cuda_graphs needs a CUDA device; on {device.type} leave it unset or false")
        return False
    if kernels.selected_backend(device) != "triton":
        if wanted:
            raise EngineError(
                "cuda_graphs needs the Triton kernels: the reference kernels read tensors back to the host, "
                "which a captured graph cannot; unset VEIL_KERNELS or leave cuda_graphs unset or false"
            )
        return False
    return True


def graph_batch_sizes(max_batch: int) -> list[int]:
    """The batch sizes a graph is captured for: the powers of two below max_batch, then max_batch."""
    if max_batch < 1:
        raise EngineError("a step must hold at least one sequence (max_num_seqs and max_num_batched_tokens >= 1)")
    sizes = []
    size = 1
    while size < max_batch:
        sizes.append(size)
        size *= 2
    return sizes + [max_batch]


def bucket_for(num_seqs: int, batch_sizes: Sequence[int]) -> int | None:
    """The smallest of the ascending batch_sizes that holds num_seqs rows; None when none does."""
    return next((size for size in batch_sizes if size >= num_seqs), None)


@dataclass(frozen=True, slots=True)
class DecodeRows:
    """A decode step's per-row inputs padded to a batch size: what the graphs' row buffers receive."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    context_lens: list[int]


def pad_decode_rows(lists: StepLists, batch_size: int) -> DecodeRows:
    """The step's rows followed by padded rows up to batch_size (block tables are padded on the device)."""
    pad = batch_size - lists.num_seqs
    if pad < 0:
        raise EngineError(f"a decode step of {lists.num_seqs} sequences does not fit a graph of {batch_size}")
    return DecodeRows(
        input_ids=lists.input_ids + [PAD_TOKEN] * pad,
        positions=lists.positions + [PAD_POSITION] * pad,
        slot_mapping=lists.slot_mapping + [PAD_SLOT] * pad,
        context_lens=lists.context_lens + [PAD_CONTEXT] * pad,
    )


def check_decode_lists(lists: StepLists, num_slots: int, block_size: int) -> None:
    """Refuses a decode step that would write outside the KV pool or outside its sequence's own blocks.

    Eager steps on CUDA leave such checks to the kernels' masks. Here they cost one pass over host lists
    the runner has anyway, and run before anything is copied into the graphs' buffers.
    """
    rows = zip(lists.slot_mapping, lists.positions, lists.context_lens, lists.block_tables)
    for slot, position, context, table in rows:
        if not 0 <= slot < num_slots:
            raise EngineError(f"a decode step maps a token to a slot outside the KV pool of {num_slots}; nothing ran")
        if context != position + 1:
            raise EngineError("a decode step's context length must count its one new token; nothing ran")
        block_index = position // block_size
        if block_index >= len(table) or table[block_index] * block_size + position % block_size != slot:
            raise EngineError("a decode step's slot is not in its own sequence's block table; nothing ran")


@dataclass(slots=True)
class StepBuffers:
    """The graphs' inputs and output: fixed addresses, rewritten in place before each replay.

    Invariant: rows at or beyond `rows_in_use` hold padding, and so does every block table entry outside
    [:table_rows, :table_width].
    """

    input_ids: Tensor  # [max_batch] int64
    positions: Tensor  # [max_batch] int64
    slot_mapping: Tensor  # [max_batch] int64, -1: write nothing
    context_lens: Tensor  # [max_batch] int32
    cu_seqlens_q: Tensor  # [max_batch + 1] int32: 0, 1, 2, ... one new token per row, never rewritten
    block_tables: Tensor  # [max_batch, max_blocks_per_seq] int32, -1: no block
    hidden: Tensor  # [max_batch, hidden_size] the captured forward's output
    rows_in_use: int = 0
    table_rows: int = 0
    table_width: int = 0

    @classmethod
    def allocate(
        cls, max_batch: int, max_blocks_per_seq: int, hidden_size: int, dtype: torch.dtype, device: torch.device
    ) -> StepBuffers:
        def filled(shape: tuple[int, ...], value: int, kind: torch.dtype = torch.int64) -> Tensor:
            return torch.full(shape, value, dtype=kind, device=device)

        return cls(
            input_ids=filled((max_batch,), PAD_TOKEN),
            positions=filled((max_batch,), PAD_POSITION),
            slot_mapping=filled((max_batch,), PAD_SLOT),
            context_lens=filled((max_batch,), PAD_CONTEXT, torch.int32),
            cu_seqlens_q=torch.arange(max_batch + 1, dtype=torch.int32, device=device),
            block_tables=filled((max_batch, max_blocks_per_seq), PAD_BLOCK, torch.int32),
            hidden=torch.zeros(max_batch, hidden_size, dtype=dtype, device=device),
        )

    def metadata(self, batch_size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch_size],
            block_tables=self.block_tables[:batch_size],
            context_lens=self.context_lens[:batch_size],
            cu_seqlens_q=self.cu_seqlens_q[: batch_size + 1],
            max_seqlen_q=1,
        )

    def pack(self, upload: Upload, lists: StepLists, batch_size: int) -> None:
        """Adds a decode step's rows, padded over what the previous step used, to `upload` (its block tables
        reach the device as diffs of their own: `engine.device_tables`)."""
        rows = max(batch_size, self.rows_in_use)
        padded = pad_decode_rows(lists, rows)
        upload.add(GRAPH_LONGS, padded.input_ids + padded.positions + padded.slot_mapping, torch.int64, (3, rows))
        upload.add(GRAPH_CONTEXTS, padded.context_lens, torch.int32)
        upload.add(GRAPH_SAMPLE_ROWS, lists.sample_rows, torch.int64)

    def load(self, views: dict[str, Tensor], tables: Tensor, batch_size: int) -> None:
        """Copies the packed step (device views) and its tables [seqs, width] (on the device) into rows
        [0, batch_size), and pads the rest the previous step used."""
        longs = views[GRAPH_LONGS]
        rows = longs.shape[1]
        for buffer, values in zip((self.input_ids, self.positions, self.slot_mapping), longs):
            buffer[:rows].copy_(values)
        self.context_lens[:rows].copy_(views[GRAPH_CONTEXTS])
        if self.rows_in_use > batch_size:
            self.hidden[batch_size : self.rows_in_use].zero_()
        self.block_tables[: self.table_rows, : self.table_width].fill_(PAD_BLOCK)
        self.block_tables[: tables.shape[0], : tables.shape[1]].copy_(tables)
        self.rows_in_use, self.table_rows, self.table_width = batch_size, tables.shape[0], tables.shape[1]

    def clear(self) -> None:
        """Every row back to padding: nothing of the latest step stays readable here."""
        if self.rows_in_use == 0:
            return
        for buffer, value in ((self.input_ids, PAD_TOKEN), (self.positions, PAD_POSITION),
                              (self.slot_mapping, PAD_SLOT), (self.context_lens, PAD_CONTEXT),
                              (self.block_tables, PAD_BLOCK), (self.hidden, 0)):
            buffer.fill_(value)
        self.rows_in_use = self.table_rows = self.table_width = 0


class DecodeGraphs:
    """One captured decode forward per batch size, over one KV tensor, sharing one pool and one set of buffers."""

    def __init__(self, model: nn.Module, kv_cache: Tensor, batch_sizes: Sequence[int], max_blocks_per_seq: int,
                 capture: bool = True) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.batch_sizes = sorted(batch_sizes)
        self.num_slots = kv_cache.shape[1] * kv_cache.shape[2]
        self.block_size = kv_cache.shape[2]
        self.buffers = StepBuffers.allocate(
            self.batch_sizes[-1], max_blocks_per_seq, model.config.hidden_size, kv_cache.dtype, kv_cache.device
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.replays = 0
        # capture=False (tests on a CPU): each replay runs the forward eagerly over the same buffers.
        self.captured = capture
        if capture:
            self._capture()

    def batch_size_for(self, lists: StepLists) -> int | None:
        """The batch size of the graph this step replays; None when the step must run eagerly."""
        if lists.max_seqlen_q != 1 or lists.width > self.buffers.block_tables.shape[1]:
            return None
        return bucket_for(lists.num_seqs, self.batch_sizes)

    def pack(self, upload: Upload, lists: StepLists, batch_size: int) -> None:
        """Checks a decode step and adds it to the step's upload for the graph of batch_size."""
        check_decode_lists(lists, self.num_slots, self.block_size)
        self.buffers.pack(upload, lists, batch_size)

    def replay(self, views: dict[str, Tensor], tables: Tensor, lists: StepLists, batch_size: int,
               in_flight_ids: Tensor | None = None) -> Tensor:
        """Runs the packed step through the graph of batch_size; returns the final hidden states of its rows.

        in_flight_ids: the picked ids that replace the step's placeholders (`engine.overlap`), if any.
        """
        self.buffers.load(views, tables, batch_size)
        if in_flight_ids is not None:
            fill_placeholders(self.buffers.input_ids[: lists.num_seqs], in_flight_ids)
        if self.captured:
            self.graphs[batch_size].replay()
        else:
            self._forward(batch_size)
        self.replays += 1
        return self.buffers.hidden[: lists.num_seqs]

    @staticmethod
    def sample_rows(views: dict[str, Tensor]) -> Tensor:
        return views[GRAPH_SAMPLE_ROWS]

    def clear(self) -> None:
        self.buffers.clear()

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = None
        for size in reversed(self.batch_sizes):  # largest first: the smaller ones fit in the memory it freed
            self._forward(size)  # outside the capture, so Triton compiles and loads this shape's kernels now
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward(size)
            if pool is None:
                pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize(self.kv_cache.device)
        # The warm-ups and captures ran padding rows and left their hidden states: a padded row reads 0.
        self.buffers.hidden.zero_()

    def _forward(self, batch_size: int) -> None:
        # Every row is padding here (slot -1), so neither the warm-up nor the capture writes the cache.
        buffers = self.buffers
        hidden = self.model(
            buffers.input_ids[:batch_size], buffers.positions[:batch_size], self.kv_cache, buffers.metadata(batch_size)
        )
        buffers.hidden[:batch_size].copy_(hidden)


def free_device_bytes(device: torch.device) -> int:
    """Free device memory once the allocator has handed back every cached block it does not use."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0]


def measure_graph_memory(
    model: nn.Module, kv_shape: tuple[int, ...], dtype: torch.dtype, batch_sizes: Sequence[int],
    max_blocks_per_seq: int, device: torch.device,
) -> int:
    """Device bytes the decode graphs take, measured by capturing all of them over a one-block stand-in cache.

    The real capture needs the real KV tensor, so it comes after the pool is sized; what the graphs hold
    (buffers, temporaries, kernel code loaded for them) does not depend on how many blocks the cache has.
    """
    stand_in = torch.zeros((kv_shape[0], 1, *kv_shape[2:]), dtype=dtype, device=device)
    before = free_device_bytes(device)
    graphs = DecodeGraphs(model, stand_in, batch_sizes, max_blocks_per_seq)
    used = before - free_device_bytes(device)
    del graphs, stand_in
    gc.collect()
    torch.cuda.empty_cache()
    return used
