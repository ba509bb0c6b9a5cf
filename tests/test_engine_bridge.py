"""The bridge's own contract: named segments cross in one copy each way, counted, tolled, drained off-thread."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from engine.bridge import Bridge, CrossingCount, DownloadPlan, Toll
from engine.errors import EngineError

CPU = torch.device("cpu")


def test_an_upload_of_many_segments_is_one_crossing_and_each_segment_reads_back_as_written() -> None:
    bridge = Bridge(CPU)
    upload = bridge.upload()
    upload.add("ids", [3, -1, 7], torch.int64)
    upload.add("temperatures", [0.5, 1.25], torch.float32)
    upload.add("mask", [True, False, False, True], torch.bool, (2, 2))
    upload.add("table", torch.tensor([1, 2, 3, 4, 5, 6], dtype=torch.int32), torch.int32, (2, 3))
    with bridge.counting() as counted:
        views = bridge.send(upload)
    assert counted == CrossingCount(h2d=1, h2d_bytes=upload.nbytes)
    assert views["ids"].tolist() == [3, -1, 7]
    assert views["temperatures"].tolist() == [0.5, 1.25]
    assert views["mask"].tolist() == [[True, False], [False, True]]
    assert views["table"].tolist() == [[1, 2, 3], [4, 5, 6]]


def test_values_the_fast_writer_refuses_are_written_as_numpy_converts_them() -> None:
    bridge = Bridge(CPU)
    upload = bridge.upload()
    upload.add("wide", [1e39, -1e39, 0.5], torch.float32)  # past float32's range: numpy makes them infinite
    upload.add("ids", (5, 6), torch.int64)  # a tuple, not a list
    views = bridge.send(upload)
    assert views["wide"].tolist() == [float("inf"), float("-inf"), 0.5]
    assert views["ids"].tolist() == [5, 6]
    overflowing = bridge.upload()
    with pytest.raises(OverflowError):  # numpy's refusal, as before: no value wraps around
        overflowing.add("ids", [1 << 40], torch.int32)


def test_a_repeated_layout_reads_each_step_s_values_through_views_kept_until_the_buffer_grows() -> None:
    bridge = Bridge(CPU)
    seen = []
    for step in range(4):
        upload = bridge.upload()
        upload.add("ids", [step, step + 1], torch.int64)
        views = bridge.send(upload)
        assert views["ids"].tolist() == [step, step + 1]
        seen.append(views["ids"])
    assert all(view is seen[0] for view in seen)  # the same layout: the view made once serves again
    upload = bridge.upload()
    upload.add("ids", [9, 8], torch.int64)
    upload.add("big", list(range(20_000)), torch.int64)  # the device buffer grows: views of it are new
    views = bridge.send(upload)
    assert views["ids"] is not seen[0] and views["ids"].tolist() == [9, 8]
    assert views["big"][-1].item() == 19_999


def test_the_staging_buffer_is_reused_across_steps_and_grows_only_when_a_step_needs_more() -> None:
    bridge = Bridge(CPU)
    for _ in range(3):  # one staging buffer per turn
        first = bridge.upload()
        first.add("ids", list(range(10)), torch.int64)
        bridge.send(first)
    buffers = [staging.tensor.data_ptr() for staging in bridge._uploads.staging]
    for step in range(4):
        upload = bridge.upload()
        upload.add("ids", [step] * 10, torch.int64)
        assert bridge.send(upload)["ids"].tolist() == [step] * 10
    assert [staging.tensor.data_ptr() for staging in bridge._uploads.staging] == buffers


def test_segments_written_before_the_staging_buffer_grows_cross_as_written() -> None:
    bridge = Bridge(CPU)
    upload = bridge.upload()
    upload.add("small", [11, -12, 13], torch.int64)
    upload.add("large", list(range(20_000)), torch.int64)  # past the first buffer: it grows mid-upload
    views = bridge.send(upload)
    assert views["small"].tolist() == [11, -12, 13]
    assert views["large"].tolist() == list(range(20_000))


def test_a_segment_name_is_used_once_per_crossing_and_shapes_must_match() -> None:
    upload = Bridge(CPU).upload()
    upload.add("ids", [1], torch.int64)
    with pytest.raises(EngineError, match="already has a segment 'ids'"):
        upload.add("ids", [2], torch.int64)
    with pytest.raises(EngineError, match="holds 3 values"):
        upload.add("rows", [1, 2, 3], torch.int64, (2, 2))


def test_only_the_latest_upload_can_be_sent() -> None:
    bridge = Bridge(CPU)
    stale = bridge.upload()
    bridge.upload()
    with pytest.raises(EngineError, match="only the latest upload"):
        bridge.send(stale)


@pytest.mark.parametrize("on_worker", [False, True])
def test_a_download_of_many_tensors_is_one_crossing_and_its_values_come_back_by_name(on_worker: bool) -> None:
    bridge = Bridge(CPU, drain_on_worker=on_worker)
    plan = DownloadPlan()
    plan.add("tokens", torch.tensor([5, 9], dtype=torch.int64))
    plan.add("logprobs", torch.tensor([[-0.5, -1.5]], dtype=torch.float32))
    plan.add("residue", torch.tensor(0, dtype=torch.int64))
    with bridge.counting() as counted:
        download = bridge.fetch(plan)
        values = download.values()
    assert (counted.h2d, counted.d2h) == (0, 1)
    assert values == {"tokens": [5, 9], "logprobs": [-0.5, -1.5], "residue": [0]}


def test_a_download_keeps_its_values_when_later_downloads_reuse_the_host_buffers() -> None:
    bridge = Bridge(CPU, drain_on_worker=True)
    downloads = []
    for step in range(5):
        plan = DownloadPlan()
        plan.add("tokens", torch.full((3,), step, dtype=torch.int64))
        downloads.append(bridge.fetch(plan))
    assert [d.values()["tokens"] for d in downloads] == [[step] * 3 for step in range(5)]


def test_the_worker_drains_a_download_while_the_scheduling_thread_goes_on() -> None:
    bridge = Bridge(CPU, toll_us=20_000, drain_on_worker=True)
    plan = DownloadPlan()
    plan.add("tokens", torch.tensor([1]))
    download = bridge.fetch(plan)
    assert download._future is not None and not download._future.done()  # the toll is paid off this thread
    assert download.values() == {"tokens": [1]}


def zero(tensor: torch.Tensor) -> bool:
    return int(tensor.count_nonzero()) == 0


def test_an_uploads_bytes_are_zeroed_once_they_have_crossed_and_the_device_side_at_the_next_send() -> None:
    bridge = Bridge(CPU)
    first = bridge.upload()
    first.add("ids", [7, 8, 9, 10], torch.int64)
    first.add("scales", [0.5], torch.float32)
    views = bridge.send(first)
    assert views["ids"].tolist() == [7, 8, 9, 10] and views["scales"].tolist() == [0.5]
    assert all(zero(staging.tensor) for staging in bridge._uploads.staging)  # landed at once on a CPU
    shorter = bridge.upload()
    shorter.add("ids", [3], torch.int64)
    assert bridge.send(shorter)["ids"].tolist() == [3]
    # The device buffer holds this step's bytes; the first step's past them are zero.
    assert bridge._device_in.tensor[:8].tolist() != [0] * 8 and zero(bridge._device_in.tensor[8:])
    bridge.scrub()  # the engine goes idle
    assert zero(bridge._device_in.tensor)


@pytest.mark.parametrize("on_worker", [False, True])
def test_a_downloads_bytes_are_zeroed_on_the_device_side_once_copied_and_in_the_slot_once_read(on_worker) -> None:
    bridge = Bridge(CPU, drain_on_worker=on_worker)
    plan = DownloadPlan()
    plan.add("tokens", torch.tensor([5, 9], dtype=torch.int64))
    plan.add("logprobs", torch.tensor([-0.5], dtype=torch.float64))
    download = bridge.fetch(plan)
    assert zero(bridge._device_out.tensor)
    assert download.values() == {"tokens": [5, 9], "logprobs": [-0.5]}
    assert all(zero(slot.staging.tensor) for slot in bridge._slots)
    bridge.scrub()  # the download read: the bridge lets go of its values
    assert all(slot.reader is None for slot in bridge._slots)


def test_a_download_dropped_unread_is_zeroed_in_its_slot_when_the_bridge_is_scrubbed() -> None:
    # A step that raises after its fetch leaves its download unread: its picks must not wait in the pinned
    # slot for a later step to reuse it.
    bridge = Bridge(CPU)
    plan = DownloadPlan()
    plan.add("tokens", torch.tensor([5, 9], dtype=torch.int64))
    bridge.fetch(plan)
    assert not all(zero(slot.staging.tensor) for slot in bridge._slots)
    bridge.scrub()
    assert all(zero(slot.staging.tensor) for slot in bridge._slots)
    assert all(slot.reader is None for slot in bridge._slots)


def test_a_download_the_worker_drains_and_no_one_reads_is_waited_for_once_no_step_is_in_flight() -> None:
    # With async scheduling a step that raises drops its download unread while the worker drains it. An idle
    # scrub may run while another step is in flight and does not wait; once the engine says none is, it waits
    # for the drain, which zeroes the slot after the copy has landed, and lets go of the values.
    bridge = Bridge(CPU, drain_on_worker=True)
    gate = threading.Event()
    bridge._start(lambda: gate.wait(timeout=600))  # holds the worker: the drain below queues behind it
    plan = DownloadPlan()
    plan.add("tokens", torch.tensor([5, 9], dtype=torch.int64))
    bridge.fetch(plan)
    bridge.scrub()
    assert not all(zero(slot.staging.tensor) for slot in bridge._slots)
    assert any(slot.reader is not None for slot in bridge._slots)
    gate.set()
    bridge.scrub(settled=True)
    assert all(zero(slot.staging.tensor) for slot in bridge._slots)
    assert all(slot.reader is None for slot in bridge._slots)


def test_a_buffer_starts_zeroed_and_zeroes_the_buffer_it_outgrows() -> None:
    stale = torch.full((64 << 10,), 0xAB, dtype=torch.uint8)  # what the allocator hands out again once freed
    del stale
    bridge = Bridge(CPU)
    upload = bridge.upload()
    upload.add("ids", [1, 2], torch.int64)
    staging = bridge._uploads.staging[0]
    assert zero(staging.tensor[16:])
    outgrown = staging.tensor
    upload.add("large", list(range(1, 20_001)), torch.int64)  # grows mid-upload
    assert zero(outgrown) and staging.tensor[:16].view(torch.int64).tolist() == [1, 2]


def test_an_upload_packed_when_the_bridge_is_scrubbed_cannot_be_sent() -> None:
    bridge = Bridge(CPU)
    upload = bridge.upload()
    upload.add("ids", [4], torch.int64)
    bridge.scrub()
    with pytest.raises(EngineError, match="only the latest upload"):  # it would cross zeroed bytes
        bridge.send(upload)


def test_tolls_serialize_across_threads() -> None:
    toll = Toll(5_000)
    inside, most_inside = [0], [0]
    lock = threading.Lock()
    real_sleep = time.sleep

    def watched_sleep(seconds: float) -> None:
        with lock:
            inside[0] += 1
            most_inside[0] = max(most_inside[0], inside[0])
        real_sleep(seconds)
        with lock:
            inside[0] -= 1

    time.sleep = watched_sleep
    try:
        threads = [threading.Thread(target=toll.pay) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        time.sleep = real_sleep
    assert most_inside[0] == 1


def test_a_negative_toll_is_refused() -> None:
    with pytest.raises(EngineError, match="bridge_toll_us"):
        Toll(-1)


def test_weights_cross_in_chunks() -> None:
    bridge = Bridge(CPU)
    tensors = [(f"w{i}", torch.ones(256, dtype=torch.float32)) for i in range(10)]  # 1 KiB each
    with bridge.counting() as counted:
        loaded = bridge.load(iter(tensors), chunk_bytes=4096)
    assert counted.h2d == 3 and counted.h2d_bytes == 10 * 1024
    assert list(loaded) == [name for name, _ in tensors]


def test_per_step_counts_start_again_at_each_step() -> None:
    bridge = Bridge(CPU)
    for _ in range(2):
        bridge.begin_step()
        upload = bridge.upload()
        upload.add("ids", [1], torch.int64)
        bridge.send(upload)
        plan = DownloadPlan()
        plan.add("tokens", torch.tensor([1]))
        bridge.read(plan)
    bridge.begin_step()
    assert (bridge.last_step.h2d, bridge.last_step.d2h) == (1, 1)
    assert (bridge.total.h2d, bridge.total.d2h) == (2, 2)
