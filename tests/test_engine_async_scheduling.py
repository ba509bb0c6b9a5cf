"""Async scheduling: step N+1 is launched before step N's picks are read, and nothing a caller sees changes.

On a CPU every op runs when it is called, so both orders compute the same tensors; what differs is the
bookkeeping (pending tokens, placeholders filled from the in-flight picks, dropped overshoot picks,
blocks freed while a launched step still holds them), which is what these tests hold to the synchronous
engine, to `transformers`, and to the zero-on-free guarantees.
"""

from __future__ import annotations

from dataclasses import dataclass
from multiprocessing import Pipe

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import engine.sampler as sampler_module
from engine import EngineConfig, EngineError, LLMEngine, RequestOutput, SamplingParams, UnknownRequestError
from enclave.cli import node_settings
from enclave.node import engine_config as node_engine_config
from enclave.selfcheck import EngineLimits
from engine.accounting import ZeroingAccount
from engine.bridge import Download
from engine.cli import engine_config as generate_config
from engine.core import AddRequest, EngineCore, Refused
from engine.core_client import EngineCoreClient
from engine.overlap import async_scheduling_enabled, fill_placeholders, placeholder
from engine.sequence import FinishReason, Sequence
from tests.engine_models import (  # noqa: F401 (fixtures)
    VOCAB_SIZE,
    greedy,
    hf_greedy,
    one_torch_thread,
    only_the_read_may_wait,
    random_lengths,
    random_prompts,
    reference_model,
    staging_in_use_is_pinned,
    tiny_model_dir,
)
from veil.cli import build_parser

# 24 blocks of 4 tokens and 32 tokens a step: prompts are prefilled in chunks and the batch preempts.
TIGHT = {"num_blocks": 24, "block_size": 4, "max_num_batched_tokens": 32}


def engine(model_dir=None, *, overlapped: bool, **config) -> LLMEngine:
    return LLMEngine(model_dir or tiny_model_dir(), EngineConfig(async_scheduling=overlapped, **config))


def outputs(llm: LLMEngine, prompts: list, params: list[SamplingParams]) -> tuple[list, list[float]]:
    """Everything a caller can see of each request: per sample its ids, text, end, logprob ids and usage;
    and apart, every logprob value in order.

    The values are compared within a tolerance: the two engines batch rows differently (preemptions fall
    elsewhere), and fp32 matrix products over different batches differ in the last bits.
    """
    visible, values = [], []
    for output in llm.generate(prompts, params):
        samples = []
        for s in output.outputs:
            samples.append((s.index, s.token_ids, s.text, s.finish_reason,
                            [(p.token_id, [t for t, _ in p.top]) for p in s.logprobs]))
            values += [v for p in s.logprobs for v in (p.logprob, *(v for _, v in p.top))]
        visible.append((samples, output.metrics.prompt_tokens, output.metrics.output_tokens))
    return visible, values


def assert_same_outputs(got: tuple[list, list[float]], expected: tuple[list, list[float]]) -> None:
    assert got[0] == expected[0]
    assert got[1] == pytest.approx(expected[1], abs=1e-4)


def assert_clean(llm: LLMEngine) -> None:
    """Nothing left: no request, no step in flight, every block free and all zeros."""
    assert not llm.has_unfinished() and llm._in_flight is None
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    assert llm.residue_check() == []


def mixed_workload() -> tuple[list, list[SamplingParams]]:
    prompts = random_prompts(12, 3, 40, seed=5)
    params = (
        [greedy(4 + 3 * i) for i in range(4)]
        + [SamplingParams(max_tokens=18, temperature=0.9, top_p=0.9, seed=i, n=2, ignore_eos=True) for i in range(3)]
        + [SamplingParams(max_tokens=16, temperature=0.0, logprobs=3, ignore_eos=True)] * 2
        + [SamplingParams(max_tokens=30, temperature=0.0, stop=("a", "e"))] * 2
        + [SamplingParams(max_tokens=25, temperature=0.7, seed=99, min_p=0.05)]
    )
    return prompts, params


# ----- the same answers -------------------------------------------------------------------------


@pytest.mark.parametrize("config", [{}, TIGHT], ids=["roomy", "chunked-and-preempting"])
def test_overlapped_steps_give_callers_exactly_what_synchronous_steps_give(config):
    prompts, params = mixed_workload()
    synchronous = engine(overlapped=False, **config)
    overlapped = engine(overlapped=True, **config)

    expected = outputs(synchronous, prompts, params)
    got = outputs(overlapped, prompts, params)

    assert_same_outputs(got, expected)
    assert len(got[1]) > 100  # the logprobs were compared too
    assert overlapped.async_scheduling and not synchronous.async_scheduling
    if config:
        assert overlapped.scheduler.num_preemptions > 0 and synchronous.scheduler.num_preemptions > 0
    assert_clean(overlapped)


def test_overlapped_greedy_tokens_equal_transformers_under_preemption_and_chunked_prefill():
    reference = reference_model("llama")
    prompts = random_prompts(10, 5, 60, seed=17)
    lengths = random_lengths(10, 4, 24, seed=18)
    llm = engine(reference.folder, overlapped=True, **TIGHT)

    got = [o.outputs[0].token_ids for o in llm.generate(prompts, [greedy(n) for n in lengths])]

    assert llm.scheduler.num_preemptions > 0
    assert got == [hf_greedy(reference.model, p, n) for p, n in zip(prompts, lengths)]
    assert_clean(llm)


def test_a_stop_token_ends_the_sample_and_the_pick_launched_past_it_is_dropped():
    prompt = random_prompts(1, 8, 8, seed=41)[0]
    free_run = engine(overlapped=False).generate([prompt], greedy(12))[0].outputs[0].token_ids
    stop_at = next(i for i in range(3, 12) if free_run[i] not in free_run[:i])  # a token not seen before it
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=(free_run[stop_at],))
    synchronous, overlapped = engine(overlapped=False), engine(overlapped=True)

    expected = synchronous.generate([prompt], params)[0].outputs[0]
    got = overlapped.generate([prompt], params)[0].outputs[0]

    assert got.token_ids == expected.token_ids == free_run[:stop_at]
    assert got.finish_reason == expected.finish_reason == FinishReason.STOP
    # The overlapped engine had already launched the step after the stop token: one token computed, dropped.
    assert overlapped.num_tokens_computed == synchronous.num_tokens_computed + 1
    assert_clean(overlapped)


def test_max_tokens_is_never_overshot():
    prompts = random_prompts(6, 4, 30, seed=7)
    params = [greedy(n) for n in random_lengths(6, 1, 20, seed=8)]
    synchronous, overlapped = engine(overlapped=False), engine(overlapped=True)

    assert_same_outputs(outputs(overlapped, prompts, params), outputs(synchronous, prompts, params))
    assert overlapped.num_tokens_computed == synchronous.num_tokens_computed


# ----- the pipeline ------------------------------------------------------------------------------


def record_launches_and_reads(llm: LLMEngine, monkeypatch) -> list[str]:
    events: list[str] = []
    run = llm.runner.run
    real_to_host = sampler_module._to_host
    monkeypatch.setattr(llm.runner, "run", lambda *args: events.append("launch") or run(*args))
    monkeypatch.setattr(sampler_module, "_to_host", lambda copy: events.append("read") or real_to_host(copy))
    return events


@pytest.mark.parametrize(("overlapped", "expected"), [
    (False, ["launch", "read"] * 4),
    # The second step is launched before the first is read; the fourth token's step is the last launched.
    (True, ["launch", "launch", "read", "launch", "read", "launch", "read", "read"]),
], ids=["synchronous", "overlapped"])
def test_each_step_is_launched_before_the_previous_steps_picks_are_read(monkeypatch, overlapped, expected):
    llm = engine(overlapped=overlapped)
    events = record_launches_and_reads(llm, monkeypatch)
    llm.add_request([5, 6, 7, 8, 9], greedy(4))
    tokens = [t for delta in llm.stream() for t in delta.token_ids]
    assert events == expected
    assert len(tokens) == 4


def test_a_pending_tokens_input_is_the_in_flight_pick_filled_in_on_the_device(monkeypatch):
    llm = engine(overlapped=True)
    inputs: list[tuple[list[int], bool]] = []
    run = llm.runner.run
    monkeypatch.setattr(llm.runner, "run", lambda lists, ids=None, picks=None: inputs.append(
        (list(lists.input_ids), ids is not None)
    ) or run(lists, ids, picks))
    llm.add_request([5, 6, 7, 8, 9], greedy(3))
    tokens = [t for delta in llm.stream() for t in delta.token_ids]

    assert inputs[0] == ([5, 6, 7, 8, 9], False)  # the prompt: every id known on the host
    assert inputs[1:] == [([placeholder(0)], True)] * 2  # each later input: a placeholder for row 0
    assert tokens == engine(overlapped=False).generate([[5, 6, 7, 8, 9]], greedy(3))[0].outputs[0].token_ids


def test_fill_placeholders_takes_the_named_rows_and_keeps_known_ids():
    ids = torch.tensor([7, placeholder(2), 0, placeholder(0)])
    fill_placeholders(ids, torch.tensor([40, 41, 42]))
    assert ids.tolist() == [7, 42, 0, 40]
    with pytest.raises(EngineError, match="no step is in flight"):
        fill_placeholders(torch.tensor([placeholder(0)]), None)


def test_a_sequence_counts_its_pending_token_but_only_the_host_known_ones_are_ids():
    seq = Sequence(seq_id=0, request_id="r", sample_index=0, prompt_token_ids=[1, 2, 3],
                   params=greedy(3), seed=None, max_tokens=3, output_token_ids=[9, 8])
    seq.pending_row = 4
    assert (seq.num_tokens, seq.num_output_tokens, seq.can_grow) == (6, 3, False)
    assert seq.tokens_between(2, 6) == [3, 9, 8, placeholder(4)]
    assert seq.tokens_between(0, 5) == [1, 2, 3, 9, 8]
    seq.pending_row = None
    assert (seq.num_tokens, seq.can_grow) == (5, True)


# ----- ends and aborts while a step is in flight ---------------------------------------------------


def test_an_abort_while_a_step_is_in_flight_ends_only_that_request_and_zeroes_its_blocks():
    prompts = random_prompts(2, 6, 12, seed=23)
    params = SamplingParams(max_tokens=20, temperature=0.8, seed=5, ignore_eos=True)
    expected_other = engine(overlapped=False).generate([prompts[1]], params)[0].outputs[0].token_ids
    llm = engine(overlapped=True, block_size=4)
    victim, other = llm.add_request(prompts[0], params), llm.add_request(prompts[1], params)
    deltas = llm.step() + llm.step() + llm.step()
    assert llm._in_flight is not None and any(s.pending_row is not None for s in llm.scheduler.running)

    llm.abort(victim)
    deltas += list(llm.stream())

    victim_deltas = [d for d in deltas if d.request_id == victim]
    assert victim_deltas[-1].finish_reason == FinishReason.ABORT and victim_deltas[-1].request_finished
    assert all(t >= 0 for d in deltas for t in d.token_ids)
    assert victim_deltas[-1].metrics.output_tokens == sum(len(d.token_ids) for d in victim_deltas) == 2
    assert [t for d in deltas if d.request_id == other for t in d.token_ids] == expected_other
    assert_clean(llm)


def test_blocks_freed_while_a_step_is_in_flight_are_zero_after_every_step():
    prompts, params = mixed_workload()
    llm = engine(overlapped=True, **TIGHT)
    for prompt, sampling in zip(prompts, params):
        llm.add_request(prompt, sampling)
    steps = 0
    while llm.has_unfinished():
        llm.step()
        steps += 1
        assert llm.residue_check() == []
    assert steps > 20 and llm.block_manager.blocks_scrubbed > 0
    assert_clean(llm)


def steps_until_it_ends(llm: LLMEngine, request_id: str, ending: str) -> None:
    """Steps until `request_id` has ended by `ending` while the step after its last pick is in flight."""
    if ending == "abort":
        for _ in range(3):  # prefill, then two tokens: a step is in flight from the second on
            llm.step()
        llm.abort(request_id)
        return
    while not any(delta.request_finished for delta in llm.step()):
        pass


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("ending", ["stop token", "abort"])
def test_an_id_reused_while_the_ended_requests_pick_is_in_flight_gets_only_its_own_deltas(ending, n):
    first, second = random_prompts(2, 6, 10, seed=71)
    free_run = engine(overlapped=False).generate([first], greedy(8))[0].outputs[0].token_ids
    ended = greedy(8, n=n, stop_token_ids=(free_run[3],) if ending == "stop token" else ())
    expected = engine(overlapped=False).generate([second], greedy(6, n=n))[0]
    llm = engine(overlapped=True)
    llm.add_request(first, ended, request_id="reused")
    steps_until_it_ends(llm, "reused", ending)
    assert len([s for s in llm._in_flight.samples if s.is_finished]) == n  # the premise: the ended request's next picks are in flight

    llm.add_request(second, greedy(6, n=n), request_id="reused")
    deltas = list(llm.stream())

    old_finals = deltas[:n] if ending == "abort" else []  # an abort's last deltas go out at the next step
    assert all(d.finish_reason == FinishReason.ABORT for d in old_finals)
    got = RequestOutput("reused", [])
    for delta in deltas[len(old_finals):]:
        got.add(delta)
    assert [d.request_finished for d in deltas[len(old_finals):]].count(True) == 1 and deltas[-1].request_finished
    assert [(s.token_ids, s.finish_reason) for s in got.outputs] == \
        [(s.token_ids, s.finish_reason) for s in expected.outputs]
    assert got.metrics.output_tokens == expected.metrics.output_tokens == 6 * n
    assert_clean(llm)


# ----- configuration and the engine core ----------------------------------------------------------


def test_async_scheduling_is_on_by_default_only_on_cuda():
    assert async_scheduling_enabled(EngineConfig(), torch.device("cuda"))
    assert not async_scheduling_enabled(EngineConfig(), torch.device("cpu"))
    assert async_scheduling_enabled(EngineConfig(async_scheduling=True), torch.device("cpu"))
    assert not async_scheduling_enabled(EngineConfig(async_scheduling=False), torch.device("cuda"))
    with pytest.raises(EngineError, match="async_scheduling must be true, false or unset"):
        EngineConfig(async_scheduling="false")


def test_the_engine_core_process_serves_overlapped_steps():
    config = EngineConfig(kv_cache_gib=0.05, device="cpu", async_scheduling=True)
    params = [SamplingParams(max_tokens=10 + i, temperature=0.8, seed=50 + i, ignore_eos=True) for i in range(4)]
    expected = [o.outputs[0].token_ids for o in
                engine(overlapped=False, kv_cache_gib=0.05).generate([f"core {i}" for i in range(4)], params)]
    client = EngineCoreClient(tiny_model_dir(), config)
    client.start()
    try:
        handles = [client.submit(f"core {i}", p) for i, p in enumerate(params)]
        got = [[t for batch in h.delta_batches() for d in batch for t in d.token_ids] for h in handles]
        assert got == expected
        assert client.in_flight == 0 and client.residue_check() == []
    finally:
        client.stop()


def test_a_step_that_fails_while_another_is_in_flight_fails_its_requests_and_the_core_serves_on(monkeypatch):
    llm = engine(overlapped=True, block_size=4)
    ours, theirs = Pipe()
    core = EngineCore(llm, ours)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for index in range(3):
        core._handle(AddRequest(f"doomed-{index}", [5, 6, 7, 8 + index], params))
    core._step()
    core._step()  # the second step is launched, the first one read
    assert llm._in_flight is not None
    real_to_host = sampler_module._to_host

    def failing_read(copy):
        monkeypatch.setattr(sampler_module, "_to_host", real_to_host)  # fails once
        raise RuntimeError("device lost")

    monkeypatch.setattr(sampler_module, "_to_host", failing_read)
    core._step()

    messages = []
    while theirs.poll():
        messages.append(theirs.recv())
    refused = sorted(m.request_id for m in messages if isinstance(m, Refused))
    assert refused == ["doomed-0", "doomed-1", "doomed-2"]
    assert all("failed while serving" in str(m.error) for m in messages if isinstance(m, Refused))
    assert llm._in_flight is None and not llm.scheduler.has_work()
    list(llm.stream())  # the aborts' last deltas, which the core drops
    assert_clean(llm)
    expected = engine(overlapped=False).generate([[9, 9, 9]], params)[0].outputs[0].token_ids
    assert llm.generate([[9, 9, 9]], params)[0].outputs[0].token_ids == expected


def test_a_pending_token_with_no_step_in_flight_is_refused_before_anything_runs():
    llm = engine(overlapped=True)
    llm.add_request([5, 6, 7], greedy(5))
    llm.step()
    llm._in_flight = None  # what a failed step leaves if its requests are not aborted
    computed = llm.num_tokens_computed
    with pytest.raises(EngineError, match="no step in flight"):
        llm.step()
    assert llm.num_tokens_computed == computed


# ----- on a CUDA device ---------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_step_waits_for_the_device_only_to_read_the_previous_picks(monkeypatch):
    """Launching, zeroing, copy on write and the residue tally queue work and never wait; the one wait
    is the read of the previous step's picks, so the host's work overlaps the device's."""
    reference = reference_model("llama")
    llm = LLMEngine(reference.folder, EngineConfig(device="cuda", async_scheduling=True, num_blocks=64, block_size=4,
                                                    max_num_seqs=8))
    account = ZeroingAccount(llm.block_manager, llm.runner)
    prompts = random_prompts(6, 5, 20, seed=61)
    lengths = [3, 5, 8, 13, 21, 30]  # samples end at different steps: blocks are freed between launches
    ids = [llm.add_request(p, greedy(n)) for p, n in zip(prompts, lengths)]
    sampled = llm.add_request(prompts[0], SamplingParams(max_tokens=9, temperature=0.8, seed=3, n=2, ignore_eos=True))
    tokens: dict[str, list[int]] = {}
    assert llm.step() == []  # the first launch (it compiles and allocates) reads nothing yet
    with only_the_read_may_wait(monkeypatch) as reads:
        while llm.has_unfinished():
            for delta in llm.step():
                tokens.setdefault(delta.request_id, []).extend(delta.token_ids)
            account.check()

    # Each read is a step's one download, copied into the bridge's pinned staging buffers.
    assert reads and all(isinstance(copy, Download) for copy in reads)
    assert staging_in_use_is_pinned(llm.runner.bridge)
    assert [tokens[i] for i in ids] == [hf_greedy(reference.model, p, n) for p, n in zip(prompts, lengths)]
    assert len(tokens[sampled]) == 18 and llm.block_manager.blocks_scrubbed > 0
    assert account.take(0).residue == 0 and llm.residue_check() == []


def test_generate_and_node_commands_can_turn_graphs_and_async_steps_off():
    parser = build_parser()
    generate = ["generate", "--model", str(tiny_model_dir()), "Hello"]
    assert generate_config(parser.parse_args(generate)).async_scheduling is None
    assert generate_config(parser.parse_args([*generate, "--sync-scheduling"])).async_scheduling is False

    limits = EngineLimits(max_model_len=512, kv_cache_gib=0.05)
    node = ["node", "--model", str(tiny_model_dir())]
    default = node_engine_config(node_settings(parser.parse_args(node)), limits)
    turned_off = node_engine_config(node_settings(parser.parse_args([*node, "--eager", "--sync-scheduling"])), limits)
    assert (default.cuda_graphs, default.async_scheduling) == (None, None)
    assert (turned_off.cuda_graphs, turned_off.async_scheduling) == (False, False)
    assert (turned_off.max_model_len, turned_off.kv_cache_gib) == (512, 0.05)
    in_fp32 = node_engine_config(node_settings(parser.parse_args([*node, "--dtype", "float32"])), limits)
    assert (default.dtype, in_fp32.dtype) == (None, "float32")  # a node, like veil generate, can set its dtype


# ----- random workloads ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Arrival:
    prompt: list[int]
    params: SamplingParams
    arrives_at: int  # the step before which it is added
    aborted_at: int | None  # the step before which it is aborted, if it is


def arrivals() -> st.SearchStrategy[list[Arrival]]:
    stop_ids = st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=40).map(tuple)
    params = st.builds(
        SamplingParams, max_tokens=st.integers(1, 14), temperature=st.sampled_from([0.0, 0.8]),
        seed=st.integers(0, 1000), n=st.integers(1, 2), stop_token_ids=stop_ids, ignore_eos=st.booleans(),
    )
    arrival = st.builds(
        Arrival, prompt=st.lists(st.integers(1, VOCAB_SIZE - 1), min_size=1, max_size=30),
        params=params, arrives_at=st.integers(0, 6), aborted_at=st.none() | st.integers(0, 12),
    )
    return st.lists(arrival, min_size=1, max_size=6)


def run_arrivals(llm: LLMEngine, workload: list[Arrival]) -> dict[int, dict[int, list[int]]]:
    """Adds and aborts requests at their steps; returns per arrival, per sample, the tokens streamed."""
    ids: dict[int, str] = {}
    streamed: dict[str, dict[int, list[int]]] = {}
    step = 0
    while step <= 12 or llm.has_unfinished():
        for index, arrival in enumerate(workload):
            if arrival.arrives_at == step:
                ids[index] = llm.add_request(arrival.prompt, arrival.params)
            if arrival.aborted_at == step and index in ids:
                try:
                    llm.abort(ids[index])
                except UnknownRequestError:
                    pass  # it had finished
        for delta in llm.step():
            streamed.setdefault(delta.request_id, {}).setdefault(delta.index, []).extend(delta.token_ids)
        step += 1
    return {index: streamed.get(request_id, {}) for index, request_id in ids.items()}


# One long-lived engine per mode and pool, as on a node: every example must leave it clean for the next.
ENGINES: dict[tuple[bool, bool], LLMEngine] = {}


def long_lived(overlapped: bool, tight: bool, config: dict) -> LLMEngine:
    if (overlapped, tight) not in ENGINES:
        ENGINES[overlapped, tight] = engine(overlapped=overlapped, **config)
    return ENGINES[overlapped, tight]


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload=arrivals(), tight=st.booleans())
def test_random_arrivals_stops_and_aborts_never_change_what_an_overlapped_engine_streams(workload, tight):
    """Unaborted requests stream what the synchronous engine gives them alone; aborted ones a prefix of it;
    and the engine ends with nothing held."""
    config = {"num_blocks": 24, "block_size": 4, "max_num_batched_tokens": 32} if tight else {"block_size": 4}
    llm, alone = long_lived(True, tight, config), long_lived(False, tight, config)

    streamed = run_arrivals(llm, workload)

    for index, arrival in enumerate(workload):
        expected = {s.index: s.token_ids for s in alone.generate([arrival.prompt], arrival.params)[0].outputs}
        got = streamed[index]
        if arrival.aborted_at is None or arrival.aborted_at < arrival.arrives_at:
            assert got == expected
        else:
            assert all(tokens == expected[sample][: len(tokens)] for sample, tokens in got.items())
    assert_clean(llm)

