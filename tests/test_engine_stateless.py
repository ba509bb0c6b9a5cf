"""Statelessness: freed KV blocks are zero, nothing is shared across requests, aborts scrub at once."""

from __future__ import annotations

import logging
import sys

import pytest
import torch

from engine import EngineConfig, FinishReason, LLMEngine, RequestRejected, SamplingParams, UnknownRequestError
from engine.sequence import Sequence
from tests.engine_models import (  # noqa: F401 (fixtures)
    greedy,
    one_torch_thread,
    output_tokens,
    random_lengths,
    random_prompts,
    tiny_engine,
    tiny_model_dir,
)


def request_sequences(engine: LLMEngine, request_id: str) -> list[Sequence]:
    queued = list(engine.scheduler.running) + list(engine.scheduler.waiting)
    return [seq for seq in queued if seq.request_id == request_id]


def request_blocks(engine: LLMEngine, request_id: str) -> set[int]:
    return {b for seq in request_sequences(engine, request_id) for b in seq.block_table}


def blocks_are_zero(engine: LLMEngine, block_ids: set[int]) -> bool:
    ids = torch.tensor(sorted(block_ids))
    return bool((engine.runner.kv_cache.index_select(1, ids) == 0).all())


def add_mixed_batch(engine: LLMEngine, count: int, seed: int) -> list[str]:
    prompts = random_prompts(count, 2, 30, seed=seed)
    lengths = random_lengths(count, 1, 20, seed=seed + 1)
    return [engine.add_request(p, greedy(n)) for p, n in zip(prompts, lengths)]


def test_no_freed_block_holds_residue_after_any_step():
    engine = tiny_engine(num_blocks=24, block_size=4, max_num_batched_tokens=16)
    add_mixed_batch(engine, 10, seed=11)
    finished = 0
    while engine.has_unfinished():
        finished += sum(delta.request_finished for delta in engine.step())
        assert engine.residue_check() == []
    assert finished == 10
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.blocks_scrubbed > 0
    assert sorted(engine.block_manager.free_block_ids()) == list(range(24))
    assert int(engine.runner.kv_cache.count_nonzero()) == 0


@pytest.mark.parametrize("cache_index", [0, -1])  # first layer's K, last layer's V
@pytest.mark.parametrize("value", [1.0, -0.0])  # -0.0 is all-but-one zero bits: still residue
def test_residue_check_reports_a_free_block_with_nonzero_bytes(cache_index, value):
    engine = tiny_engine(num_blocks=8, block_size=4)
    assert engine.residue_check() == []
    block = engine.block_manager.free_block_ids()[5]
    engine.runner.kv_cache[cache_index, block, 3, 1, 7] = value
    assert engine.residue_check() == [block]
    engine.runner.kv_cache[cache_index, block].zero_()
    assert engine.residue_check() == []


def test_without_zeroing_freed_blocks_keep_residue():
    """The control: with zeroing switched off, the same run leaves K/V behind in freed blocks."""
    engine = LLMEngine(tiny_model_dir(), EngineConfig(num_blocks=24, block_size=4, unsafe_skip_zeroing=True))
    prompts = random_prompts(4, 5, 20, seed=12)
    engine.generate(prompts, greedy(6))
    residue = engine.residue_check()
    used = sum(engine.block_manager.blocks_for(len(p) + 5) for p in prompts)
    assert len(residue) == used
    assert set(residue) <= set(engine.block_manager.free_block_ids())


def test_two_requests_with_the_same_prompt_share_no_block():
    engine = tiny_engine(num_blocks=32, block_size=4)
    prompt = random_prompts(1, 13, 13, seed=13)[0]
    first = engine.add_request(prompt, greedy(8))
    second = engine.add_request(prompt, greedy(8))
    steps_together = 0
    while engine.has_unfinished():
        engine.step()
        mine, theirs = request_blocks(engine, first), request_blocks(engine, second)
        assert not mine & theirs
        steps_together += bool(mine and theirs)
    assert steps_together >= 7


def test_n_samples_compute_the_prompt_once():
    prompt = random_prompts(1, 10, 10, seed=14)[0]
    max_tokens = 6

    def tokens_computed(n: int) -> int:
        engine = tiny_engine(num_blocks=32, block_size=4)
        engine.generate([prompt], SamplingParams(max_tokens=max_tokens, n=n, seed=3, ignore_eos=True))
        return engine.num_tokens_computed

    # Each sample feeds back all its tokens but the last; the prompt is run through the model once.
    assert tokens_computed(1) == len(prompt) + (max_tokens - 1)
    assert tokens_computed(4) == len(prompt) + 4 * (max_tokens - 1)


def test_n_samples_share_the_prompt_blocks_and_copy_the_partial_one():
    engine = tiny_engine(num_blocks=32, block_size=4)
    prompt = random_prompts(1, 10, 10, seed=15)[0]  # two full blocks and a partial one
    request = engine.add_request(prompt, SamplingParams(max_tokens=6, n=4, seed=3, ignore_eos=True))

    deltas = engine.step()  # prefill, then the three other samples fork from the first
    samples = request_sequences(engine, request)
    assert len(samples) == 4
    tables = [seq.block_table for seq in samples]
    assert all(table == tables[0] for table in tables)
    assert all(engine.block_manager.ref_count(b) == 4 for b in tables[0])

    deltas += engine.step()  # each sample writes its first token: the partial block is copied on write
    tables = [seq.block_table for seq in request_sequences(engine, request)]
    full_blocks = tables[0][:2]
    assert all(table[:2] == full_blocks for table in tables)
    assert all(engine.block_manager.ref_count(b) == 4 for b in full_blocks)
    assert len({table[2] for table in tables}) == 4

    outputs: dict[int, list[int]] = {}
    for delta in deltas + list(engine.stream()):
        outputs.setdefault(delta.index, []).extend(delta.token_ids)
    assert sorted(outputs) == [0, 1, 2, 3]
    assert all(len(tokens) == 6 for tokens in outputs.values())
    assert engine.residue_check() == []


@pytest.mark.parametrize("n", [1, 3])
def test_abort_mid_generation_frees_and_zeroes_before_returning(n):
    engine = tiny_engine(num_blocks=32, block_size=4)
    prompts = random_prompts(2, 9, 9, seed=16)
    expected_other = output_tokens(tiny_engine(num_blocks=32, block_size=4), [prompts[1]], greedy(10))[0]

    victim = engine.add_request(prompts[0], SamplingParams(max_tokens=40, n=n, seed=1, ignore_eos=True))
    other = engine.add_request(prompts[1], greedy(10))
    deltas = [d for _ in range(3) for d in engine.step()]
    blocks = request_blocks(engine, victim)
    assert blocks and not blocks_are_zero(engine, blocks)

    engine.abort(victim)
    assert blocks <= set(engine.block_manager.free_block_ids())
    assert blocks_are_zero(engine, blocks)
    assert engine.residue_check() == []
    assert request_sequences(engine, victim) == []

    deltas += list(engine.stream())
    victim_final = [d for d in deltas if d.request_id == victim and d.finish_reason is not None]
    assert sorted(d.index for d in victim_final) == list(range(n))
    assert all(d.finish_reason is FinishReason.ABORT for d in victim_final)
    assert [t for d in deltas if d.request_id == other for t in d.token_ids] == expected_other
    assert engine.residue_check() == []


def test_abort_of_a_request_still_waiting():
    engine = tiny_engine(num_blocks=8, block_size=4)
    request = engine.add_request(random_prompts(1, 5, 5, seed=17)[0], greedy(4))
    engine.abort(request)
    deltas = list(engine.stream())
    assert [(d.request_id, d.finish_reason, d.token_ids) for d in deltas] == [(request, FinishReason.ABORT, ())]
    assert deltas[0].metrics is not None and deltas[0].metrics.output_tokens == 0
    assert not engine.has_unfinished()


@pytest.mark.parametrize("steps", [0, 1], ids=["waiting", "prefilling"])
def test_an_abort_before_the_samples_fork_ends_every_sample_as_an_abort_after_it_does(steps):
    engine = tiny_engine(num_blocks=16, block_size=4, max_num_batched_tokens=4)
    request = engine.add_request(random_prompts(1, 12, 12, seed=18)[0], SamplingParams(max_tokens=4, n=3, seed=2))
    for _ in range(steps):
        assert engine.step() == []  # one chunk of the prompt: nothing sampled yet
    assert len(engine._requests[request].sequences) == 1  # the premise: samples 1 and 2 not forked yet

    engine.abort(request)
    deltas = list(engine.stream())

    assert sorted((d.index, d.finish_reason, d.token_ids) for d in deltas) == [
        (index, FinishReason.ABORT, ()) for index in range(3)]
    assert [d.request_finished for d in deltas] == [False, False, True]
    assert deltas[-1].metrics.output_tokens == 0
    assert not engine.has_unfinished() and engine.residue_check() == []
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_abort_of_an_unknown_request_is_an_error_without_the_id():
    engine = tiny_engine(num_blocks=8, block_size=4)
    with pytest.raises(UnknownRequestError) as raised:
        engine.abort("canary-request-424242")
    assert "424242" not in str(raised.value)


def test_everything_freed_in_a_step_is_zeroed_in_one_call():
    engine = tiny_engine(num_blocks=64, block_size=4, max_num_batched_tokens=256)
    prompts = random_prompts(6, 3, 20, seed=18)
    for prompt in prompts:
        engine.add_request(prompt, greedy(5))  # all admitted together, so all finish in the same step
    manager = engine.block_manager
    steps = 0
    while engine.has_unfinished():
        calls_before = manager.scrub_calls
        finished = sum(delta.request_finished for delta in engine.step())
        steps += 1
        assert manager.scrub_calls - calls_before <= 1
        if finished:
            assert finished == 6
            assert manager.scrub_calls - calls_before == 1
    assert steps == 5
    # One call zeroed every block of all six requests: each wrote its prompt and 4 of its 5 tokens.
    assert manager.scrub_calls == 1
    assert manager.blocks_scrubbed == sum(manager.blocks_for(len(p) + 4) for p in prompts)


def test_n_samples_under_preemption_match_an_uncrowded_run():
    """Samples forked from shared blocks survive preemption by recompute with the same seeded tokens."""
    prompts = random_prompts(3, 6, 14, seed=19)
    params = [
        SamplingParams(max_tokens=10, temperature=1.0, n=3, seed=21, ignore_eos=True),
        greedy(12),
        SamplingParams(max_tokens=8, temperature=0.8, n=2, seed=22, ignore_eos=True),
    ]
    roomy = tiny_engine(num_blocks=128, block_size=4).generate(prompts, params)
    crowded_engine = tiny_engine(num_blocks=12, block_size=4, max_num_batched_tokens=8)
    crowded = crowded_engine.generate(prompts, params)
    assert crowded_engine.scheduler.num_preemptions > 0
    for got, want in zip(crowded, roomy):
        assert [o.token_ids for o in got.outputs] == [o.token_ids for o in want.outputs]
    assert crowded_engine.residue_check() == []
    assert crowded_engine.block_manager.num_free_blocks == 12


def test_kv_pool_is_sized_from_the_cpu_budget():
    engine = tiny_engine(kv_cache_gib=0.001, block_size=8)
    block_bytes = engine.runner.block_bytes()
    mc = engine.model_config
    assert block_bytes == 2 * mc.num_hidden_layers * 8 * mc.num_key_value_heads * mc.head_dim * 4
    assert engine.runner.num_blocks == int(0.001 * (1 << 30)) // block_bytes
    assert engine.block_manager.num_blocks == engine.runner.num_blocks
    assert tuple(engine.runner.kv_cache.shape) == (
        2 * mc.num_hidden_layers, engine.runner.num_blocks, 8, mc.num_key_value_heads, mc.head_dim
    )


def test_a_budget_that_holds_no_block_is_an_engine_error():
    from engine import EngineError

    with pytest.raises(EngineError):
        tiny_engine(kv_cache_gib=1e-9)


class FileOpenRecorder:
    """A process-wide audit hook (hooks cannot be removed) that records file opens only while armed."""

    def __init__(self) -> None:
        self.armed = False
        self.opened: list[tuple[str, object, object]] = []
        sys.addaudithook(self._hook)

    def _hook(self, event: str, args: tuple) -> None:
        if self.armed and event == "open":
            self.opened.append((str(args[0]), args[1], args[2]))


_file_opens = FileOpenRecorder()


def test_serving_prints_logs_and_writes_nothing(capfd, caplog):
    engine = tiny_engine(num_blocks=16, block_size=4)
    caplog.set_level(logging.DEBUG)
    _file_opens.opened.clear()
    _file_opens.armed = True
    try:
        engine.generate(["CANARY-serving-2718"], SamplingParams(max_tokens=6, seed=1, stop=("zz",), logprobs=1))
        request = engine.add_request("CANARY-abort-2718", greedy(20))
        engine.step()
        engine.abort(request)
        list(engine.stream())
        with pytest.raises(RequestRejected):
            engine.add_request("", greedy(2048))
    finally:
        _file_opens.armed = False
    captured = capfd.readouterr()
    assert captured.out == "" and captured.err == ""
    assert caplog.records == []
    assert _file_opens.opened == [], "the engine opened files while serving"


def test_file_open_recorder_sees_a_write(tmp_path):
    """The check above can fail: an open while armed is recorded."""
    _file_opens.opened.clear()
    _file_opens.armed = True
    try:
        (tmp_path / "written").write_text("x")
    finally:
        _file_opens.armed = False
    assert [path for path, _, _ in _file_opens.opened] == [str(tmp_path / "written")]
