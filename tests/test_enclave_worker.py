"""The node's engine thread and the readers of its requests: batching of deltas a reader fell behind on."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from enclave.engine_worker import EngineWorker, Failure, RequestHandle
from engine import EngineError, SamplingParams, StreamDelta
from engine.outputs import RequestMetrics
from tests.engine_models import tiny_engine

LONG = SamplingParams(max_tokens=300, temperature=1.0, seed=3, ignore_eos=True)


@pytest.fixture(scope="module")
def worker() -> Iterator[EngineWorker]:
    running = EngineWorker(tiny_engine(kv_cache_gib=0.05, device="cpu"))
    running.start()
    yield running
    running.stop()


def wait_until_idle(worker: EngineWorker, timeout_s: float = 60.0) -> None:
    worker.call(lambda engine: None)  # commands run in order: every submitted request is in the engine now
    deadline = time.monotonic() + timeout_s
    while worker.in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert worker.in_flight == 0, "the engine did not finish the request in time"


def expected_tokens(worker: EngineWorker, prompt: str, params: SamplingParams) -> tuple[int, ...]:
    return tuple(worker.call(lambda engine: engine.generate([prompt], params))[0].outputs[0].token_ids)


def test_deltas_queued_while_the_reader_was_busy_arrive_as_one_batch(worker: EngineWorker) -> None:
    params = SamplingParams(max_tokens=40, temperature=0.7, seed=11, ignore_eos=True)
    handle = worker.submit("batched while nobody reads", params)
    wait_until_idle(worker)  # every delta of the request is queued; nobody has read one yet

    batches = list(handle.delta_batches())

    assert len(batches) == 1 and len(batches[0]) == 40
    tokens = tuple(token for delta in batches[0] for token in delta.token_ids)
    assert tokens == expected_tokens(worker, "batched while nobody reads", params)
    assert batches[0][-1].request_finished and handle.finished


def test_a_reader_that_keeps_up_gets_the_answer_in_pieces_in_order(worker: EngineWorker) -> None:
    handle = worker.submit("read as it is made", LONG)
    batches = list(handle.delta_batches())

    assert len(batches) > 1  # streamed as produced, not held until the end
    assert all(batches) and not any(delta.request_finished for batch in batches[:-1] for delta in batch)
    tokens = tuple(token for batch in batches for delta in batch for token in delta.token_ids)
    assert tokens == expected_tokens(worker, "read as it is made", LONG)


def test_deltas_before_a_failure_are_delivered_then_the_error_is_raised(worker: EngineWorker) -> None:
    handle = RequestHandle(worker, "not-submitted")
    produced = [StreamDelta("not-submitted", 0, "", (token,)) for token in (5, 6, 7)]
    for delta in produced:
        handle.queue.put(delta)
    handle.queue.put(Failure(EngineError("the engine failed while serving this request")))

    batches = handle.delta_batches()
    assert next(batches) == produced
    with pytest.raises(EngineError, match="failed while serving"):
        next(batches)
    assert handle.finished


def test_a_stopped_engine_ends_the_stream_with_an_error_not_silence(worker: EngineWorker) -> None:
    handle = RequestHandle(worker, "not-submitted")
    handle.queue.put(StreamDelta("not-submitted", 0, "", (9,)))
    handle.queue.put(None)

    batches = handle.delta_batches()
    assert [delta.token_ids for delta in next(batches)] == [(9,)]
    with pytest.raises(EngineError, match="stopped before this request finished"):
        next(batches)


def test_nothing_is_read_past_the_last_delta_of_a_request(worker: EngineWorker) -> None:
    handle = RequestHandle(worker, "not-submitted")
    last = StreamDelta("not-submitted", 0, "", (1,), metrics=RequestMetrics(1, 1, 0.0, 0.0, 0.0))
    handle.queue.put(last)
    assert list(handle.delta_batches()) == [[last]]
    assert list(handle.deltas()) == []  # finished: a second reader gets nothing, and never blocks


def test_the_worker_counts_requests_that_ended_finished_or_aborted(worker: EngineWorker) -> None:
    worker.call(lambda engine: worker.take_requests_ended())  # start from zero
    handles = [worker.submit(f"count me {i}", SamplingParams(max_tokens=3, temperature=0.0)) for i in range(3)]
    for handle in handles:
        list(handle.deltas())
    assert worker.call(lambda engine: worker.take_requests_ended()) == 3
    assert worker.call(lambda engine: worker.take_requests_ended()) == 0  # taken once
    long = worker.submit("aborted", LONG)
    next(long.deltas())
    long.close()
    wait_until_idle(worker)
    assert worker.call(lambda engine: worker.take_requests_ended()) == 1
