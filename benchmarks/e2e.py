"""The price of the encrypted path: the same workload in-process through the engine, and through
SDK → gateway → node on loopback (attestation checked, OHTTP end to end, chunked streaming).

Workload: 64 text completions (seeded prompts of 8-64 words, 32 output tokens each, temperature 0.8
with a per-request seed), at concurrency 1, 8 and 32. The fleet has ONE node, so every path runs
one engine. Same seeds on every path give the same tokens; the run checks it. Two in-process
baselines, each with at most C requests in the engine at once:

- engine loop: one thread adds requests and calls `step()`; a request joins exactly at a step
  boundary, which no server can promise, so this is the strictest baseline;
- engine core: the node's own engine core process with C reader threads, as the node runs it;
  requests arrive whenever their reader is ready. The difference to the encrypted path is then
  exactly SDK + gateway + OHTTP + gRPC.

By default the node (and both baselines) run on their own core(s) and the SDK's threads and the
gateway on the others, as separate machines would; `--shared-cpus` lets everything share every core.

Prints, per concurrency: output tokens/s and p50 (and p99) time to first token for each path, the
encrypted path's throughput ratio (target ≥ 0.90) and added median TTFT (target ≤ 15 ms) against
both baselines.

    python benchmarks/e2e.py [--quick] [--preset bench] [--model DIR] [--concurrency 1 8 32]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import progress  # noqa: E402

WORDS = ("light", "harbour", "keeper", "storm", "signal", "north", "stone", "quiet", "tide", "lamp", "ship", "night")


@dataclass(frozen=True)
class Job:
    prompt: str
    seed: int
    max_tokens: int


@dataclass(frozen=True)
class Result:
    ttft_s: float
    text: str
    tokens: int


@dataclass(frozen=True)
class Run:
    elapsed_s: float
    results: list[Result]

    @property
    def tokens_per_s(self) -> float:
        return sum(r.tokens for r in self.results) / self.elapsed_s

    def ttft_ms(self, q: float) -> float:
        values = sorted(r.ttft_s * 1000 for r in self.results)
        return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def make_jobs(count: int, max_tokens: int) -> list[Job]:
    rng = random.Random(2024)
    return [Job(" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 64))), seed, max_tokens)
            for seed in range(count)]


# ----- in-process ---------------------------------------------------------------------------------


def run_in_process(engine, jobs: list[Job], concurrency: int) -> Run:
    from engine import SamplingParams

    pending, active = deque(enumerate(jobs)), {}
    first: dict[int, float] = {}
    texts: dict[int, list[str]] = {i: [] for i in range(len(jobs))}
    tokens = dict.fromkeys(range(len(jobs)), 0)
    started = time.perf_counter()
    while pending or engine.has_unfinished():
        while pending and len(active) < concurrency:
            index, job = pending.popleft()
            params = SamplingParams(max_tokens=job.max_tokens, temperature=0.8, seed=job.seed)
            active[engine.add_request(job.prompt, params)] = (index, time.perf_counter())
        for delta in engine.step():
            index, added = active[delta.request_id]
            if delta.token_ids and index not in first:
                first[index] = time.perf_counter() - added
            texts[index].append(delta.text)
            tokens[index] += len(delta.token_ids)
            if delta.request_finished:
                del active[delta.request_id]
    elapsed = time.perf_counter() - started
    return Run(elapsed, [Result(first.get(i, elapsed), "".join(texts[i]), tokens[i]) for i in range(len(jobs))])


# ----- encrypted ----------------------------------------------------------------------------------


def run_engine_core(core, jobs: list[Job], concurrency: int) -> Run:
    from engine import SamplingParams

    def one(index: int) -> Result:
        job = jobs[index]
        params = SamplingParams(max_tokens=job.max_tokens, temperature=0.8, seed=job.seed)
        sent = time.perf_counter()
        ttft, pieces, tokens = None, [], 0
        for batch in core.submit(job.prompt, params).delta_batches():
            for delta in batch:
                if ttft is None and delta.token_ids:
                    ttft = time.perf_counter() - sent
                pieces.append(delta.text)
                tokens += len(delta.token_ids)
        return Result(ttft or 0.0, "".join(pieces), tokens)

    return _threaded(one, len(jobs), concurrency)


def _threaded(one, count: int, concurrency: int) -> Run:
    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, range(count)))
    return Run(time.perf_counter() - started, results)


def run_encrypted(client, model: str, jobs: list[Job], concurrency: int, reference: list[Result]) -> Run:
    def one(index: int) -> Result:
        job = jobs[index]
        sent = time.perf_counter()
        ttft, pieces = None, []
        for chunk in client.completions.create(model=model, prompt=job.prompt, max_tokens=job.max_tokens,
                                               temperature=0.8, seed=job.seed, stream=True):
            if ttft is None:
                ttft = time.perf_counter() - sent
            pieces.append(chunk.choices[0].text)
        # Token counts are not streamed; same seed, same text, same tokens (checked below).
        return Result(ttft or 0.0, "".join(pieces), reference[index].tokens)

    return _threaded(one, len(jobs), concurrency)


# ----- main ---------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 16 requests, 8 tokens, concurrency 1 and 4")
    parser.add_argument("--requests", type=int, default=64, help="requests per concurrency level (default: 64)")
    parser.add_argument("--max-tokens", type=int, default=32, help="output tokens per request (default: 32)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32],
                        help="requests in flight at once, one run per value (default: 1 8 32)")
    parser.add_argument("--model", type=Path, default=None, help="model folder (default: the built-in tiny model)")
    parser.add_argument("--preset", choices=("tiny", "bench"), default="tiny",
                        help="built-in model when --model is not given: tiny (tests, demo) or bench (~46M parameters)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for the engine on every path (default 1: on a small shared machine more "
                             "threads than free cores make OpenMP spin, and the comparison would measure that)")
    parser.add_argument("--shared-cpus", action="store_true",
                        help="let node, gateway and SDK share every core instead of giving the node its own")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.max_tokens, args.concurrency = 16, 8, [1, 4]
    cpus = None if args.shared_cpus else split_cpus(args.threads)
    with tempfile.TemporaryDirectory(prefix="veil-bench-") as workdir:
        model_dir = args.model or _builtin_model(Path(workdir), args.preset)
        jobs = make_jobs(args.requests, args.max_tokens)
        loop, thread = _baselines(model_dir, jobs, args.concurrency, args.threads, cpus)
        encrypted = _encrypted(model_dir, Path(workdir), jobs, args.concurrency, loop, args.threads, cpus)
    _report(args, cpus, loop, thread, encrypted)
    return 0


@dataclass(frozen=True)
class CpuSplit:
    node: frozenset[int]
    others: frozenset[int]  # the gateway and the SDK's threads


def split_cpus(threads: int) -> CpuSplit | None:
    """The last `threads` cores for the node, the rest for everything else; None where that cannot be done."""
    if not hasattr(os, "sched_getaffinity"):
        print("note: cannot pin processes here; node, gateway and SDK share every core", file=sys.stderr)
        return None
    available = sorted(os.sched_getaffinity(0))
    if len(available) <= threads:
        print(f"note: {len(available)} core(s) cannot give the node {threads} of its own; everything shares them",
              file=sys.stderr)
        return None
    return CpuSplit(frozenset(available[-threads:]), frozenset(available[:-threads]))


def _builtin_model(root: Path, preset: str) -> Path:
    from engine.tiny import write_tiny_model

    return write_tiny_model(root / f"{preset}-model", preset=preset)


def _baselines(
    model_dir: Path, jobs: list[Job], levels: list[int], threads: int, cpus: CpuSplit | None
) -> tuple[dict[int, Run], dict[int, Run]]:
    import torch

    from engine import EngineConfig, LLMEngine, SamplingParams
    from engine.core_client import EngineCoreClient
    from veil.fleet import pinned

    torch.set_num_threads(threads)
    with pinned(cpus.node if cpus else None):
        engine = LLMEngine(model_dir, EngineConfig(kv_cache_gib=0.25, max_num_seqs=64))
        engine.generate(["warm up"], SamplingParams(max_tokens=4))
        loop = {c: _timed(f"engine loop, concurrency {c}", run_in_process, engine, jobs, c) for c in levels}
        del engine
        os.environ["OMP_NUM_THREADS"] = str(threads)  # the core process reads it as it starts, as the node's does
        core = EngineCoreClient(model_dir, EngineConfig(kv_cache_gib=0.25, max_num_seqs=64))
        core.start()  # the process, and the readers' threads below, inherit the node's cores
        try:
            list(core.submit("warm up", SamplingParams(max_tokens=4)).deltas())
            thread = {c: _timed(f"engine core, concurrency {c}", run_engine_core, core, jobs, c) for c in levels}
        finally:
            core.stop()
    return loop, thread


def _encrypted(
    model_dir: Path, workdir: Path, jobs: list[Job], levels: list[int], baseline: dict[int, Run], threads: int,
    cpus: CpuSplit | None,
) -> dict[int, Run]:
    from attestation.sim_root import ROOT_DIR_ENV
    from client.sdk import Client
    from veil.fleet import Fleet, FleetSettings, pinned

    settings = FleetSettings(nodes=1, model_dir=model_dir, workdir=workdir / "fleet", capacity=max(levels),
                             kv_cache_gib=0.25, torch_threads=threads,
                             node_cpus=cpus.node if cpus else None, gateway_cpus=cpus.others if cpus else None)
    progress("starting a gateway and one node ...")
    with Fleet(settings) as fleet, pinned(cpus.others if cpus else None):
        os.environ[ROOT_DIR_ENV] = str(fleet.sim_root_dir)
        with Client(fleet.gateway_url, policy="dev") as client:
            model = client.models.list().data[0].id
            client.completions.create(model=model, prompt="warm up", max_tokens=4)
            runs = {c: _timed(f"encrypted, concurrency {c}", run_encrypted, client, model, jobs, c, baseline[c].results)
                    for c in levels}
    for c, run in runs.items():
        mismatched = sum(a.text != b.text for a, b in zip(run.results, baseline[c].results))
        if mismatched:
            print(f"note: {mismatched}/{len(jobs)} answers at concurrency {c} differ from the in-process ones "
                  "(batch composition changes float rounding); token counts are approximate", file=sys.stderr)
    return runs


def _timed(label: str, run, *arguments) -> Run:
    progress(f"{label} ...")
    result = run(*arguments)
    progress(f"{label}: {result.tokens_per_s:.1f} tok/s")
    return result


def _report(args: argparse.Namespace, cpus: CpuSplit | None, loop: dict[int, Run], thread: dict[int, Run],
            encrypted: dict[int, Run]) -> None:
    placement = (f"node on core(s) {sorted(cpus.node)}, gateway and SDK on {sorted(cpus.others)}" if cpus
                 else "node, gateway and SDK sharing every core")
    print(f"\nend-to-end: {args.requests} requests x {args.max_tokens} tokens, one node, loopback, "
          f"{args.threads} torch thread(s) per engine, {placement}; SIMULATED attestation (the cryptography is real)")
    header = (f"{'conc':>4} | {'engine loop':^21} | {'engine core':^21} | {'encrypted':^31} | "
              f"{'tput ratio vs':^15} | {'+p50 ttft vs':^17}")
    sub = (f"{'':>4} | {'tok/s':>10} {'p50 ttft':>10} | {'tok/s':>10} {'p50 ttft':>10} | "
           f"{'tok/s':>10} {'p50 ttft':>10} {'p99 ttft':>9} | {'loop':>7} {'core':>7} | {'loop':>8} {'core':>8}")
    print(header)
    print(sub)
    print("-" * len(sub))
    for c in sorted(loop):
        a, b, e = loop[c], thread[c], encrypted[c]
        print(f"{c:>4} | {a.tokens_per_s:>10.1f} {a.ttft_ms(0.5):>8.1f}ms | {b.tokens_per_s:>10.1f} {b.ttft_ms(0.5):>8.1f}ms | "
              f"{e.tokens_per_s:>10.1f} {e.ttft_ms(0.5):>8.1f}ms {e.ttft_ms(0.99):>7.1f}ms | "
              f"{e.tokens_per_s / a.tokens_per_s:>7.2f} {e.tokens_per_s / b.tokens_per_s:>7.2f} | "
              f"{e.ttft_ms(0.5) - a.ttft_ms(0.5):>6.1f}ms {e.ttft_ms(0.5) - b.ttft_ms(0.5):>6.1f}ms")
    print("targets: throughput ratio >= 0.90, added median TTFT <= 15 ms")


if __name__ == "__main__":
    sys.exit(main())
