"""One crossing each way per step: counted on a CPU, where the bridge counts what a CUDA run would copy.

Every host<->device transfer of the engine goes through `engine.bridge`, which counts it; these tests
run real engines (eager, and the decode graphs' buffers filled through the same packing code with the
forward run over them eagerly) and read the count of every step. A test over the source checks that
no module of the engine or the kernels moves data between host and device anywhere else.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import EngineConfig, LLMEngine, PoolingKind, PoolingParams, SamplingParams
import engine.sampler as sampler_module
from engine.bridge import CrossingCount
from engine.bridge_profile import profile_copies, tally
from engine.cuda_graphs import DecodeGraphs
from engine.logits_processors import INTS as PROCESSOR_INTS
from engine.sampler import SETTINGS as SAMPLER_SETTINGS
from engine.sampling_tables import BIAS_INTS, DIFF_INTS
from tests.conftest import REPO_ROOT
from tests.engine_models import bridge_buffers, greedy, random_lengths, random_prompts, tiny_model_dir


@dataclass(frozen=True, slots=True)
class StepRecord:
    crossed: CrossingCount
    decode: bool  # every chunk added one token
    zeroed: int  # blocks freed and queued for zeroing in this step
    last: bool  # nothing was left to run after it


def engine(overlapped: bool, graphs: bool, **config) -> LLMEngine:
    config = {"num_blocks": 48, "block_size": 4, "max_num_seqs": 8, "max_num_batched_tokens": 64} | config
    llm = LLMEngine(tiny_model_dir(), EngineConfig(async_scheduling=overlapped, cuda_graphs=False, **config))
    if graphs:
        # The graph path's buffers and packing on a CPU: a graph for every batch size, so no row is padding
        # (the reference attention checks every row's blocks), each forward run eagerly over the buffers.
        runner = llm.runner
        sizes = list(range(1, 3 * config["max_num_seqs"] + 1))  # forked samples join beyond max_num_seqs
        runner.graphs = DecodeGraphs(runner.model, runner.kv_cache, sizes, runner.max_blocks_per_seq, capture=False)
    return llm


def run_recorded(llm: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[list[StepRecord], dict]:
    decode_flags: list[bool] = []
    run = llm.runner.run

    def recording_run(lists, *arguments):
        decode_flags.append(lists.max_seqlen_q == 1)
        return run(lists, *arguments)

    llm.runner.run = recording_run
    ids = [llm.add_request(prompt, p) for prompt, p in zip(prompts, params)]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    records = []
    while llm.has_unfinished():
        decode_flags.clear()
        scrubbed = llm.block_manager.blocks_scrubbed
        for delta in llm.step():
            tokens[delta.request_id] += delta.token_ids
        records.append(StepRecord(llm.runner.bridge.step.copy(), bool(decode_flags) and all(decode_flags),
                                  llm.block_manager.blocks_scrubbed - scrubbed, not llm.scheduler.has_work()))
    return records, tokens


SETTINGS = {
    "greedy": lambda n: greedy(n),
    "sampled": lambda n: SamplingParams(max_tokens=n, temperature=0.9, top_k=20, top_p=0.8, min_p=0.05, seed=7,
                                        ignore_eos=True),
    "logprobs": lambda n: greedy(n, logprobs=3),
    "n=3": lambda n: SamplingParams(max_tokens=n, temperature=0.7, n=3, seed=5, ignore_eos=True),
    # The logits processors' settings and the penalty slots' new prompt marks ride in the same upload.
    "penalized": lambda n: SamplingParams(max_tokens=n, temperature=0.8, n=2, seed=3, ignore_eos=True,
                                          presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2,
                                          logit_bias=((5, 2.0), (9, -1.0))),
}


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-buffers"])
@pytest.mark.parametrize("overlapped", [False, True], ids=["synchronous", "async"])
@pytest.mark.parametrize("kind", list(SETTINGS))
def test_a_decode_step_crosses_once_each_way_and_any_step_at_most_once(kind, overlapped, graphs):
    prompts = random_prompts(5, 3, 14, seed=31)
    lengths = random_lengths(5, 2, 12, seed=32)  # requests end at different steps: blocks are freed mid-run
    params = [SETTINGS[kind](n) for n in lengths]
    llm = engine(overlapped, graphs)
    records, tokens = run_recorded(llm, prompts, params)

    running = [r for r in records if not r.last]
    decode = [r for r in running if r.decode]
    assert decode and all((r.crossed.h2d, r.crossed.d2h) == (1, 1) for r in decode)
    assert all(r.crossed.h2d == 1 and r.crossed.d2h <= 1 for r in running)  # prefill and mixed steps
    # Blocks freed in a step are zeroed by the next step's upload, which stays the only one.
    assert any(r.zeroed for r in running[:-1])
    # The step after which nothing runs crosses once more to zero what it freed: no step is coming to carry it.
    assert records[-1].crossed.h2d <= 2 and records[-1].crossed.d2h <= 1
    if graphs:
        assert llm.runner.graphs.replays >= len(decode)
    assert llm.residue_check() == []
    assert [len(t) for t in tokens.values()] == [n * params[0].n for n in lengths]


def record_segments(llm: LLMEngine) -> list[dict[str, int]]:
    """Every upload's segments and their byte sizes, in send order."""
    sent: list[dict[str, int]] = []
    send = llm.runner.bridge.send

    def recording_send(upload):
        sent.append({name: segment.nbytes for name, segment in upload.segments.items()})
        return send(upload)

    llm.runner.bridge.send = recording_send
    return sent


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-buffers"])
@pytest.mark.parametrize("overlapped", [False, True], ids=["synchronous", "async"])
@pytest.mark.parametrize("kind", ["sampled", "n=3", "penalized", "logprobs"])
def test_a_samples_settings_cross_once_and_decode_steps_carry_only_the_row_map(kind, overlapped, graphs):
    """Settings, seeds and positions live on the device (`engine.sampling_tables`): each sample's are
    written at its first pick, requests admitted mid-run included, and each pick advances its position
    there, so later steps carry none of them (and penalized rows none of their penalty values)."""
    prompts = random_prompts(5, 3, 14, seed=35)
    lengths = random_lengths(5, 4, 12, seed=36)
    params = [SETTINGS[kind](n) for n in lengths]
    llm = engine(overlapped, graphs, max_num_seqs=4)  # five requests, four at a time: one is admitted mid-run
    sent = record_segments(llm)
    records, tokens = run_recorded(llm, prompts, params)
    written = sum(segment.get(DIFF_INTS, 0) for segment in sent) // (4 * 8)  # (slot, top-k, seed, position)
    slotted = 0 if kind == "logprobs" else len(prompts) * params[0].n  # greedy without penalties holds no slot
    assert written == slotted
    assert sum(DIFF_INTS in segment for segment in sent) <= (2 if slotted else 0)  # at the start and the admission
    if kind == "penalized":  # the bias entries too cross once per sample, with its settings
        assert sum(segment.get(BIAS_INTS, 0) for segment in sent) // (3 * 8) == slotted * len(params[0].logit_bias)
        for segment in sent:
            if SAMPLER_SETTINGS in segment and DIFF_INTS not in segment:  # a step with no new sample
                rows = segment[SAMPLER_SETTINGS] // (2 * 4)  # int32: each row's logits row and slot
                # Which rows are biased, which penalized and their count slots: no value of either.
                assert segment[PROCESSOR_INTS] == 3 * rows * 8
    assert [len(t) for t in tokens.values()] == [n * params[0].n for n in lengths]
    tables = llm.sampler.tables
    assert tables.held == 0 and not tables.ints.any() and not tables.floats.any()


@pytest.mark.parametrize("overlapped", [False, True], ids=["synchronous", "async"])
def test_the_graph_buffers_pick_what_the_eager_path_picks(overlapped):
    prompts = random_prompts(6, 3, 12, seed=41)
    params = [greedy(n) for n in random_lengths(6, 3, 10, seed=42)]
    _, eager = run_recorded(engine(overlapped, graphs=False), prompts, params)
    graphed_engine = engine(overlapped, graphs=True)
    _, graphed = run_recorded(graphed_engine, prompts, params)
    assert graphed_engine.runner.graphs.replays > 0
    assert list(eager.values()) == list(graphed.values())


def test_freed_blocks_are_zeroed_before_reuse_when_they_ride_in_the_next_upload():
    # A pool so small that every new request takes blocks freed in the step before.
    llm = engine(overlapped=True, graphs=False, num_blocks=8, max_num_seqs=2)
    prompts = random_prompts(6, 5, 7, seed=51)
    records, tokens = run_recorded(llm, prompts, [greedy(6)] * 6)
    expected = engine(overlapped=False, graphs=False)
    assert list(tokens.values()) == [expected.generate([p], greedy(6))[0].outputs[0].token_ids for p in prompts]
    assert llm.block_manager.blocks_scrubbed > llm.block_manager.num_blocks  # blocks were reused
    assert llm.residue_check() == []


def test_the_residue_count_comes_back_in_the_steps_own_download():
    from engine.accounting import ZeroingAccount

    llm = engine(overlapped=True, graphs=False)
    account = ZeroingAccount(llm.block_manager, llm.runner)
    for prompt, n in zip(random_prompts(4, 3, 8, seed=61), (3, 5, 7, 9)):
        llm.add_request(prompt, greedy(n))
    while llm.scheduler.has_work():
        llm.step()
        before = llm.runner.bridge.total.copy()
        account.check()  # queued: crosses with the next step
        assert llm.runner.bridge.total == before
    report = account.take(0)
    assert report.blocks > 0 and report.residue == 0


def test_a_toll_on_every_crossing_changes_no_token():
    prompts = random_prompts(3, 3, 8, seed=71)
    params = [greedy(4)] * 3
    plain = engine(overlapped=True, graphs=False)
    tolled = engine(overlapped=True, graphs=False, bridge_toll_us=200)
    assert tolled.runner.bridge.toll.seconds == 200e-6
    assert [o.outputs[0].token_ids for o in tolled.generate(prompts, params)] == \
        [o.outputs[0].token_ids for o in plain.generate(prompts, params)]


@pytest.mark.parametrize("drafts", ["ngram", "draft-model"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-buffers"])
@pytest.mark.parametrize("kind", ["greedy", "sampled", "n=3"])
def test_a_speculative_step_crosses_once_each_way(kind, graphs, drafts):
    """Drafts, their settings and the plain rows' go up in the step's one upload (a draft model's inputs for
    all its forwards too, its picks staying on the device); emitted tokens come back in one download."""
    # Each prompt twice over: prompt lookup finds its last tokens in the first copy and drafts from the
    # first decode step on, whatever the samples then draw.
    prompts = [prompt + prompt for prompt in random_prompts(5, 3, 14, seed=33)]
    lengths = random_lengths(5, 8, 24, seed=34)
    params = [SETTINGS[kind](n) for n in lengths]
    speculative = "ngram" if drafts == "ngram" else f"draft:{tiny_model_dir()}"
    llm = engine(False, graphs, speculative=speculative, num_speculative_tokens=3)
    records, tokens = run_recorded(llm, prompts, params)
    running = [r for r in records if not r.last]
    assert llm.speculation.steps > 0
    assert all((r.crossed.h2d, r.crossed.d2h) == (1, 1) for r in running)
    assert records[-1].crossed.h2d <= 2 and records[-1].crossed.d2h <= 1
    assert [len(t) for t in tokens.values()] == [n * params[0].n for n in lengths]
    assert llm.residue_check() == []


# ----- embeddings: their vectors ride the step's one download -----------------------------------------------

def embedding_params(count: int) -> list[PoolingParams]:
    """Full and truncated vectors, last-token and mean pooled: the segment is cut by each request's length."""
    return [PoolingParams(PoolingKind.MEAN if i % 2 else PoolingKind.LAST, dimensions=None if i % 3 else 8)
            for i in range(count)]


@dataclass(frozen=True, slots=True)
class EmbeddingStep:
    crossed: CrossingCount
    finished_floats: int  # the lengths of the vectors the step finished, summed
    last: bool


def run_embeddings(llm: LLMEngine, prompts: list[list[int]], pooling: list[PoolingParams],
                   generated: list[list[int]]) -> tuple[list[EmbeddingStep], dict[str, list[float]]]:
    """Steps until every request ends (`generated`: greedy requests beside): each step's crossings with the
    floats of the embeddings it finished, and every vector, by request id."""
    hidden = llm.model_config.hidden_size
    sequences = {llm.add_embedding(p, params): (params.dimensions or hidden) for p, params in zip(prompts, pooling)}
    sequences = {llm._requests[rid].sequences[0]: size for rid, size in sequences.items()}
    for prompt in generated:
        llm.add_request(prompt, greedy(6))
    steps, vectors, done = [], {}, set()
    while llm.has_unfinished():
        with llm.runner.bridge.counting() as counted:
            llm.step_tokens()
        newly = [seq for seq in sequences if seq.is_finished and seq not in done]
        done.update(newly)
        steps.append(EmbeddingStep(counted, sum(sequences[seq] for seq in newly), not llm.scheduler.has_work()))
        vectors.update((output.request_id, output.embedding) for output in llm.take_embeddings())
    assert len(done) == len(sequences) == len(vectors)
    return steps, vectors


@pytest.mark.parametrize("beside", [False, True], ids=["alone", "beside-generation"])
@pytest.mark.parametrize("overlapped", [False, True], ids=["synchronous", "async"])
def test_a_step_that_finishes_embeddings_brings_their_vectors_in_its_one_download(overlapped, beside):
    """The finished vectors are a float32 segment of the step's download: a step that only embeds crosses
    down exactly once, with their bytes alone, and a step beside generation still crosses down once."""
    prompts = random_prompts(6, 3, 30, seed=81)  # several chunks of 16 tokens for the longer ones
    pooling = embedding_params(len(prompts))
    generated = random_prompts(3, 3, 10, seed=82) if beside else []
    llm = engine(overlapped, graphs=False, max_num_batched_tokens=16)
    steps, vectors = run_embeddings(llm, prompts, pooling, generated)

    finishing = [step for step in steps if step.finished_floats]
    assert len(finishing) >= 2  # not all in one step: chunked prompts end at different steps
    assert all(step.crossed.d2h == 1 for step in finishing)
    assert all(step.crossed.h2d == 1 for step in steps if not step.last)
    assert steps[-1].crossed.h2d <= 2 and steps[-1].crossed.d2h <= 1
    for step in finishing:
        if beside:  # with the picks when the step has any
            assert step.crossed.d2h_bytes >= 4 * step.finished_floats
        else:  # nothing else to read: the segment, and no other crossing down in any step
            assert step.crossed.d2h_bytes == 4 * step.finished_floats
    if not beside:
        assert all(step.crossed.d2h == 0 for step in steps if not step.finished_floats)
    # The same vectors however they crossed: synchronously, alone, one step later, beside generation.
    expected = engine(False, graphs=False).embed(prompts, PoolingParams(PoolingKind.MEAN))
    for rid, params, prompt in zip(vectors, pooling, prompts):
        if params.kind is PoolingKind.MEAN and params.dimensions is None:
            assert torch.allclose(torch.tensor(vectors[rid]), torch.tensor(expected[prompts.index(prompt)]),
                                  atol=1e-5)
    assert llm.residue_check() == []


@pytest.mark.parametrize("overlapped", [False, True], ids=["synchronous", "async"])
def test_nothing_of_a_vector_stays_in_the_bridge_once_read(overlapped):
    """The vectors' bytes are zeroed in the device buffer they were packed in and in the pinned slot they
    were copied to, and their values are taken out of the download: later steps, which write fewer bytes
    there, would leave them for good."""
    llm = engine(overlapped, graphs=False)
    steps, vectors = run_embeddings(llm, random_prompts(4, 3, 20, seed=83), embedding_params(4), [])
    bridge = llm.runner.bridge
    used = max(step.crossed.d2h_bytes for step in steps)  # every download starts at the buffers' first byte
    assert used > 0 and all(any(v) for v in vectors.values())
    # Only embeddings crossed down here: every byte the downloads used is zero again.
    assert int(bridge._device_out.tensor[:used].count_nonzero()) == 0
    for slot in bridge._slots:
        assert int(slot.staging.tensor[:used].count_nonzero()) == 0
        assert slot.reader is None or slot.reader.values() == {}


CANARY = [501, 17, 333, 402, 219, 488, 77, 310, 499, 123, 456, 208]  # a prompt whose ids are looked for


def holds_canary(tensor: torch.Tensor, run: int = 3) -> bool:
    """Whether a buffer's bytes hold `run` of the canary prompt's ids side by side, in any dtype they may
    cross as: later steps write over the start of what the prefill left, not over its end."""
    raw = tensor.cpu().numpy().tobytes()  # on CUDA a copy made after the run, outside any counted step
    windows = [CANARY[start : start + run] for start in range(len(CANARY) - run + 1)]
    return any(np.array(ids, dtype).tobytes() in raw for ids in windows for dtype in (np.int64, np.int32, np.float64))


def step_tokens(llm: LLMEngine, tokens: dict[str, list[int]]) -> None:
    for delta in llm.step():
        tokens.setdefault(delta.request_id, []).extend(delta.token_ids)


# How the canary's request ends: it runs out, it is aborted, or a step raises and the request is aborted.
ENDINGS = ["finished", "aborted", "failed"]


@pytest.mark.parametrize("ending", ENDINGS)
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-buffers"])
@pytest.mark.parametrize("overlapped", [False, True], ids=["synchronous", "async"])
def test_nothing_of_a_request_stays_in_the_bridge_once_the_engine_is_idle(overlapped, graphs, ending):
    """Its prompt's ids went up in an upload, its picks and logprobs came down in downloads: once the engine
    has nothing to run, every byte of every buffer of the bridge is zero again, host and device side, and
    the bridge holds no download's values, even those of steps that raised before they were read."""
    assert_the_bridge_forgets_the_canary(engine(overlapped, graphs), ending)


def assert_the_bridge_forgets_the_canary(llm: LLMEngine, ending: str) -> None:
    request_id = llm.add_request(CANARY, greedy(8, logprobs=2))
    tokens: dict[str, list[int]] = {}
    for _ in range(3):  # the prefill and two decode steps
        step_tokens(llm, tokens)
    if ending == "failed":
        fail_a_step(llm)
    if ending in ("aborted", "failed"):
        llm.abort(request_id)  # after a failed step, what the engine core does (`EngineCore._fail_all`)
    while llm.has_unfinished():
        step_tokens(llm, tokens)
    assert tokens[request_id] and not llm.scheduler.has_work()
    if llm.runner.device.type == "cuda":
        torch.cuda.synchronize()  # the scrub's memsets are queued on the stream; the check reads after them
    bridge = llm.runner.bridge
    for name, tensor in bridge_buffers(bridge).items():
        assert not holds_canary(tensor), f"the prompt's ids stay in the bridge's {name}"
        assert int(tensor.count_nonzero()) == 0, f"the bridge's {name} keeps bytes of a finished request"
    assert all(slot.reader is None for slot in bridge._slots), "the bridge keeps a download's picks and logprobs"


def fail_a_step(llm: LLMEngine) -> None:
    """Makes the next step raise after its picks are fetched, where it reads picks (a device lost): with async
    scheduling it drops, unread, both its own download and that of the step in flight, which the worker drains."""
    def failing_read(copy):
        raise RuntimeError("device lost")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sampler_module, "_to_host", failing_read)
        with pytest.raises(RuntimeError, match="device lost"):
            llm.step()


@pytest.mark.parametrize("overlapped", [False, True], ids=["synchronous", "async"])
def test_a_finished_requests_prompt_leaves_the_bridge_while_others_still_run(overlapped):
    """Later steps cross fewer bytes than its prefill did, so what they write over would not reach the
    canary's ids: each upload is zeroed once it has landed, and the device buffer's tail at the next send."""
    llm = engine(overlapped, graphs=False)
    canary_id = llm.add_request(CANARY * 3, greedy(2))  # its prefill's ids reach past what decode steps write
    other_id = llm.add_request([5, 6], greedy(30))
    tokens: dict[str, list[int]] = {}
    while len(tokens.get(canary_id, [])) < 2 or llm.runner.bridge.steps < 6:
        step_tokens(llm, tokens)
    assert llm.scheduler.has_work() and len(tokens[other_id]) < 30  # the other request still runs
    for name, tensor in bridge_buffers(llm.runner.bridge).items():
        assert not holds_canary(tensor), f"a finished request's prompt stays in the bridge's {name}"


def test_an_embedding_finished_in_a_step_that_waits_for_a_constrained_token_rides_its_picks_download():
    """Async: a step whose constrained sample waits for its token picks in a crossing each way of its own
    (`ForwardOnly`); an embedding its forward finishes rides that download, so the step still crosses down once."""
    from tests.test_engine_structured import SCHEMA, SMALL_POOL, constrained, json_schema

    llm = LLMEngine(tiny_model_dir(), EngineConfig(async_scheduling=True, **SMALL_POOL))
    llm.add_request("Hello", constrained(json_schema(SCHEMA), max_tokens=60, seed=1))
    for _ in range(3):  # past the prefill: every step now waits for the constrained sample's token
        llm.step()
    prompt = random_prompts(1, 5, 5, seed=84)[0]
    request_id = llm.add_embedding(prompt, PoolingParams(PoolingKind.MEAN))
    llm.step()  # its one chunk runs and finishes in a waiting step
    crossed = llm.runner.bridge.step
    assert (crossed.h2d, crossed.d2h) == (2, 1)
    assert crossed.d2h_bytes > 4 * llm.model_config.hidden_size
    assert llm.take_embeddings() == []  # read with its step, in the next one
    llm.step()
    [output] = llm.take_embeddings()
    expected = engine(False, graphs=False).embed([prompt], PoolingParams(PoolingKind.MEAN))[0]
    assert output.request_id == request_id
    assert torch.allclose(torch.tensor(output.embedding), torch.tensor(expected), atol=1e-5)
    while llm.has_unfinished():
        llm.step()
    assert llm.residue_check() == []


# ----- the source: no transfer outside the bridge ------------------------------------------------------

SCANNED = ("engine", "kernels")
BRIDGE = "engine/bridge.py"
HOST_READS = {"cpu", "item", "tolist", "numpy", "pin_memory"}
# Every transfer outside the bridge that the scan finds, with why it never crosses on the engine's path.
ALLOWED = {
    ("kernels/reference.py", "zero_blocks", "to"): "ids already on the cache's device (the engine's come through "
                                                   "its bridge); only the dtype changes",
    ("kernels/reference.py", "mark_residue", "to"): "as for zero_blocks",
    ("kernels/reference.py", "_plan", "tolist"): "paged_attention's plan: the reference kernels are the CPU path "
                                                 "and the test oracle: on CUDA the engine runs Triton's",
    ("kernels/reference.py", "paged_attention_per_sequence", "tolist"): "the test oracle, never the engine's path",
    ("kernels/validation.py", "_check_sequence_values", "tolist"): "called only for CPU tensors",
    ("kernels/dispatch.py", "find_residue", "to"): "a kernel API for tests and tools: the engine checks residue "
                                                   "through its bridge (ModelRunner.find_residue)",
    ("kernels/dispatch.py", "find_residue", "tolist"): "as above",
    ("kernels/dispatch.py", "_upload", "to"): "host ids from tests and tools; the engine passes ids it uploaded "
                                              "(ids_in_range) and never reaches this",
    ("kernels/dispatch.py", "_upload", "pin_memory"): "as above",
    ("kernels/paged_batch.py", "build_paged_batch", "tolist"): "builds random batches for kernel tests and "
                                                               "benchmarks, not on the engine's path",
    ("kernels/paged_batch.py", "build_paged_batch", "to"): "as above",
    ("kernels/paged_batch.py", "build_paged_batch", "tensor"): "as above",
    ("engine/structured.py", "masks", "numpy"): "a host tensor: the grammar masks are filled on the host and "
                                                "cross in the step's upload",
}


@dataclass(frozen=True, slots=True)
class Transfer:
    path: str
    function: str
    call: str
    line: int


def transfers_in(path: Path) -> list[Transfer]:
    return transfers_in_source(path.read_text(encoding="utf-8"), path.relative_to(REPO_ROOT).as_posix())


def transfers_in_source(source: str, relative: str) -> list[Transfer]:
    """Calls in the source that move tensor data between host and device, by the enclosing function."""
    found: list[Transfer] = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            if isinstance(child, ast.Call):
                call = _transfer_call(child)
                if call is not None:
                    found.append(Transfer(relative, function, call, child.lineno))
            visit(child, inner)

    visit(ast.parse(source), "<module>")
    return found


def _transfer_call(call: ast.Call) -> str | None:
    func = call.func
    if not isinstance(func, ast.Attribute):
        return None
    if func.attr in HOST_READS:
        return func.attr
    if func.attr == "to" and _names_a_device(call):
        return "to"
    if func.attr in ("tensor", "as_tensor") and any(k.arg == "device" for k in call.keywords):
        return "tensor"  # host values built straight onto a device
    return None


def _names_a_device(call: ast.Call) -> bool:
    """.to(...) given a device (by keyword, a device-named value, a string, or torch.device(...))."""
    if any(k.arg == "device" for k in call.keywords):
        return True
    for arg in call.args:
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            return True
        name = arg.attr if isinstance(arg, ast.Attribute) else arg.id if isinstance(arg, ast.Name) else ""
        if "device" in name.lower():
            return True
        if isinstance(arg, ast.Call) and isinstance(arg.func, ast.Attribute) and arg.func.attr == "device":
            return True
    return False


def scanned_files() -> list[Path]:
    files = [path for package in SCANNED for path in sorted((REPO_ROOT / package).rglob("*.py"))]
    # Triton kernels' `.to(tl.float32)` are casts inside a kernel, not transfers.
    return [path for path in files if path.relative_to(REPO_ROOT).as_posix() != BRIDGE
            and not path.name.startswith("triton_")]


def test_no_module_of_the_engine_or_the_kernels_transfers_outside_the_bridge():
    found = [t for path in scanned_files() for t in transfers_in(path)]
    stray = [t for t in found if (t.path, t.function, t.call) not in ALLOWED]
    assert stray == [], "transfers outside engine/bridge.py: " + ", ".join(
        f"{t.path}:{t.line} {t.function}() .{t.call}" for t in stray)
    unused = set(ALLOWED) - {(t.path, t.function, t.call) for t in found}
    assert unused == set(), f"allow-list entries that match nothing any more: {sorted(unused)}"


@pytest.mark.parametrize("source", [
    "def f(x, device):\n    return x.to(device)\n",
    "def f(x):\n    return x.to(x.device, non_blocking=True)\n",
    "def f(x):\n    return x.cpu()\n",
    "def f(x):\n    return x.item()\n",
    "def f(x):\n    return x.tolist()\n",
    "def f(values, device):\n    return torch.tensor(values, device=device)\n",
    "def f(x):\n    return x.to('cuda')\n",
])
def test_the_scan_finds_each_kind_of_transfer(source):
    [transfer] = transfers_in_source(source, "engine/probe.py")
    assert transfer.function == "f"


def test_the_scan_lets_dtype_casts_and_device_side_fills_be():
    source = ("def f(x):\n    return x.to(torch.int64), x.to(dtype=torch.float32), x.float(), "
              "torch.zeros(3, device=x.device)\n")
    assert transfers_in_source(source, "engine/probe.py") == []


def test_veil_node_passes_its_bridge_toll_to_the_engine():
    from enclave.cli import node_settings
    from enclave.node import engine_config as node_engine_config
    from enclave.selfcheck import EngineLimits
    from veil.cli import build_parser

    node = ["node", "--model", str(tiny_model_dir())]
    limits = EngineLimits(max_model_len=512, kv_cache_gib=0.05)
    parser = build_parser()
    assert node_engine_config(node_settings(parser.parse_args(node)), limits).bridge_toll_us == 0
    tolled = node_settings(parser.parse_args([*node, "--bridge-toll-us", "300"]))
    assert node_engine_config(tolled, limits).bridge_toll_us == 300


def test_the_engine_reports_its_crossings_per_step_and_in_total():
    llm = engine(overlapped=False, graphs=False)
    llm.add_request([5, 6, 7], greedy(4))
    llm.step()
    llm.step()
    stats = llm.bridge_stats()
    assert (stats.last_step.h2d, stats.last_step.d2h) == (1, 1) and stats.last_step.h2d_bytes > 0
    assert stats.steps == 2 and stats.total.h2d >= 2 and stats.total.d2h == 2


# ----- the count the device itself makes (CUDA profiler) ---------------------------------------------------

# Copy names as the profiler gives them ("Memcpy <kind> (<source> -> <destination>)"), among a step's other
# events: kernels, memsets, device-to-device copies and the runtime calls that queued the copies.
PROFILED_STEP = [
    "Memcpy HtoD (Pinned -> Device)", "Memcpy DtoD (Device -> Device)", "Memset (Device)",
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", "cudaMemcpyAsync",
    "aten::copy_", "Memcpy DtoH (Device -> Pinned)",
]


def test_the_profiled_crossings_are_the_host_device_copies_alone():
    copies = tally(PROFILED_STEP * 3)
    assert (copies.h2d, copies.d2h, copies.pageable) == (3, 3, 0)
    assert dict(copies.kinds) == {"Memcpy HtoD (Pinned -> Device)": 3, "Memcpy DtoH (Device -> Pinned)": 3,
                                  "Memcpy DtoD (Device -> Device)": 3}
    assert "Memcpy DtoD (Device -> Device) x3" in copies.describe()


def test_a_copy_through_pageable_memory_is_counted_and_flagged():
    # What `.item()` or a tensor built from a Python list does: the driver stages it again.
    copies = tally(PROFILED_STEP + ["Memcpy DtoH (Device -> Pageable)", "Memcpy HtoD (Pageable -> Device)"])
    assert (copies.h2d, copies.d2h, copies.pageable) == (2, 2, 2)
    assert tally(["cudaMemcpyAsync", "Memset (Device)"]).describe() == "no copies"


def cuda_engine(overlapped: bool, graphs: bool) -> LLMEngine:
    return LLMEngine(tiny_model_dir(), EngineConfig(device="cuda", async_scheduling=overlapped, cuda_graphs=graphs,
                                                    num_blocks=96, block_size=4, max_num_seqs=8,
                                                    max_num_batched_tokens=64))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("overlapped", [False, True], ids=["synchronous", "async"])
def test_on_cuda_the_device_copies_once_each_way_per_decode_step_as_the_bridge_counts(overlapped, graphs):
    llm = cuda_engine(overlapped, graphs)
    ids = [llm.add_request(prompt, greedy(40)) for prompt in random_prompts(6, 3, 14, seed=41)]
    while llm.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in llm.scheduler.running):
        llm.step()
    llm.step()
    steps = 12
    with llm.runner.bridge.counting() as counted:
        copies = profile_copies(lambda: [llm.step() for _ in range(steps)])
    assert (copies.h2d, copies.d2h) == (counted.h2d, counted.d2h) == (steps, steps), copies.describe()
    assert copies.pageable == 0, copies.describe()
    if graphs:
        assert llm.runner.graphs is not None and llm.runner.graphs.replays >= steps
    for request_id in ids:
        llm.abort(request_id)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", list(SETTINGS))
def test_on_cuda_every_copy_of_a_whole_run_is_one_the_bridge_counted(kind):
    # Prefill, mixed and decode steps, blocks freed and zeroed, the residue check: whatever the settings ask,
    # no library call inside the engine copies behind the bridge's back, and nothing goes through pageable memory.
    llm = cuda_engine(overlapped=True, graphs=True)
    params = [SETTINGS[kind](n) for n in random_lengths(5, 2, 12, seed=42)]
    prompts = random_prompts(5, 3, 14, seed=43)
    with llm.runner.bridge.counting() as counted:
        copies = profile_copies(lambda: (llm.generate(prompts, params), llm.residue_check()))
    assert counted.h2d > 0 and (copies.h2d, copies.d2h) == (counted.h2d, counted.d2h), copies.describe()
    assert copies.pageable == 0, copies.describe()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("overlapped", [False, True], ids=["synchronous", "async"])
def test_on_cuda_an_embedding_run_copies_only_what_the_bridge_counted(overlapped):
    # Finished vectors come back in their step's download: no copy of its own, none through pageable memory.
    llm = cuda_engine(overlapped, graphs=True)
    prompts = random_prompts(6, 3, 30, seed=85)
    with llm.runner.bridge.counting() as counted:
        copies = profile_copies(lambda: llm.embed(prompts, PoolingParams(PoolingKind.MEAN, dimensions=8)))
    assert counted.d2h > 0 and (copies.h2d, copies.d2h) == (counted.h2d, counted.d2h), copies.describe()
    assert copies.pageable == 0, copies.describe()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("ending", ENDINGS)
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("overlapped", [False, True], ids=["synchronous", "async"])
def test_on_cuda_nothing_of_a_request_stays_in_the_bridge_once_the_engine_is_idle(overlapped, graphs, ending):
    # Pinned host buffers zeroed once their copies landed (events), device buffers by memsets queued after the
    # steps and graph replays that read them: what the CPU test checks, with real streams and pinned memory.
    assert_the_bridge_forgets_the_canary(cuda_engine(overlapped, graphs), ending)
