"""The local fleet's process placement: pinning a block (and what it starts) to CPUs, and nothing else."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from engine.tiny import write_tiny_model
from veil.fleet import Fleet, FleetError, FleetSettings, pinned
from tests.conftest import HANG_S

needs_affinity = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux-only")


def child_affinity() -> set[int]:
    printed = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                             capture_output=True, text=True, check=True).stdout
    return set(json.loads(printed))


@needs_affinity
def test_a_pinned_block_and_the_processes_it_starts_run_on_the_given_cpus_only() -> None:
    before = os.sched_getaffinity(0)
    one = frozenset({min(before)})
    with pinned(one):
        assert os.sched_getaffinity(0) == one
        assert child_affinity() == one
    assert os.sched_getaffinity(0) == before
    assert child_affinity() == before


@needs_affinity
def test_pinning_leaves_the_callers_other_threads_where_they_were() -> None:
    before = os.sched_getaffinity(0)
    seen: list[set[int]] = []
    inside, checked = threading.Event(), threading.Event()

    def other_thread() -> None:
        inside.wait(HANG_S)
        seen.append(os.sched_getaffinity(0))
        checked.set()

    thread = threading.Thread(target=other_thread)
    thread.start()
    with pinned(frozenset({min(before)})):
        inside.set()
        checked.wait(HANG_S)
    thread.join(HANG_S)
    assert seen == [before]


def test_no_cpus_means_no_change() -> None:
    before = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    with pinned(None):
        if before is not None:
            assert os.sched_getaffinity(0) == before


@needs_affinity
def test_an_impossible_cpu_set_is_an_error_before_anything_starts() -> None:
    with pytest.raises(OSError):
        with pinned(frozenset({10_000})):
            pass


def test_a_fleet_needs_one_to_thirty_two_nodes() -> None:
    for count in (0, 33):
        with pytest.raises(FleetError, match="1 to 32 nodes"):
            FleetSettings(nodes=count)


@pytest.mark.slow
def test_a_fleet_starts_again_in_the_work_folder_of_a_stopped_one(tmp_path: Path) -> None:
    settings = FleetSettings(nodes=1, model_dir=write_tiny_model(tmp_path / "tiny"), workdir=tmp_path / "fleet",
                             torch_threads=1)
    for _ in range(2):
        with Fleet(settings) as fleet:
            assert fleet.pool_size() == 1
    assert (tmp_path / "fleet" / "run").is_dir()  # the same folder both times, port files and all


@pytest.mark.slow
def test_a_process_that_refuses_to_start_is_quoted_in_the_error(tmp_path: Path) -> None:
    settings = FleetSettings(nodes=1, model_dir=write_tiny_model(tmp_path / "tiny"), capacity=100, torch_threads=1)
    with pytest.raises(FleetError, match=r"node-0 exited with status 2 while starting: .*max_node_capacity"):
        Fleet(settings).start()
