"""The engine core process and its client: deltas to the right reader, in order, batched when a reader
falls behind; refusals, aborts, zeroing reports and a dead core reach whoever waits, never silence."""

from __future__ import annotations

import gc
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing import Pipe
from multiprocessing.connection import Connection

import pytest

from engine import EngineConfig, EngineError, LLMEngine, RequestRejected, SamplingParams, StreamDelta
from engine.core import AbortRequest, AddRequest, Answer, EngineCore, Query, Refused, Shutdown
from engine.core_client import EngineCoreClient, Failure, RequestHandle
from engine.outputs import RequestMetrics
from engine.sampling_params import StructuredOutput
from engine.structured import Guide
from tests.engine_models import SMALL_VOCAB, running_core, small_vocab_model_dir
from tests.engine_models import tiny_model_dir as tiny_dir
from tests.conftest import HANG_S

LONG = SamplingParams(max_tokens=300, temperature=1.0, seed=3, ignore_eos=True)
CONFIG = EngineConfig(kv_cache_gib=0.05, device="cpu")


@pytest.fixture(scope="module")
def core() -> Iterator[EngineCoreClient]:
    with running_core(tiny_dir(), CONFIG) as client:
        yield client


@pytest.fixture(scope="module")
def oracle() -> LLMEngine:
    """The same model in this process: what the core must produce for the same request."""
    return LLMEngine(tiny_dir(), CONFIG)


def expected_tokens(oracle: LLMEngine, prompt: str, params: SamplingParams) -> tuple[int, ...]:
    return tuple(oracle.generate([prompt], params)[0].outputs[0].token_ids)


def wait_until_idle(client: EngineCoreClient, timeout_s: float = HANG_S) -> None:
    deadline = time.monotonic() + timeout_s
    while client.in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert client.in_flight == 0, "the engine did not finish the request in time"


def all_tokens(batches: list[list[StreamDelta]]) -> tuple[int, ...]:
    return tuple(token for batch in batches for delta in batch for token in delta.token_ids)


def test_the_core_runs_in_another_process_and_reports_its_model(core: EngineCoreClient) -> None:
    assert core.alive and core._process.pid != os.getpid()
    assert core.info.max_model_len > 0 and core.info.num_blocks > 0 and core.info.device == "cpu"


def test_concurrent_requests_each_get_their_own_tokens(core: EngineCoreClient, oracle: LLMEngine) -> None:
    params = [SamplingParams(max_tokens=12 + i, temperature=0.8, seed=100 + i, ignore_eos=True) for i in range(6)]
    handles = [core.submit(f"request number {i}", p) for i, p in enumerate(params)]
    got = [all_tokens(list(h.delta_batches())) for h in handles]
    assert got == [expected_tokens(oracle, f"request number {i}", p) for i, p in enumerate(params)]
    assert core.in_flight == 0


def test_deltas_queued_while_the_reader_was_busy_arrive_as_one_batch(core: EngineCoreClient, oracle) -> None:
    params = SamplingParams(max_tokens=40, temperature=0.7, seed=11, ignore_eos=True)
    handle = core.submit("batched while nobody reads", params)
    wait_until_idle(core)  # every delta of the request is queued; nobody has read one yet

    batches = list(handle.delta_batches())

    assert len(batches) == 1 and len(batches[0]) == 40
    assert all_tokens(batches) == expected_tokens(oracle, "batched while nobody reads", params)
    assert batches[0][-1].request_finished and handle.finished


def test_a_reader_that_keeps_up_gets_the_answer_in_pieces_in_order(core: EngineCoreClient, oracle) -> None:
    handle = core.submit("read as it is made", LONG)
    batches = list(handle.delta_batches())

    assert len(batches) > 1  # streamed as produced, not held until the end
    assert all(batches) and not any(delta.request_finished for batch in batches[:-1] for delta in batch)
    assert all_tokens(batches) == expected_tokens(oracle, "read as it is made", LONG)


def test_a_refused_request_raises_the_engines_own_error(core: EngineCoreClient) -> None:
    handle = core.submit([5, 6.7, 7], SamplingParams(max_tokens=4))
    with pytest.raises(RequestRejected) as raised:
        list(handle.deltas())
    assert raised.value.reason == "invalid_token" and "integers" in str(raised.value)
    assert handle.finished and core.in_flight == 0
    ok = core.submit("still serving", SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(all_tokens(list(ok.delta_batches()))) == 3


def test_a_request_the_model_cannot_serve_is_refused_and_the_one_batched_beside_it_completes() -> None:
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    client = EngineCoreClient(small_vocab_model_dir(), CONFIG)
    client.start()
    try:
        good = client.submit([5, 6, 7, 8], params)
        bad = client.submit([5, 6, 7], SamplingParams(max_tokens=30, logprobs=SMALL_VOCAB + 1))
        with pytest.raises(RequestRejected, match="logprobs"):
            list(bad.deltas())
        got = all_tokens(list(good.delta_batches()))
    finally:
        client.stop()
    assert got == expected_tokens(LLMEngine(small_vocab_model_dir(), CONFIG), [5, 6, 7, 8], params)


def test_an_abort_frees_and_zeroes_the_requests_blocks(core: EngineCoreClient) -> None:
    core.take_zeroing()  # start a fresh tally
    handle = core.submit("aborted half way", LONG)
    next(handle.deltas())
    handle.close()
    assert core.in_flight == 0
    report = _zeroing_until(core, lambda r: r.requests_ended >= 1 and r.blocks >= 1)
    assert report.residue == 0
    assert core.residue_check() == []


def test_zeroing_reports_count_blocks_and_requests_once(core: EngineCoreClient) -> None:
    core.take_zeroing()
    handles = [core.submit(f"count me {i}", SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
               for i in range(3)]
    for handle in handles:
        list(handle.deltas())
    report = _zeroing_until(core, lambda r: r.requests_ended >= 3)
    assert report.requests_ended == 3 and report.blocks >= 3 and report.residue == 0
    assert core.take_zeroing().requests_ended == 0  # taken once


def test_reports_reach_the_observer_at_the_cores_cadence() -> None:
    reports = []
    client = EngineCoreClient(tiny_dir(), CONFIG, on_zeroing=reports.append)
    client.start()
    try:
        list(client.submit("observed", SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)).deltas())
        deadline = time.monotonic() + HANG_S
        while not reports and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        client.stop()
    assert sum(r.blocks for r in reports) >= 1 and sum(r.requests_ended for r in reports) == 1


def test_deltas_before_a_failure_are_delivered_then_the_error_is_raised(core: EngineCoreClient) -> None:
    handle = RequestHandle(core, "not-submitted")
    produced = [StreamDelta("not-submitted", 0, "", (token,)) for token in (5, 6, 7)]
    for delta in produced:
        handle.queue.put(delta)
    handle.queue.put(Failure(EngineError("the engine failed while serving this request")))

    batches = handle.delta_batches()
    assert next(batches) == produced
    with pytest.raises(EngineError, match="failed while serving"):
        next(batches)
    assert handle.finished


def test_nothing_is_read_past_the_last_delta_of_a_request(core: EngineCoreClient) -> None:
    handle = RequestHandle(core, "not-submitted")
    last = StreamDelta("not-submitted", 0, "", (1,), metrics=RequestMetrics(1, 1, 0.0, 0.0, 0.0))
    handle.queue.put(last)
    assert list(handle.delta_batches()) == [[last]]
    assert list(handle.deltas()) == []  # finished: a second reader gets nothing, and never blocks


def test_a_dead_core_ends_every_stream_with_an_error_and_tells_its_owner() -> None:
    client = EngineCoreClient(tiny_dir(), CONFIG)
    client.start()
    lost = []
    client.on_exit(lambda: lost.append(True))
    handle = client.submit("cut off", LONG)
    next(handle.deltas())
    os.kill(client._process.pid, signal.SIGKILL)
    with pytest.raises(EngineError, match="stopped before this request finished"):
        list(handle.deltas())
    deadline = time.monotonic() + HANG_S
    while not lost and time.monotonic() < deadline:
        time.sleep(0.01)
    assert lost == [True] and not client.alive
    refused = client.submit("after the end", SamplingParams(max_tokens=2))
    with pytest.raises(EngineError, match="not running"):
        list(refused.deltas())
    client.stop()


def kill_once_a_query_waits(client: EngineCoreClient) -> None:
    """SIGKILLs the (stopped) core as soon as a query is waiting for its answer."""
    deadline = time.monotonic() + HANG_S  # a bound on a broken test, not a premise: the query registers at once
    while not client._answers and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(client._process.pid, signal.SIGKILL)


@pytest.mark.parametrize("query", ["residue_check", "take_zeroing"])
def test_a_query_waiting_when_the_core_dies_fails_with_the_cores_end_not_a_timeout(query) -> None:
    client = EngineCoreClient(tiny_dir(), CONFIG)
    client.start()
    try:
        os.kill(client._process.pid, signal.SIGSTOP)  # the core can no longer answer: the query must wait
        killer = threading.Thread(target=kill_once_a_query_waits, args=(client,))
        killer.start()
        with pytest.raises(EngineError, match="stopped before it answered"):
            getattr(client, query)()
        killer.join()
        with pytest.raises(EngineError, match="not running"):
            getattr(client, query)()
    finally:
        client.stop()


def test_a_model_the_core_cannot_load_fails_start_with_the_engines_message(tmp_path) -> None:
    client = EngineCoreClient(tmp_path / "no-model-here", CONFIG)
    with pytest.raises(EngineError) as raised:
        client.start()
    assert type(raised.value).__name__ == "ModelLoadError"
    assert client._process is None  # nothing left running


def test_a_stopped_client_leaves_no_process(core: EngineCoreClient) -> None:
    client = EngineCoreClient(tiny_dir(), CONFIG)
    client.start()
    process = client._process
    client.stop()
    assert not process.is_alive() and process.exitcode == 0


def _zeroing_until(core: EngineCoreClient, done, timeout_s: float = HANG_S):
    """Sums reports until `done` holds: the core checks zeroed blocks at its own cadence."""
    total = core.take_zeroing()
    deadline = time.monotonic() + timeout_s
    while not done(total) and time.monotonic() < deadline:
        time.sleep(0.05)
        total = total.plus(core.take_zeroing())
    return total


# ----- constraints compile beside the step loop ---------------------------------------------------------------

CHOICE = StructuredOutput("choice", json.dumps(["alpha", "beta", "gamma"]), "guided_choice")
PICK = SamplingParams(max_tokens=16, temperature=0.0, structured=CHOICE)


def plain(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


class HeldCompiles:
    """The engine's own compile, held on its worker thread until released: what a long compile looks like."""

    def __init__(self, engine: LLMEngine) -> None:
        self.started, self.release = threading.Event(), threading.Event()
        compile_constraint = engine.compile_constraint

        def held(params: SamplingParams):
            self.started.set()
            assert self.release.wait(HANG_S), "the test never released the compile"
            return compile_constraint(params)

        engine.compile_constraint = held


@contextmanager
def core_on_a_thread(engine: LLMEngine) -> Iterator[Connection]:
    """The core's own loop over `engine`, on a thread of this process, and the client's end of its pipe."""
    client_end, core_end = Pipe()
    loop = threading.Thread(target=EngineCore(engine, core_end).run, daemon=True)
    loop.start()
    try:
        yield client_end
    finally:
        client_end.send(Shutdown())
        loop.join(HANG_S)
        assert not loop.is_alive()


def read_until_ended(connection: Connection, request_id: str, seen: dict[str, list[int]]) -> object:
    """Collects every request's tokens from the core until `request_id` ends; its end (metrics or refusal)."""
    while True:
        assert connection.poll(120), "the core sent nothing for two minutes"
        message = connection.recv()
        if isinstance(message, Refused) and message.request_id == request_id:
            return message
        for output in getattr(message, "outputs", ()):
            seen.setdefault(output[0], []).extend(output[2])
            if output[0] == request_id and output[5] is not None:
                return output[5]


def test_running_requests_keep_stepping_while_a_constraint_compiles(oracle: LLMEngine) -> None:
    engine = LLMEngine(tiny_dir(), CONFIG)
    held = HeldCompiles(engine)
    with core_on_a_thread(engine) as connection:
        connection.send(AddRequest("constrained", "pick one", PICK))
        connection.send(AddRequest("plain", "keep going", plain(24)))
        seen: dict[str, list[int]] = {}
        read_until_ended(connection, "plain", seen)
        # Every step of the plain request ran while the constrained one's compile was held.
        assert held.started.is_set() and "constrained" not in seen
        held.release.set()
        read_until_ended(connection, "constrained", seen)
    assert tuple(seen["plain"]) == expected_tokens(oracle, "keep going", plain(24))
    assert tuple(seen["constrained"]) == expected_tokens(oracle, "pick one", PICK)
    assert oracle.tokenizer.decode(seen["constrained"]) in {"alpha", "beta", "gamma"}


def test_a_request_aborted_while_its_constraint_compiles_never_runs_and_keeps_no_matcher() -> None:
    engine = LLMEngine(tiny_dir(), CONFIG)
    held = HeldCompiles(engine)
    with core_on_a_thread(engine) as connection:
        connection.send(AddRequest("aborted", "pick one", PICK))
        assert held.started.wait(HANG_S)
        connection.send(AbortRequest("aborted"))
        connection.send(Query(1, "zeroing"))  # answered after the abort is handled: the loop takes them in order
        while not isinstance(connection.recv(), Answer):
            pass
        held.release.set()
        connection.send(AddRequest("after", "then this", plain(4)))  # served: the loop lives on
        seen: dict[str, list[int]] = {}
        read_until_ended(connection, "after", seen)
        assert "aborted" not in seen and not engine.has_unfinished()
    gc.collect()
    assert not [o for o in gc.get_objects() if type(o) is Guide]


def test_a_constraint_refused_on_the_worker_reaches_its_client_and_nothing_else_stops() -> None:
    engine = LLMEngine(tiny_dir(), CONFIG)
    held = HeldCompiles(engine)
    bad = SamplingParams(max_tokens=8, structured=StructuredOutput("regex", "(secret", "guided_regex"))
    with core_on_a_thread(engine) as connection:
        connection.send(AddRequest("bad", "hello", bad))
        assert held.started.wait(HANG_S)
        connection.send(AddRequest("bad", "hello again", plain(4)))  # its id is taken while it compiles
        duplicate = read_until_ended(connection, "bad", {})
        held.release.set()
        invalid = read_until_ended(connection, "bad", {})
        connection.send(AddRequest("good", "hello", plain(4)))
        assert isinstance(read_until_ended(connection, "good", {}), RequestMetrics)
    assert duplicate.error.reason == "duplicate_request_id" and invalid.error.reason == "invalid_structured_output"
    assert "secret" not in str(invalid.error)


def test_a_constrained_request_through_the_core_process_answers_in_its_language(core: EngineCoreClient,
                                                                                oracle: LLMEngine) -> None:
    choice = SamplingParams(max_tokens=16, temperature=0.7, seed=5, structured=CHOICE)
    handle = core.submit("which one", choice)
    assert all_tokens(list(handle.delta_batches())) == expected_tokens(oracle, "which one", choice)
