"""The price of the encrypted path: the same workload in-process through the engine, and through
SDK → gateway → node on loopback (attestation checked, OHTTP end to end, chunked streaming).

Workload: 64 text completions (seeded prompts of 8-64 words, 32 output tokens each, temperature 0.8
with a per-request seed), at concurrency 1, 8 and 32. In-process, at most C requests are in the
engine at once; encrypted, C threads share one `Client` and stream every answer. The fleet has ONE
node, so both paths run one engine. Same seeds on both paths give the same tokens; the run checks it.

Prints, per concurrency: output tokens/s and p50/p99 time to first token for both paths, the
throughput ratio (target ≥ 0.90) and the added median TTFT (target ≤ 15 ms).

    python benchmarks/e2e.py [--quick] [--model DIR] [--concurrency 1 8 32] [--requests 64]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

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

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, range(len(jobs))))
    return Run(time.perf_counter() - started, results)


# ----- main ---------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 16 requests, 8 tokens, concurrency 1 and 4")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--model", type=Path, default=None, help="model folder (default: the built-in tiny model)")
    parser.add_argument("--preset", choices=("tiny", "bench"), default="tiny",
                        help="built-in model when --model is not given: tiny (tests, demo) or bench (~46M parameters)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for the engine on both paths (default 1: on a small shared machine more "
                             "threads than free cores make OpenMP spin, and the comparison would measure that)")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.max_tokens, args.concurrency = 16, 8, [1, 4]
    with tempfile.TemporaryDirectory(prefix="veil-bench-") as workdir:
        model_dir = args.model or _builtin_model(Path(workdir), args.preset)
        jobs = make_jobs(args.requests, args.max_tokens)
        baseline = _baseline(model_dir, jobs, args.concurrency, args.threads)
        encrypted = _encrypted(model_dir, Path(workdir), jobs, args.concurrency, baseline, args.threads)
    _report(args, baseline, encrypted)
    return 0


def _builtin_model(root: Path, preset: str) -> Path:
    from engine.tiny import write_tiny_model

    return write_tiny_model(root / f"{preset}-model", preset=preset)


def _baseline(model_dir: Path, jobs: list[Job], levels: list[int], threads: int) -> dict[int, Run]:
    import torch

    from engine import EngineConfig, LLMEngine, SamplingParams

    torch.set_num_threads(threads)
    engine = LLMEngine(model_dir, EngineConfig(kv_cache_gib=0.25, max_num_seqs=64))
    engine.generate(["warm up"], SamplingParams(max_tokens=4))
    runs = {c: run_in_process(engine, jobs, c) for c in levels}
    del engine
    return runs


def _encrypted(
    model_dir: Path, workdir: Path, jobs: list[Job], levels: list[int], baseline: dict[int, Run], threads: int
) -> dict[int, Run]:
    from attestation.sim_root import ROOT_DIR_ENV
    from client.fleet import Fleet, FleetSettings
    from client.sdk import Client

    settings = FleetSettings(nodes=1, model_dir=model_dir, workdir=workdir / "fleet", capacity=max(levels),
                             kv_cache_gib=0.25, torch_threads=threads)
    with Fleet(settings) as fleet:
        os.environ[ROOT_DIR_ENV] = str(fleet.sim_root_dir)
        with Client(fleet.gateway_url, policy="dev") as client:
            model = client.models.list().data[0].id
            client.completions.create(model=model, prompt="warm up", max_tokens=4)
            runs = {c: run_encrypted(client, model, jobs, c, baseline[c].results) for c in levels}
    for c, run in runs.items():
        mismatched = sum(a.text != b.text for a, b in zip(run.results, baseline[c].results))
        if mismatched:
            print(f"note: {mismatched}/{len(jobs)} answers at concurrency {c} differ from the in-process ones "
                  "(batch composition changes float rounding); token counts are approximate", file=sys.stderr)
    return runs


def _report(args: argparse.Namespace, baseline: dict[int, Run], encrypted: dict[int, Run]) -> None:
    print(f"\nend-to-end: {args.requests} requests x {args.max_tokens} tokens, one node, loopback, "
          f"{args.threads} torch thread(s) per engine, SIMULATED attestation (the cryptography is real)")
    header = f"{'conc':>4} | {'in-process tok/s':>16} {'p50 ttft':>9} {'p99 ttft':>9} | " \
             f"{'encrypted tok/s':>15} {'p50 ttft':>9} {'p99 ttft':>9} | {'tput ratio':>10} {'+p50 ttft':>10}"
    print(header)
    print("-" * len(header))
    for c in sorted(baseline):
        base, enc = baseline[c], encrypted[c]
        ratio = enc.tokens_per_s / base.tokens_per_s
        added = enc.ttft_ms(0.5) - base.ttft_ms(0.5)
        print(f"{c:>4} | {base.tokens_per_s:>16.1f} {base.ttft_ms(0.5):>7.1f}ms {base.ttft_ms(0.99):>7.1f}ms | "
              f"{enc.tokens_per_s:>15.1f} {enc.ttft_ms(0.5):>7.1f}ms {enc.ttft_ms(0.99):>7.1f}ms | "
              f"{ratio:>10.2f} {added:>8.1f}ms")
    print("targets: throughput ratio >= 0.90, added median TTFT <= 15 ms")


if __name__ == "__main__":
    sys.exit(main())
