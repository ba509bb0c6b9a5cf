"""Owns the model and the KV tensor: builds one step's flat inputs, runs the model, zeroes blocks.

A step crosses the bridge (`engine.bridge`) once each way: its inputs, its sampling settings and the
block ids queued since the last step (`engine.block_ops`) go up in one upload; its picks, logprobs,
finished embeddings and the residue count come back in one download.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine import block_ops
from engine.block_ops import PendingBlockOps
from engine.bridge import Bridge, Download, DownloadPlan, Upload
from engine.compute_dtype import choose_dtype
from engine.config import EngineConfig, ModelConfig
from engine.device_tables import DeviceBlockTables
from engine.draft_model import DraftModel, DraftRequest, draft_folder
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
from engine.overlap import async_scheduling_enabled, fill_placeholders, placeholder
from engine.pooling import EMBEDDINGS, PoolingStep
from engine.sampler import PickedTokens, SampleRequest, Sampler
from engine.scheduler import ScheduledChunk
from engine.speculative import SpeculativeBatch, SpeculativeSampler

_GIB = 1 << 30
# The runner's segments in a step's crossings.
STEP_LONGS, STEP_INTS = "step.longs", "step.ints"
RESIDUE_FOUND, RESIDUE_FLAGS, CHECK_IDS = "residue.found", "residue.flags", "residue.check_ids"


@dataclass(slots=True)
class StepLists:
    """One step's flat inputs as host lists, built before anything is copied to the device."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    cu_seqlens_q: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]  # a row per sequence (they reach the device as diffs: `engine.device_tables`)
    sample_rows: list[int]
    max_seqlen_q: int
    seq_ids: list[int] = field(default_factory=list)  # whose rows of the device tables the step reads

    @property
    def width(self) -> int:
        """Columns of the step's block tables: its widest table."""
        return max(map(len, self.block_tables))

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # rows of the flat batch whose logits pick a token


@dataclass(slots=True)
class PickRequest:
    """What a step picks, given with its inputs so that its settings ride in the same upload.

    A speculative step's picks are a `SpeculativeSampler`'s over a `SpeculativeBatch`, packed and picked alike.
    """

    sampler: Sampler | SpeculativeSampler
    requests: list[SampleRequest] | SpeculativeBatch
    masks: torch.Tensor | None = None  # host grammar bitmasks (`engine.structured`)


@dataclass(slots=True)
class StepRun:
    logits: torch.Tensor  # of the rows that sample, in chunk order
    picked: PickedTokens | None  # when the step was given a PickRequest: its picks, their download started
    # The embeddings finished in the step (`engine.pooling`), flat fp32 on the device: in `picked`'s download
    # when the step picks, else for the caller to fetch.
    embeddings: torch.Tensor | None = None


class ModelRunner:
    def __init__(self, model_dir: str, config: EngineConfig) -> None:
        self.device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        # Downloads drain on a worker thread when steps overlap: the scheduling thread never waits for one.
        self.bridge = Bridge(self.device, config.bridge_toll_us, async_scheduling_enabled(config, self.device))
        self.dtype_choice = choose_dtype(config.dtype, ModelConfig.from_folder(Path(model_dir)).torch_dtype, self.device)
        self.model = load_model(model_dir, self.dtype_choice.dtype, self.device, self.bridge)
        self.model_config = self.model.config
        self.dtype = next(self.model.parameters()).dtype
        self.block_size = config.block_size
        max_model_len = min(config.max_model_len or 1 << 62, self.model_config.max_context)
        folder = draft_folder(config.speculative)
        # Draft-model speculation: the draft's K and V live in the target's blocks (`engine.draft_model`).
        self.draft = None if folder is None else DraftModel(folder, self.dtype, self.device, self.bridge,
                                                            self.model_config, Path(model_dir), max_model_len,
                                                            config.draw_kind)
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
        if self.draft is not None:
            self.draft.allocate(self.num_blocks, self.block_size)
        self.graphs = self._capture_graphs() if self.graph_batch_sizes else None
        self.block_ops = PendingBlockOps(self.num_blocks)
        self.tables = DeviceBlockTables(self.device, self.max_blocks_per_seq)
        # Residue found by the checks queued here, summed on the device; every step's download carries it.
        self.residue_found = torch.zeros((), dtype=torch.int64, device=self.device)
        self.residue_read = 0  # its value in the latest download read
        self._previous_inputs: tuple[tuple, tuple, StepInputs] | None = None  # see `_step_inputs`

    def _kv_shape(self, num_blocks: int) -> tuple[int, ...]:
        mc = self.model_config
        return (2 * mc.num_hidden_layers, num_blocks, self.block_size, mc.num_key_value_heads, mc.head_dim)

    def block_bytes(self) -> int:
        mc = self.model_config
        per_token = 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim
        drafts = 0 if self.draft is None else self.draft.block_bytes(self.block_size)
        return per_token * self.block_size * torch.empty((), dtype=self.dtype).element_size() + drafts

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

    def run(self, lists: StepLists, in_flight_ids: torch.Tensor | None = None, picks: PickRequest | None = None,
            drafting: DraftRequest | None = None, pooling: PoolingStep | None = None) -> StepRun:
        """Runs one step: one upload, the queued block ops, the forward, and with `picks` the picks and one download.

        A step in which every sequence adds one token replays a CUDA graph when graphs are on; any other
        step runs eagerly. `in_flight_ids`: the picked ids of the step still in flight, which supply the
        pending tokens' ids on the device (`engine.overlap`); given whenever a chunk has a pending token.
        `pooling`: the rows embedding requests reduce (`engine.pooling`); such a step runs eagerly, and the
        vectors it finishes ride its picks' download.
        """
        # Inference mode through the guard `torch.inference_mode` itself enters: the decorator also makes
        # a mode object and enters it in Python, about twice the guard's cost inside a step (measured at
        # batch 256: 38 us a step entering and leaving through the decorator).
        with torch._C._InferenceMode(True):
            return self._run(lists, in_flight_ids, picks, drafting, pooling)

    def _run(self, lists: StepLists, in_flight_ids: torch.Tensor | None, picks: PickRequest | None,
             drafting: DraftRequest | None, pooling: PoolingStep | None = None) -> StepRun:
        batch_size = None if self.graphs is None or pooling else self.graphs.batch_size_for(lists)
        upload = self.bridge.upload()
        ops = self.block_ops.pack(upload)
        if batch_size is None:
            pack_step(upload, lists)
        else:
            self.graphs.pack(upload, lists, batch_size)
        tables = self.tables.pack(upload, lists.seq_ids, lists.block_tables)
        plan = None if picks is None else picks.sampler.pack(upload, picks.requests, self.model_config.vocab_size,
                                                             picks.masks)
        # Draft-model speculation: the draft's forwards, whose picks the step's placeholders name.
        draft_plan = None if drafting is None else self.draft.pack(upload, drafting)
        views = self.bridge.send(upload)
        self._apply(ops, views)
        step_tables = self.tables.step_tables(tables, views)
        if draft_plan is not None:  # speculative steps are synchronous: no pick is in flight to fill
            in_flight_ids = self.draft.propose(draft_plan, views, step_tables)
        logits, embeddings = self._forward(lists, views, step_tables, batch_size, in_flight_ids, pooling)
        if picks is None:
            return StepRun(logits, None, embeddings)
        download = DownloadPlan()
        picked = picks.sampler.pick(logits, plan, views, download)
        if embeddings is not None:
            download.add(EMBEDDINGS, embeddings)
        download.add(RESIDUE_FOUND, self.residue_found)
        picked.copy = self.bridge.fetch(download)
        return StepRun(logits, picked)

    def _forward(self, lists: StepLists, views: dict[str, torch.Tensor], tables: torch.Tensor,
                 batch_size: int | None, in_flight_ids: torch.Tensor | None, pooling: PoolingStep | None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The sampling rows' logits, and the embeddings the step finishes when there are any."""
        if batch_size is not None:
            hidden = self.graphs.replay(views, tables, lists, batch_size, in_flight_ids)
            return self.model.compute_logits(hidden.index_select(0, self.graphs.sample_rows(views))), None
        inputs = self._step_inputs(views, tables, lists)
        if in_flight_ids is not None:
            fill_placeholders(inputs.input_ids, in_flight_ids)
        if pooling is None and len(lists.sample_rows) == 1 and len(lists.input_ids) == 1:
            # One token that samples (a batch-1 decode step): on a CPU the compiled decode runs the forward
            # and the output head in one call (`decode_logits`); elsewhere it runs nothing and says so.
            logits = self.model.decode_logits(inputs.input_ids, inputs.positions, self.kv_cache, inputs.meta)
            if logits is not None:
                return logits, None
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.meta)
        embeddings = pooling.reduce(hidden) if pooling else None
        return self.model.compute_logits(hidden.index_select(0, inputs.sample_rows)), embeddings

    def _step_inputs(self, views: dict[str, torch.Tensor], tables: torch.Tensor, lists: StepLists) -> StepInputs:
        """`step_inputs`, or the previous step's when they would be the same views: a steady decode step's
        segments are the bridge's kept views and its tables the device tables' kept ones, and what they
        hold is this step's (six tensor ops and two dataclasses fewer per step)."""
        tensors = (views[STEP_LONGS], views[STEP_INTS], tables)
        sizes = (len(lists.input_ids), len(lists.sample_rows), lists.num_seqs, lists.max_seqlen_q)
        previous = self._previous_inputs
        if previous is None or previous[1] != sizes or any(a is not b for a, b in zip(previous[0], tensors)):
            previous = self._previous_inputs = (tensors, sizes, step_inputs(views, tables, lists))
        return previous[2]

    def note_read(self, download: Download) -> None:
        """Takes the residue count a read download carried (the latest read is the newest count)."""
        found = download.values().get(RESIDUE_FOUND)  # absent from a ForwardOnly step's own download
        if found is not None:
            self.residue_read = max(self.residue_read, found[0])

    @torch.inference_mode()
    def clear_step_buffers(self, settled: bool = False) -> None:
        """Resets the graphs' step buffers to padding and zeroes what the last crossings left in the bridge
        (`Bridge.scrub`); the engine calls this whenever it has nothing to run, after its last crossing.
        `settled`: no step is in flight either, so a download not read yet was dropped (its step raised)."""
        if self.graphs is not None:
            self.graphs.clear()
        self.bridge.scrub(settled)

    def prepare(self, chunks: list[ScheduledChunk]) -> StepInputs:
        """A step's flat inputs on the device in one upload, the queued block ops run first (tests and tools)."""
        upload = self.bridge.upload()
        ops = self.block_ops.pack(upload)
        lists = step_lists(chunks, self.block_size)
        pack_step(upload, lists)
        tables = self.tables.pack(upload, lists.seq_ids, lists.block_tables)
        views = self.bridge.send(upload)
        self._apply(ops, views)
        return step_inputs(views, self.tables.step_tables(tables, views), lists)

    def copy_block(self, source: int, destination: int) -> None:
        """Copies one block's K and V in every layer (copy on write), in order with the queued zeroing."""
        self.block_ops.copy(source, destination)

    def zero_blocks(self, block_ids: list[int]) -> None:
        """Queues the zeroing of freed blocks: it runs on the device before anything of the next upload."""
        self.block_ops.zero(block_ids)

    def check_residue(self, block_ids: list[int]) -> None:
        """Queues a residue check of blocks that are free now; what it finds adds into `residue_found`."""
        self.block_ops.check_residue(block_ids)

    @torch.inference_mode()
    def flush(self) -> None:
        """Runs the queued block ops in an upload of their own: when no step is coming to carry them."""
        if not self.block_ops:
            return
        upload = self.bridge.upload()
        ops = self.block_ops.pack(upload)
        self._apply(ops, self.bridge.send(upload))

    def _apply(self, ops: list[block_ops.BlockOp], views: dict[str, torch.Tensor]) -> None:
        """Runs the queued block ops on the KV tensor, and on the draft's, which lives in the same blocks."""
        block_ops.apply(ops, views, self.kv_cache, self.residue_found)
        if self.draft is not None:
            block_ops.apply(ops, views, self.draft.kv_cache, self.residue_found)

    @torch.inference_mode()
    def read_residue(self) -> int:
        """Runs what is queued and reads the residue count now: one crossing each way (reports, shutdown)."""
        self.flush()
        download = DownloadPlan()
        download.add(RESIDUE_FOUND, self.residue_found)
        self.residue_read = self.bridge.read(download)[RESIDUE_FOUND][0]
        return self.residue_read

    @torch.inference_mode()
    def find_residue(self, block_ids: list[int]) -> list[int]:
        """The listed blocks holding any non-zero byte, after every queued op: one crossing each way."""
        if not block_ids:
            self.flush()
            return []
        upload = self.bridge.upload()
        ops = self.block_ops.pack(upload)
        self.block_ops.check_ids(block_ids)
        upload.add(CHECK_IDS, block_ids, torch.int64)
        views = self.bridge.send(upload)
        self._apply(ops, views)
        flags = block_ops.dirty_flags(self.kv_cache, views[CHECK_IDS])
        if self.draft is not None:
            flags = flags | block_ops.dirty_flags(self.draft.kv_cache, views[CHECK_IDS])
        download = DownloadPlan()
        download.add(RESIDUE_FLAGS, flags)
        dirty = self.bridge.read(download)[RESIDUE_FLAGS]
        return list(dict.fromkeys(block for block, flag in zip(block_ids, dirty) if flag))


def pack_step(upload: Upload, lists: StepLists) -> None:
    """Adds an eager step's inputs to `upload`: one int64 and one int32 segment (tables: `DeviceBlockTables`)."""
    upload.add(STEP_LONGS, lists.input_ids + lists.positions + lists.slot_mapping + lists.sample_rows, torch.int64)
    upload.add(STEP_INTS, lists.context_lens + lists.cu_seqlens_q, torch.int32)


def step_inputs(views: dict[str, torch.Tensor], tables: torch.Tensor, lists: StepLists) -> StepInputs:
    """`pack_step`'s segments as the step's device tensors: views of the upload, valid until the next one."""
    tokens = len(lists.input_ids)
    input_ids, positions, slots, sample_rows = views[STEP_LONGS].split_with_sizes([tokens] * 3 + [len(lists.sample_rows)])
    context_lens, cu_seqlens_q = views[STEP_INTS].split_with_sizes([lists.num_seqs, lists.num_seqs + 1])
    meta = AttentionMetadata(slot_mapping=slots, block_tables=tables, context_lens=context_lens,
                             cu_seqlens_q=cu_seqlens_q, max_seqlen_q=lists.max_seqlen_q)
    return StepInputs(input_ids, positions, meta, sample_rows)


def step_lists(chunks: list[ScheduledChunk], block_size: int) -> StepLists:
    """One step's flat inputs as host lists: each chunk's new tokens, their positions and cache slots."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    cu_seqlens = [0]
    context_lens: list[int] = []
    sample_rows: list[int] = []
    tables: list[list[int]] = []
    seq_ids: list[int] = []
    total = 0
    widest = 1 if chunks else 0  # every chunk has a token
    for chunk in chunks:
        seq, count, draft = chunk.seq, chunk.num_tokens, chunk.draft
        start = seq.num_computed_tokens
        table = seq.block_table
        tables.append(table)
        seq_ids.append(seq.seq_id)
        if count == 1 and not draft:  # decode: most chunks of most steps, so no range, comprehension or call
            prompt, outputs = seq.prompt_token_ids, seq.output_token_ids
            known = len(prompt) + len(outputs)
            if start < known:  # `Sequence.token_at` spelled out: one already read, or the pending one
                input_ids.append(prompt[start] if start < len(prompt) else outputs[start - len(prompt)])
            else:
                input_ids.append(placeholder(seq.pending_row))
            positions.append(start)
            slots.append(table[start // block_size] * block_size + start % block_size)
            total += 1
            cu_seqlens.append(total)
            context_lens.append(start + 1)
            # `num_tokens`: its row samples, unless it is an embedding's (`engine.pooling`: it picks nothing)
            if start + 1 == known + (seq.pending_row is not None) and seq.pooling is None:
                sample_rows.append(total - 1)
            continue
        end = start + count
        input_ids += seq.tokens_between(start, end)
        if draft:  # speculative: the drafts follow as queries of their own (`engine.speculative`)
            input_ids += draft
            count, end = count + len(draft), end + len(draft)
        positions += range(start, end)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
        total += count
        widest = max(widest, count)
        cu_seqlens.append(total)
        context_lens.append(end)
        if end - len(draft) == seq.num_tokens and seq.pooling is None:  # it reaches the end: its last row samples
            if draft:  # and so does each draft's row, to verify it
                sample_rows += range(total - 1 - len(draft), total - 1)
            sample_rows.append(total - 1)
    return StepLists(input_ids, positions, slots, cu_seqlens, context_lens, tables, sample_rows, widest, seq_ids)
