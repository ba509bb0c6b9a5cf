"""CUDA graphs for decode steps: same tokens as `transformers`, padded rows inert, memory within budget.

The GPU tests (`-m gpu`, on a CUDA machine) run the engine on the device with graphs on and off against
`transformers` on the same fp32 weights, with batches that grow and shrink, chunked prefill mixed with
decode and forced preemption. The CPU tests cover what needs no device: the batch sizes captured, the
choice of graph, the padding of a step's host lists, the step buffers, and the configuration.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch

import kernels
from engine import EngineConfig, EngineError, LLMEngine
from engine.cli import engine_config
from engine.cuda_graphs import (
    PAD_BLOCK,
    StepBuffers,
    bucket_for,
    check_decode_lists,
    cuda_graphs_enabled,
    free_device_bytes,
    graph_batch_sizes,
    pad_decode_rows,
)
from engine.bridge import Bridge
from engine.model_runner import StepLists, step_lists
from tests.engine_models import (  # noqa: F401 (fixtures)
    REFERENCE_NAMES,
    greedy,
    hf_greedy,
    one_torch_thread,
    output_tokens,
    random_lengths,
    random_prompts,
    reference_models,
    tiny_engine,
    tiny_model_dir,
)
from veil.cli import build_parser

NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
NUM_REQUESTS = 18
BUDGET = 32  # tokens per step: prompts longer than this are prefilled in chunks


@dataclass(frozen=True, slots=True)
class RunRecord:
    """One `ModelRunner.run` call: the chunks' token counts, the tokens fed, and whether a graph replayed."""

    chunk_tokens: tuple[int, ...]
    fed_tokens: tuple[int, ...]
    replayed: bool

    @property
    def is_pure_decode(self) -> bool:
        return all(count == 1 for count in self.chunk_tokens)


def record_runs(engine: LLMEngine) -> list[RunRecord]:
    """Wraps the real runner so every step is recorded (the runner itself runs unchanged)."""
    runs: list[RunRecord] = []
    runner = engine.runner
    run = runner.run

    def replays() -> int:
        return 0 if runner.graphs is None else runner.graphs.replays

    def recording_run(lists, in_flight_ids=None, picks=None):
        before = replays()
        fed = list(lists.input_ids)
        if in_flight_ids is not None:  # async steps: a pending token's id is the in-flight pick it names
            in_flight = in_flight_ids.tolist()
            fed = [in_flight[-1 - t] if t < 0 else t for t in fed]
        result = run(lists, in_flight_ids, picks)
        cu = lists.cu_seqlens_q
        runs.append(RunRecord(tuple(b - a for a, b in zip(cu, cu[1:])), tuple(fed), replays() > before))
        return result

    runner.run = recording_run
    return runs


def gpu_engine(folder, cuda_graphs: bool | None, **config) -> LLMEngine:
    """On CUDA steps are async (launched before the previous one is read) unless config says otherwise."""
    return LLMEngine(folder, EngineConfig(device="cuda", cuda_graphs=cuda_graphs, **config))


def generate_with_arrivals(engine: LLMEngine, prompts: list[list[int]], max_tokens: list[int], first: int,
                           every: int) -> list[list[int]]:
    """Starts `first` requests, then one more every `every` steps; returns each request's tokens in order."""
    waiting = list(zip(prompts, max_tokens))
    ids = [engine.add_request(prompt, greedy(count)) for prompt, count in waiting[:first]]
    later = waiting[first:]
    tokens: dict[str, list[int]] = {}
    step = 0
    while later or engine.has_unfinished():
        if later and step % every == 0:
            prompt, count = later.pop(0)
            ids.append(engine.add_request(prompt, greedy(count)))
        for delta in engine.step():
            tokens.setdefault(delta.request_id, []).extend(delta.token_ids)
        step += 1
    return [tokens.get(request_id, []) for request_id in ids]


def rows_are_padding(buffers: StepBuffers, start: int) -> bool:
    """Whether every row of every step buffer from `start` on holds what a padded row holds."""
    return all((
        bool((buffers.input_ids[start:] == 0).all()), bool((buffers.positions[start:] == 0).all()),
        bool((buffers.slot_mapping[start:] == -1).all()), bool((buffers.context_lens[start:] == 1).all()),
        bool((buffers.block_tables[start:] == PAD_BLOCK).all()), bool((buffers.hidden[start:] == 0).all()),
    ))


def tables_outside_the_step_are_empty(buffers: StepBuffers) -> bool:
    outside = torch.ones_like(buffers.block_tables, dtype=torch.bool)
    outside[: buffers.table_rows, : buffers.table_width] = False
    return bool((buffers.block_tables[outside] == PAD_BLOCK).all())


def prompt_of(length: int, seed: int) -> list[int]:
    return random_prompts(1, length, length, seed=seed)[0]


# ----- on a CUDA device ---------------------------------------------------------------------------------


@pytest.mark.gpu
@NEEDS_CUDA
@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("cuda_graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("name", REFERENCE_NAMES)
def test_greedy_tokens_match_transformers_with_graphs_and_eagerly(name, cuda_graphs, async_scheduling,
                                                                  reference_models):
    prompts = random_prompts(NUM_REQUESTS, 3, 45, seed=31)
    prompts[0] = prompt_of(BUDGET + 9, seed=32)  # longer than a step's budget: prefilled in chunks
    max_tokens = random_lengths(NUM_REQUESTS, 1, 30, seed=33)
    reference = reference_models[name]
    expected = [hf_greedy(reference.model, p, n) for p, n in zip(prompts, max_tokens)]

    # 20 blocks of 4 tokens: far fewer than the batch needs at once, so it must preempt.
    engine = gpu_engine(reference.folder, cuda_graphs, num_blocks=20, block_size=4,
                        max_num_batched_tokens=BUDGET, max_num_seqs=8, async_scheduling=async_scheduling)
    runs = record_runs(engine)
    produced = generate_with_arrivals(engine, prompts, max_tokens, first=6, every=3)

    for index, (got, want) in enumerate(zip(produced, expected)):
        assert got == want, f"request {index} differs from transformers"
    assert engine.scheduler.num_preemptions > 0
    decode_batches = {len(run.chunk_tokens) for run in runs if run.is_pure_decode}
    assert len(decode_batches) >= 3, "the decode batch never changed size"
    assert any(not run.is_pure_decode and 1 in run.chunk_tokens for run in runs), "no step mixed prefill with decode"
    if cuda_graphs:
        # max_num_seqs is the largest graph, so every pure decode step replays and no other step does.
        assert [run.replayed for run in runs] == [run.is_pure_decode for run in runs]
        assert engine.runner.graphs.replays == sum(run.is_pure_decode for run in runs) > 0
    else:
        assert engine.runner.graphs is None
        assert not any(run.replayed for run in runs)
    assert engine.async_scheduling == async_scheduling
    assert engine.residue_check() == []


@pytest.mark.gpu
@NEEDS_CUDA
def test_a_replay_writes_only_the_new_tokens_slots_and_padded_rows_nothing(reference_models):
    engine = gpu_engine(reference_models["llama"].folder, True, num_blocks=64, block_size=4, max_num_seqs=8)
    # Positions 5, 9 and 6 come next: each in a block the sequence already holds, so no block is taken.
    for length, seed in ((5, 41), (9, 42), (6, 43)):
        engine.add_request(prompt_of(length, seed), greedy(10))
    engine.step()  # prefills all three and samples their first tokens
    seqs = list(engine.scheduler.running)
    assert len(seqs) == 3 and all(seq.num_uncomputed_tokens == 1 for seq in seqs)
    kv = engine.runner.kv_cache
    others = sorted(set(range(64)) - {block for seq in seqs for block in seq.block_table})
    kv[:, others] = torch.randn_like(kv[:, others])  # stands for other requests' K/V
    new_slots = {(seq.block_table[seq.num_computed_tokens // 4], seq.num_computed_tokens % 4) for seq in seqs}
    before = kv.clone()
    replays = engine.runner.graphs.replays

    engine.step()

    assert engine.runner.graphs.replays == replays + 1
    assert engine.runner.graphs.buffers.rows_in_use == 4  # three sequences in the graph of four: one padded row
    changed = (kv.view(torch.int32) != before.view(torch.int32)).flatten(3).any(-1).any(0)  # [block, offset]
    assert {tuple(slot) for slot in changed.nonzero().tolist()} == new_slots
    kv[:, others] = 0
    list(engine.stream())
    assert engine.residue_check() == []


@pytest.mark.gpu
@NEEDS_CUDA
def test_graphs_cover_every_batch_size_up_to_max_num_seqs(reference_models):
    reference = reference_models["llama"]
    engine = gpu_engine(reference.folder, None, num_blocks=512, block_size=4, max_num_seqs=48)
    graphs = engine.runner.graphs
    assert graphs.batch_sizes == sorted(graphs.graphs) == [1, 2, 4, 8, 16, 32, 48]
    # The widest table any sequence can have: max_position_embeddings 512 in blocks of 4.
    assert tuple(graphs.buffers.block_tables.shape) == (48, 128)
    narrow = gpu_engine(reference.folder, None, num_blocks=64, block_size=4, max_num_seqs=48, max_num_batched_tokens=20)
    assert narrow.runner.graphs.batch_sizes == [1, 2, 4, 8, 16, 20]

    prompts = random_prompts(40, 3, 12, seed=44)
    runs = record_runs(engine)
    assert output_tokens(engine, prompts, greedy(5)) == [hf_greedy(reference.model, p, 5) for p in prompts]
    assert any(run.replayed and len(run.chunk_tokens) == 40 for run in runs)  # 40 rows in the graph of 48


@pytest.mark.gpu
@pytest.mark.gpu_alone  # sizes itself from, and checks, the device's free memory: another process would move it
@NEEDS_CUDA
def test_the_kv_pool_and_the_graphs_stay_within_gpu_memory_utilization(reference_models):
    engine = gpu_engine(reference_models["llama"].folder, None, max_num_seqs=256, gpu_memory_utilization=0.05)
    runner = engine.runner
    kv_bytes = runner.kv_cache.numel() * runner.kv_cache.element_size()
    assert runner.graph_batch_sizes[-1] == 256
    assert 0 < runner.graph_memory_bytes <= runner.graph_reserve_bytes
    assert kv_bytes + runner.graph_reserve_bytes <= runner.memory_budget_bytes
    assert runner.memory_budget_bytes - runner.graph_reserve_bytes - kv_bytes < runner.block_bytes()
    # Device-wide: all the engine took once its weights were loaded.
    assert runner.free_bytes_after_load - free_device_bytes(runner.device) <= runner.memory_budget_bytes


@pytest.mark.gpu
@NEEDS_CUDA
def test_step_buffers_keep_no_token_once_a_request_leaves_the_batch_or_the_engine_is_idle(reference_models):
    engine = gpu_engine(reference_models["llama"].folder, True, num_blocks=64, block_size=4, max_num_seqs=8)
    buffers = engine.runner.graphs.buffers
    runs = record_runs(engine)
    for count, seed in ((3, 45), (6, 46), (12, 47)):  # finish at different steps: the batch shrinks to one
        engine.add_request(prompt_of(7, seed), greedy(count))
    sizes_checked = set()
    while engine.has_unfinished():
        engine.step()
        if runs[-1].replayed and engine.scheduler.has_work():
            rows = len(runs[-1].chunk_tokens)
            assert buffers.input_ids[:rows].tolist() == list(runs[-1].fed_tokens)  # the step's tokens are there
            assert rows_are_padding(buffers, bucket_for(rows, engine.runner.graph_batch_sizes))
            assert tables_outside_the_step_are_empty(buffers)
            sizes_checked.add(rows)
    assert sizes_checked == {1, 2, 3}
    assert rows_are_padding(buffers, 0)  # idle: nothing of any request stays

    request = engine.add_request(prompt_of(7, 48), greedy(20))
    for _ in range(3):
        engine.step()
    assert runs[-1].replayed and not rows_are_padding(buffers, 0)
    engine.abort(request)
    assert rows_are_padding(buffers, 0)  # cleared before abort returns


@pytest.mark.gpu
@NEEDS_CUDA
def test_no_freed_block_holds_residue_after_any_step_with_graphs(reference_models):
    engine = gpu_engine(reference_models["qwen3"].folder, True, num_blocks=24, block_size=4, max_num_batched_tokens=16)
    runs = record_runs(engine)
    for prompt, count in zip(random_prompts(10, 2, 30, seed=49), random_lengths(10, 1, 20, seed=50)):
        engine.add_request(prompt, greedy(count))
    while engine.has_unfinished():
        engine.step()
        assert engine.residue_check() == []
    assert engine.scheduler.num_preemptions > 0
    assert any(run.replayed for run in runs)
    assert int(engine.runner.kv_cache.count_nonzero()) == 0


# ----- on any machine -----------------------------------------------------------------------------------


def test_graph_batch_sizes_are_powers_of_two_then_the_largest():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(2) == [1, 2]
    assert graph_batch_sizes(48) == [1, 2, 4, 8, 16, 32, 48]
    assert graph_batch_sizes(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    with pytest.raises(EngineError):
        graph_batch_sizes(0)


def test_a_step_replays_the_smallest_graph_that_holds_it():
    sizes = graph_batch_sizes(48)
    assert [bucket_for(n, sizes) for n in (1, 2, 3, 5, 17, 33, 48, 49)] == [1, 2, 4, 8, 32, 48, 48, None]


@pytest.fixture
def decode_step() -> StepLists:
    """A real decode step of three sequences (contexts 6, 10 and 7 in blocks of 4), built by a CPU engine."""
    engine = tiny_engine(num_blocks=32, block_size=4, device="cpu")
    for length, seed in ((5, 51), (9, 52), (6, 53)):
        engine.add_request(prompt_of(length, seed), greedy(4))
    engine.step()
    return step_lists(engine.scheduler.schedule(), 4)


def test_padded_rows_write_no_slot_and_attend_to_no_block(decode_step):
    lists = decode_step
    assert lists.max_seqlen_q == 1 and lists.num_seqs == 3 and lists.context_lens == [6, 10, 7]
    rows = pad_decode_rows(lists, 4)
    assert rows.input_ids == lists.input_ids + [0]
    assert rows.positions == lists.positions + [0]
    assert rows.slot_mapping == lists.slot_mapping + [-1]
    assert rows.context_lens == lists.context_lens + [1]
    assert pad_decode_rows(lists, 3).slot_mapping == lists.slot_mapping
    with pytest.raises(EngineError):
        pad_decode_rows(lists, 2)


def test_a_real_decode_step_passes_the_checks(decode_step):
    check_decode_lists(decode_step, 32 * 4, 4)


def first_row(lists: StepLists, **values: int) -> StepLists:
    """lists with the first row's value of each named field replaced."""
    return replace(lists, **{name: [value] + getattr(lists, name)[1:] for name, value in values.items()})


STRAYS = {
    "slot outside the pool": lambda lists: first_row(lists, slot_mapping=32 * 4),
    "slot skipped": lambda lists: first_row(lists, slot_mapping=-1),
    "slot of another sequence": lambda lists: first_row(lists, slot_mapping=lists.slot_mapping[1]),
    "context without the new token": lambda lists: first_row(lists, context_lens=lists.positions[0]),
}


@pytest.mark.parametrize("stray", STRAYS.values(), ids=STRAYS.keys())
def test_a_decode_step_that_would_touch_another_slot_is_refused(decode_step, stray):
    with pytest.raises(EngineError, match="nothing ran"):
        check_decode_lists(stray(decode_step), 32 * 4, 4)


def step(input_ids: list[int], tables: list[list[int]], block_size: int = 4) -> StepLists:
    """A decode step with its new token at the start of each table's last block."""
    positions = [(len(table) - 1) * block_size for table in tables]
    width = max(map(len, tables))
    return StepLists(
        input_ids=input_ids, positions=positions,
        slot_mapping=[table[-1] * block_size for table in tables],
        cu_seqlens_q=list(range(len(tables) + 1)), context_lens=[p + 1 for p in positions],
        block_tables=[table + [-1] * (width - len(table)) for table in tables],
        sample_rows=list(range(len(tables))), max_seqlen_q=1,
    )


def load(buffers: StepBuffers, lists: StepLists, batch_size: int) -> None:
    """What the runner does with a decode step: pack it into one upload, send it, load the device views."""
    bridge = Bridge(buffers.input_ids.device)
    upload = bridge.upload()
    buffers.pack(upload, lists, batch_size)
    with bridge.counting() as counted:
        views = bridge.send(upload)
    assert (counted.h2d, counted.d2h) == (1, 0)
    buffers.load(views, torch.tensor(lists.block_tables, dtype=torch.int32), batch_size)  # as the device tables give them


def test_step_buffers_reset_what_the_previous_step_used_and_clear_to_padding():
    buffers = StepBuffers.allocate(8, 6, 4, torch.float32, torch.device("cpu"))
    assert rows_are_padding(buffers, 0)
    three = step([11, 12, 13], [[3, 5, 7], [2, 4], [9, 10, 11, 12]])
    load(buffers, three, 4)
    assert buffers.input_ids[:4].tolist() == [11, 12, 13, 0]
    assert buffers.slot_mapping[:4].tolist() == three.slot_mapping + [-1]
    assert buffers.context_lens[:4].tolist() == three.context_lens + [1]
    assert buffers.block_tables[:3, :4].tolist() == three.block_tables
    assert rows_are_padding(buffers, 3)  # the padded row and everything beyond it
    assert tables_outside_the_step_are_empty(buffers)
    buffers.hidden[:4] = 1.0  # what a replay of the graph of four leaves

    one = step([21], [[6]])
    load(buffers, one, 1)
    assert buffers.input_ids[:1].tolist() == [21]
    assert rows_are_padding(buffers, 1)  # nothing of the three-sequence step stays beyond the batch
    assert buffers.block_tables[0].tolist() == [6, -1, -1, -1, -1, -1]
    assert tables_outside_the_step_are_empty(buffers)

    buffers.hidden[:1] = 1.0
    buffers.clear()
    assert rows_are_padding(buffers, 0)


def test_graphs_are_off_on_a_cpu_and_refused_there_when_asked_for():
    engine = tiny_engine(num_blocks=8, block_size=4, device="cpu")
    assert engine.runner.graphs is None and engine.runner.graph_batch_sizes == []
    engine.runner.clear_step_buffers()  # nothing to clear: a no-op, not an error
    with pytest.raises(EngineError, match="cuda_graphs needs a CUDA device"):
        tiny_engine(num_blocks=8, block_size=4, device="cpu", cuda_graphs=True)


def test_graphs_need_the_triton_kernels():
    cuda = torch.device("cuda")  # only the backend choice is read: no device is touched
    with kernels.force("reference"):
        assert not cuda_graphs_enabled(EngineConfig(), cuda)
        with pytest.raises(EngineError, match="Triton"):
            cuda_graphs_enabled(EngineConfig(cuda_graphs=True), cuda)
    with kernels.force("triton"):
        assert cuda_graphs_enabled(EngineConfig(), cuda)
        assert cuda_graphs_enabled(EngineConfig(cuda_graphs=True), cuda)
        assert not cuda_graphs_enabled(EngineConfig(cuda_graphs=False), cuda)


@pytest.mark.parametrize("value", ["false", "true", 0, 1, "eager"])
def test_cuda_graphs_is_true_false_or_unset(value):
    with pytest.raises(EngineError, match="cuda_graphs"):
        EngineConfig(cuda_graphs=value)
    for accepted in (True, False, None):
        assert EngineConfig(cuda_graphs=accepted).cuda_graphs is accepted


def test_generate_eager_turns_graphs_off(capsys):
    base = ["generate", "--model", str(tiny_model_dir()), "Hello, world!", "--max-tokens", "4",
            "--kv-cache-gib", "0.01"]
    parser = build_parser()
    assert engine_config(parser.parse_args([*base, "--eager"])).cuda_graphs is False
    assert engine_config(parser.parse_args(base)).cuda_graphs is None
    from veil.cli import main

    assert main([*base, "--eager"]) == 0
    assert capsys.readouterr().out.strip()
