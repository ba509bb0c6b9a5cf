"""The GPU tests dealt out to several pytest processes sharing one GPU, under one deadline.

Run one after another, the GPU tests outlast what a lent machine's minutes allow: on the H100 of
benchmarks/results/gpu-2026-11-27.md the first 50 of 322 took 150 s, each engine test building an engine
and capturing its graphs, each kernel test compiling its Triton shapes. Both are host work, and the lent
machine has 16 cores, so this collects the tests, deals them out to WORKERS pytest processes (round robin
in collection order, so that each file's slow tests spread over all of them), runs those at once, each
one's output in OUT/tests-<n>.log, and kills every worker still running at the deadline (with its own
children: a stage's time limit alone would leave them holding the GPU). Then one summary: passed, failed,
errors, skipped, not run, and the node id of every test that did not pass. Exit status 0 only when every
test collected passed or was skipped. Tests marked `gpu_alone` (they read the device's free memory, which
another process would move) run first, in one worker with nothing beside it.

    python3 benchmarks/gpu_tests.py [--workers 8] [--deadline-s 160] [--out DIR] [-m gpu] [-k EXPR] [FILE ...]
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
COLLECT_LIMIT_S = 120  # collecting imports torch and the project once
OUTCOME = re.compile(r"^(?P<node>\S+::.+?) (?P<outcome>PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
NOT_PASSING = ("FAILED", "ERROR", "XPASS")
ALONE = "gpu_alone"  # the mark of a test that must have the device to itself


@dataclass(frozen=True, slots=True)
class Worker:
    index: int
    nodes: list[str]
    log: Path
    process: subprocess.Popen


def default_workers() -> int:
    return max(1, min(8, (os.cpu_count() or 2) // 2))


def collect(files: list[str], marker: str, keyword: str | None) -> list[str]:
    """The node ids pytest selects, in collection order."""
    argv = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", marker,
            *(["-k", keyword] if keyword else []), *files]
    listing = subprocess.run(argv, capture_output=True, text=True, timeout=COLLECT_LIMIT_S)
    if listing.returncode not in (0, 5):  # 5: nothing selected
        raise SystemExit(f"collecting the tests failed (exit {listing.returncode}):\n{listing.stdout[-3000:]}"
                         f"{listing.stderr[-2000:]}")
    return [line.strip() for line in listing.stdout.splitlines() if "::" in line and not line.startswith(" ")]


def deal(nodes: list[str], workers: int) -> list[list[str]]:
    """Round robin in collection order: each file's tests, slow or quick, spread over every worker."""
    shards = [nodes[index::workers] for index in range(workers)]
    return [shard for shard in shards if shard]


def start(index: int, nodes: list[str], out: Path) -> Worker:
    log = out / f"tests-{index}.log"
    argv = [sys.executable, "-m", "pytest", "-v", "--tb=short", "-rfE", "-p", "no:cacheprovider", *nodes]
    with log.open("w") as sink:  # the child keeps its own handle
        process = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    return Worker(index, nodes, log, process)


def run_phase(shards: list[list[str]], first_index: int, out: Path, deadline: float) -> tuple[list[Worker], list[Worker]]:
    """Runs one worker per shard at once until the deadline: (every worker, those killed at the deadline)."""
    workers = [start(first_index + index, shard, out) for index, shard in enumerate(shards)]
    return workers, wait_all(workers, deadline)


def wait_all(workers: list[Worker], deadline: float) -> list[Worker]:
    """Waits for every worker until the deadline; kills the process group of each still running (returned)."""
    for worker in workers:
        try:
            worker.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    late = [worker for worker in workers if worker.process.poll() is None]
    for worker in late:
        try:
            os.killpg(worker.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        worker.process.wait()
    return late


def outcomes(workers: list[Worker]) -> dict[str, str]:
    """Each node id's outcome, as the workers' logs report it (a test erroring at teardown after it passed
    counts as the error)."""
    found: dict[str, str] = {}
    for worker in workers:
        for line in worker.log.read_text(errors="replace").splitlines():
            match = OUTCOME.match(line)
            if match and found.get(match["node"]) not in NOT_PASSING:
                found[match["node"]] = match["outcome"]
    return found


def summarize(nodes: list[str], found: dict[str, str], late: list[Worker], seconds: float, workers: int) -> list[str]:
    counts = Counter(found.get(node, "NOT RUN") for node in nodes)
    lines = [f"gpu tests: {counts['PASSED']} passed, {counts['FAILED']} failed, {counts['ERROR']} errors, "
             f"{counts['SKIPPED'] + counts['XFAIL']} skipped, {counts['NOT RUN']} not run, of {len(nodes)} "
             f"collected, in {seconds:.0f} s over {workers} workers"]
    if late:
        lines.append(f"deadline reached: worker(s) {', '.join(str(worker.index) for worker in late)} killed")
    lines += [f"  {found.get(node, 'NOT RUN').lower()}: {node}" for node in nodes
              if found.get(node, "NOT RUN") in (*NOT_PASSING, "NOT RUN")]
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="*", help="test files (default: every tests/ file holding GPU tests)")
    parser.add_argument("--workers", type=int, default=default_workers(),
                        help="pytest processes at once (default: half the cores, at most 8)")
    parser.add_argument("--deadline-s", type=float, default=160,
                        help="seconds from the start after which every worker still running is killed")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-session")),
                        help="folder for the workers' logs (default: $OUT, else ./gpu-session)")
    parser.add_argument("-m", dest="marker", default="gpu", help="pytest marker expression (default: gpu)")
    parser.add_argument("-k", dest="keyword", default=None, help="pytest -k expression: only the tests it selects")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    if not args.files:
        from benchmarks.gpu_session import gpu_test_files
        args.files = gpu_test_files()
    alone = collect(args.files, f"({args.marker}) and {ALONE}", args.keyword)
    shared = collect(args.files, f"({args.marker}) and not {ALONE}", args.keyword)
    nodes = alone + shared
    if not nodes:
        print("gpu tests: none collected", flush=True)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    deadline, shards = started + args.deadline_s, deal(shared, args.workers)
    print(f"{len(alone)} tests alone, then {len(shared)} over {len(shards)} workers; logs in "
          f"{args.out}/tests-<n>.log", flush=True)
    first, late = run_phase([alone] if alone else [], 0, args.out, deadline)
    rest, late_too = run_phase(shards, len(first), args.out, deadline)
    found = outcomes(first + rest)
    lines = summarize(nodes, found, late + late_too, time.monotonic() - started, len(shards))
    print("\n".join(lines), flush=True)
    return 0 if all(found.get(node) in ("PASSED", "SKIPPED", "XFAIL") for node in nodes) else 1


if __name__ == "__main__":
    sys.path.insert(0, str(REPO_ROOT))
    sys.exit(main())
