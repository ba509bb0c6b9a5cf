"""Every check only a CUDA GPU can make, prepared to run in few calls to a lent machine, its logs kept.

A lent GPU comes for minutes, so what needs one is set out here as stages, run in the order given, each
under its own time limit, its whole output saved to OUT/<stage>.log and its result lines (targets and
verdicts, the tests' summary) printed when it ends, then a table of every stage's status and time:

  tests      the GPU tests: `pytest -m gpu` over the test files that hold them, dealt out to several
             pytest processes at once on the one GPU (gpu_tests.py), killed at its own deadline
  parity     gpu_parity.py --preset-1b: greedy tokens on CUDA against `transformers` on CUDA (fp32, bf16)
             and stories260K on CUDA against the CPU
  engine-1b  engine_gpu.py --preset 1b --bridge-toll-us 300: decode step times, the crossings under the
             CUDA profiler, offline throughput, zero-on-free, the toll, `transformers` compiled
  sync-1b    engine_gpu.py --preset 1b --sync-scheduling --decode-only
  eager-1b   engine_gpu.py --preset 1b --eager --decode-only
  kernels    kernels.py: paged attention and zeroing bandwidth
  e2e        e2e.py --concurrency 1 64: the encrypted path against the engine in-process
  engine-8b  engine_gpu.py --preset 8b --decode-only

With --budget S a stage whose limit no longer fits in what is left of S seconds is not started, so a
call's own time limit never cuts a stage off with its log unwritten.

The device image has torch, triton and transformers but not the project's web and crypto dependencies:
`make gpu-wheels` downloads them (benchmarks/gpu_wheels.txt) into .whl/, which a call carries
(`carry: [".whl"]`); this script installs them into a folder of its own before the first stage. The
project itself is not installed there (its torch pin is this machine's CPU build): the stages import it
from the checkout. A call's start costs about 40 s of device time and an idle machine 30 s more (give it
back), so two calls fit the device time of a session (timings of benchmarks/results/gpu-2026-11-27.md: the
first 50 GPU tests (the engine ones, each building an engine and capturing graphs) took 150 s run one after
another, which is why the tests stage now runs them over several processes; the 1b engine stage took 135 s,
the decode-only ones 17-60 s):

    python3 benchmarks/gpu_session.py --out $OUT --budget 335 tests parity kernels
    python3 benchmarks/gpu_session.py --out $OUT --budget 495 engine-1b sync-1b eager-1b e2e engine-8b

After a failure, `--tests-k EXPR` re-runs only the tests it names (pytest's -k), under a limit of its own.

    python3 benchmarks/gpu_session.py [--out DIR] [--budget S] [--wheels DIR] [--list] [--dry-run] [STAGE ...]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
WHEELS = REPO_ROOT / ".whl"
SITE = Path("/tmp/veil-gpu-site")  # the carried wheels, installed outside the checkout
# A decorator or a module's `pytestmark` naming the mark, at the start of a line (not a string that quotes it).
GPU_MARK = re.compile(r"^(@pytest\.mark\.gpu\b|pytestmark = .*\bpytest\.mark\.gpu\b)", re.MULTILINE)
TESTS_LIMIT_S = 170
RETEST_LIMIT_S = 60  # the tests stage narrowed by --tests-k
TESTS_MARGIN_S = 10  # the workers are killed this long before the tests stage's limit
OUT_FIELD = "{out}"  # in a stage's arguments: the call's output folder
# Lines of a stage's output worth printing as it ends: the benchmarks' figures and the tests' summary.
RESULT_WORDS = ("target", "ms/step", "tok/s", "crossings", "copies seen", "load:", "device:", "model:", "memory:",
                "ratio", "passed", "failed", "error", "Error", "GB/s", "bandwidth", "TTFT", "parity:")


@dataclass(frozen=True, slots=True)
class Stage:
    name: str
    argv: tuple[str, ...]  # run with this machine's python3 from the repository root
    limit_s: int  # killed past this; what it printed is kept


def gpu_test_files(tests: Path = REPO_ROOT / "tests") -> list[str]:
    """The test files with GPU tests: collecting only those keeps the CPU-only suites' imports out of it."""
    return sorted(path.relative_to(REPO_ROOT).as_posix() for path in tests.glob("test_*.py")
                  if GPU_MARK.search(path.read_text()))


def tests_stage(limit_s: int, keyword: str | None = None) -> Stage:
    """The GPU tests over several processes at once (`gpu_tests.py`), whose own deadline comes first so that
    it kills its workers and prints its summary before this stage's limit would cut it off."""
    return Stage("tests", ("benchmarks/gpu_tests.py", "--deadline-s", str(limit_s - TESTS_MARGIN_S), "--out", OUT_FIELD,
                           *(["-k", keyword] if keyword else [])), limit_s)


def stages() -> dict[str, Stage]:
    gpu = ("benchmarks/engine_gpu.py",)
    listed = [
        tests_stage(TESTS_LIMIT_S),
        Stage("parity", ("benchmarks/gpu_parity.py", "--preset-1b"), 100),
        Stage("engine-1b", (*gpu, "--preset", "1b", "--bridge-toll-us", "300"), 200),
        Stage("sync-1b", (*gpu, "--preset", "1b", "--sync-scheduling", "--decode-only"), 40),
        Stage("eager-1b", (*gpu, "--preset", "1b", "--eager", "--decode-only"), 40),
        Stage("kernels", ("benchmarks/kernels.py",), 30),
        Stage("e2e", ("benchmarks/e2e.py", "--concurrency", "1", "64"), 90),
        Stage("engine-8b", (*gpu, "--preset", "8b", "--decode-only", "--batches", "1", "64", "256"), 90),
    ]
    return {stage.name: stage for stage in listed}


def install_wheels(folder: Path) -> dict[str, str]:
    """The environment for the stages: the checkout, then the carried wheels, on the import path."""
    path = [str(REPO_ROOT)]
    wheels = sorted(folder.glob("*.whl"))
    if wheels:
        print(f"installing {len(wheels)} carried wheels into {SITE} ...", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", str(SITE), *map(str, wheels)], check=True)
        path.append(str(SITE))
    else:
        print(f"no wheels in {folder}: the stages import what this machine has (`make gpu-wheels` to bring more)")
    inherited = os.environ.get("PYTHONPATH")
    return os.environ | {"PYTHONPATH": os.pathsep.join(path + ([inherited] if inherited else [])),
                         "PYTHONUNBUFFERED": "1"}


def run_stage(stage: Stage, out: Path, env: dict[str, str]) -> tuple[str, float]:
    """Runs one stage, its output to OUT/<name>.log; its status ('ok', 'exit N' or 'timed out') and seconds."""
    log = out / f"{stage.name}.log"
    print(f"\n== {stage.name} (at most {stage.limit_s} s): python3 {' '.join(stage.argv)}", flush=True)
    started = time.monotonic()
    with log.open("w") as sink:
        try:
            argv = [part.replace(OUT_FIELD, str(out)) for part in stage.argv]
            code = subprocess.run([sys.executable, *argv], cwd=REPO_ROOT, env=env, stdout=sink,
                                  stderr=subprocess.STDOUT, timeout=stage.limit_s).returncode
            status = "ok" if code == 0 else f"exit {code}"
        except subprocess.TimeoutExpired:
            status = "timed out"
    elapsed = time.monotonic() - started
    for line in log.read_text(errors="replace").splitlines():
        if any(word in line for word in RESULT_WORDS):
            print(f"  {line}")
    print(f"-- {stage.name}: {status} in {elapsed:.0f} s (whole output: {log})", flush=True)
    return status, elapsed


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stages", nargs="*", metavar="STAGE", help="stages to run, in order (default: all)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-session")),
                        help="folder for the stages' logs and the summary (default: $OUT, else ./gpu-session)")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds this call may take: a stage whose limit no longer fits is not started")
    parser.add_argument("--wheels", type=Path, default=WHEELS,
                        help="folder of wheels to install before the first stage (default: .whl, `make gpu-wheels`)")
    parser.add_argument("--tests-k", metavar="EXPR",
                        help="the tests stage runs only the GPU tests pytest's -k EXPR selects (a re-run of failures)")
    parser.add_argument("--list", action="store_true", help="print the stages and exit")
    parser.add_argument("--dry-run", action="store_true", help="print what each stage would run and exit")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    known = stages()
    if args.tests_k:
        # A re-run of a few failures: a limit of its own, so the stages after it still fit a budget.
        known["tests"] = tests_stage(RETEST_LIMIT_S, args.tests_k)
    unknown = [name for name in args.stages if name not in known]
    if unknown:
        print(f"unknown stage(s): {', '.join(unknown)}; the stages are {', '.join(known)}", file=sys.stderr)
        return 2
    chosen = [known[name] for name in args.stages] or list(known.values())
    if args.list or args.dry_run:
        for stage in chosen:
            print(f"{stage.name:10} {stage.limit_s:4d} s  " + (f"python3 {' '.join(stage.argv)}" if args.dry_run else ""))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    started, env = time.monotonic(), install_wheels(args.wheels)
    summary: list[str] = []
    for stage in chosen:
        left = None if args.budget is None else args.budget - (time.monotonic() - started)
        if left is not None and stage.limit_s > left:
            summary.append(f"{stage.name:10} not started: its {stage.limit_s} s limit exceeds the {left:.0f} s left")
            continue
        status, elapsed = run_stage(stage, args.out, env)
        summary.append(f"{stage.name:10} {status} in {elapsed:.0f} s")
    (args.out / "summary.txt").write_text("\n".join(summary) + "\n")
    print("\n" + "\n".join(summary))
    return 0 if all(line.split()[1] == "ok" for line in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
