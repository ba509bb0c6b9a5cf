"""Structured outputs: what a per-request grammar costs, with nothing cached across requests.

Four figures, one process:
  1. compile time per schema: every schema of benchmarks/data/structured_schemas.json (real-world
     shapes: profiles, orders, invoices with $defs, a recursive org chart, anyOf replies, ...) compiled
     --compiles times through the engine's own path (`GrammarCompiler.compile`, a fresh matcher each
     time, as every request gets); p50 and p99 over all compiles;
  2. per-step mask cost: the wall time inside `GrammarCompiler.masks` (the host computes every
     constrained row's token mask for a step), per step and per row, measured within the constrained run;
  3. output tokens/s of the same requests (--batch of them at once, seeded draws) with a json_schema
     each (the schemas in turn) and unconstrained, runs alternating, best of --repeats each. A
     constrained answer ends where its grammar does, so each unconstrained request is given as many
     tokens as its constrained twin produced: both runs do the same work, step for step;
  4. the step loop's time to take in a constrained request: an engine core (`engine.core.EngineCore`,
     the loop a node runs) handed each schema's request --compiles times; the compile runs on a worker
     thread, so this, not the compile time of figure 1, is what a step of every running request waits
     for an arrival (p50 and p99 over all arrivals).

    python benchmarks/structured.py [--batch 16] [--max-tokens 96] [--compiles 20] [--repeats 2] [--quick]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

# Run as a script, this folder would come first on sys.path and its kernels.py would shadow the package.
sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402

from benchmarks.common import progress  # noqa: E402

SCHEMAS = Path(__file__).resolve().parent / "data" / "structured_schemas.json"


@dataclass(frozen=True, slots=True)
class Run:
    seconds: float
    cpu_seconds: float  # this process's CPU time (every thread): what other load on the machine changes least
    output_lens: list[int]
    steps: int
    mask_seconds: float  # wall time inside GrammarCompiler.masks
    masked_rows: int

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


@contextmanager
def timed_masks() -> Iterator[list[float]]:
    """Adds up the wall time spent computing masks and counts the rows they covered."""
    from engine.structured import GrammarCompiler

    real_masks = GrammarCompiler.masks
    spent = [0.0, 0]

    def masks(self, requests):
        started = time.perf_counter()
        try:
            return real_masks(self, requests)
        finally:
            spent[0] += time.perf_counter() - started
            spent[1] += len(requests)

    GrammarCompiler.masks = masks
    try:
        yield spent
    finally:
        GrammarCompiler.masks = real_masks


def compile_times(model_dir: str, schemas: dict[str, dict], repeats: int
                  ) -> tuple[dict[str, list[float]], list[float]]:
    """Wall seconds of each compile by schema, and the compiling thread's CPU seconds of every compile."""
    from engine import Tokenizer
    from engine.sampling_params import StructuredOutput
    from engine.structured import GrammarCompiler

    config = json.loads((Path(model_dir) / "config.json").read_text())
    eos = config.get("eos_token_id", 0)
    compiler = GrammarCompiler(Tokenizer(model_dir).to_json(), config["vocab_size"], eos if isinstance(eos, list) else [eos])
    times: dict[str, list[float]] = {name: [] for name in schemas}
    cpu: list[float] = []
    for _ in range(repeats):
        for name, schema in schemas.items():
            constraint = StructuredOutput("json_schema", json.dumps(schema), "response_format.json_schema.schema")
            started, cpu_started = time.perf_counter(), time.thread_time()
            compiler.compile(constraint)  # llguidance compiles on the calling thread
            times[name].append(time.perf_counter() - started)
            cpu.append(time.thread_time() - cpu_started)
    return times, cpu


def loop_take_in_times(model_dir: str, schemas: dict[str, dict], repeats: int) -> list[float]:
    """Wall seconds the engine core's loop spends on each constrained request's arrival."""
    from multiprocessing import Pipe

    from engine import EngineConfig, LLMEngine, SamplingParams
    from engine.core import AbortRequest, AddRequest, EngineCore
    from engine.sampling_params import StructuredOutput

    core = EngineCore(LLMEngine(model_dir, EngineConfig(kv_cache_gib=0.1)), Pipe()[1])
    spent: list[float] = []
    for repeat in range(repeats):
        for name, schema in schemas.items():
            constraint = StructuredOutput("json_schema", json.dumps(schema), "response_format.json_schema.schema")
            arrival = AddRequest(f"{name}-{repeat}", "Hello", SamplingParams(max_tokens=8, structured=constraint))
            started = time.perf_counter()
            core._handle(arrival)  # what the loop does with a message between two steps
            spent.append(time.perf_counter() - started)
            core._handle(AbortRequest(arrival.request_id))  # never stepped: only its arrival is measured
    core._compiler.shutdown(wait=True)
    return spent


def run_engine(model_dir: str, prompts: list[str], schemas: list[dict], max_tokens: list[int], constrained: bool
               ) -> Run:
    """The requests, each with a json_schema (the schemas in turn) or none, and at most its max_tokens."""
    from engine import EngineConfig, LLMEngine, SamplingParams
    from engine.sampling_params import StructuredOutput

    engine = LLMEngine(model_dir, EngineConfig(kv_cache_gib=0.5, max_num_seqs=len(prompts)))
    params = []
    for index, _ in enumerate(prompts):
        structured = None
        if constrained:
            schema = json.dumps(schemas[index % len(schemas)])
            structured = StructuredOutput("json_schema", schema, "response_format.json_schema.schema")
        params.append(SamplingParams(max_tokens=max_tokens[index], temperature=1.0, seed=index, ignore_eos=True,
                                     structured=structured))
    # Warm-up with the run's own kind of request: the grammar compiler and its thread pool start here.
    engine.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0, structured=params[0].structured))
    steps_before = engine.runner.bridge.steps
    with timed_masks() as spent:
        started, cpu_started = time.perf_counter(), _cpu_seconds()
        outputs = engine.generate(prompts, params)
        elapsed, cpu = time.perf_counter() - started, _cpu_seconds() - cpu_started
    produced = [len(o.outputs[0].token_ids) for o in outputs]
    return Run(elapsed, cpu, produced, engine.runner.bridge.steps - steps_before, spent[0], spent[1])


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16, help="requests run at once (default: 16)")
    parser.add_argument("--max-tokens", type=int, default=96, help="output tokens per request at most (default: 96)")
    parser.add_argument("--compiles", type=int, default=20, help="compiles of each schema (default: 20)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each configuration (best is kept)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--quick", action="store_true", help="the tiny model (a smoke run)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from engine.tiny import write_tiny_model

    schemas = json.loads(SCHEMAS.read_text())
    preset = "tiny" if args.quick else "bench"
    prompts = [f"Request {i}: answer in JSON about item {i * 7 % 13}." for i in range(args.batch)]
    with tempfile.TemporaryDirectory(prefix="veil-bench-") as model_dir:
        write_tiny_model(model_dir, preset=preset)
        print(f"model: built-in '{preset}' Llama, fp32, {torch.get_num_threads()} CPU threads; "
              f"{len(schemas)} schemas from {SCHEMAS.name}")
        progress(f"compiling each schema {args.compiles} times ...")
        times, compile_cpu = compile_times(model_dir, schemas, args.compiles)
        progress(f"handing each schema's request to an engine core's loop {args.compiles} times ...")
        take_in = loop_take_in_times(model_dir, schemas, args.compiles)
        plain_runs, constrained_runs = [], []
        limits = [args.max_tokens] * len(prompts)
        for repeat in range(1, args.repeats + 1):
            progress(f"json_schema, run {repeat} of {args.repeats} ...")
            constrained_runs.append(run_engine(model_dir, prompts, list(schemas.values()), limits, True))
            progress(f"unconstrained, run {repeat} of {args.repeats} ...")
            # Seeded draws: every constrained run gives the same lengths, which the plain twins match.
            twins = constrained_runs[0].output_lens
            plain_runs.append(run_engine(model_dir, prompts, list(schemas.values()), twins, False))

    every = [t for per_schema in times.values() for t in per_schema]
    print(f"compile time per schema ({len(every)} compiles, a fresh matcher each, no cache):")
    for name, per_schema in times.items():
        print(f"  {name:28s} median {1000 * statistics.median(per_schema):7.2f} ms")
    p99 = 1000 * percentile(every, 0.99)
    print(f"compile p50: {1000 * percentile(every, 0.5):.2f} ms  p99: {p99:.2f} ms  "
          f"[target p99 <= 20 ms: {'met' if p99 <= 20 else 'NOT met'}]")
    print(f"compile CPU time (the compiling thread's): p50 {1000 * percentile(compile_cpu, 0.5):.2f} ms  "
          f"p99 {1000 * percentile(compile_cpu, 0.99):.2f} ms")
    print(f"the step loop's time per constrained arrival (its compile on a worker thread): "
          f"p50 {1e6 * percentile(take_in, 0.5):.0f} us  p99 {1e6 * percentile(take_in, 0.99):.0f} us, "
          f"against the compile's own p99 {p99:.2f} ms that a loop compiling itself would hold every running request")
    plain = max(plain_runs, key=lambda run: run.output_tokens / run.seconds)
    constrained = max(constrained_runs, key=lambda run: run.output_tokens / run.seconds)
    plain_rate, constrained_rate = plain.output_tokens / plain.seconds, constrained.output_tokens / constrained.seconds
    print(f"per-step mask cost: {1e6 * constrained.mask_seconds / constrained.steps:.0f} us a step, "
          f"{1e6 * constrained.mask_seconds / max(constrained.masked_rows, 1):.1f} us a row "
          f"({constrained.masked_rows} rows in {constrained.steps} steps), "
          f"{100 * constrained.mask_seconds / constrained.seconds:.1f}% of the constrained run")
    print(f"unconstrained:  {plain_rate:9.1f} output tokens/s ({plain.output_tokens} tokens, {plain.seconds:.2f} s)")
    print(f"json_schema:    {constrained_rate:9.1f} output tokens/s ({constrained.output_tokens} tokens, "
          f"{constrained.seconds:.2f} s)")
    ratio = constrained_rate / plain_rate
    print(f"ratio json_schema / unconstrained at batch {args.batch}: {ratio:.3f}  "
          f"[target >= 0.85: {'met' if ratio >= 0.85 else 'NOT met'}]")
    cpu_ratio = min(r.cpu_seconds for r in plain_runs) / min(r.cpu_seconds for r in constrained_runs)
    print(f"same ratio by this process's CPU time: {cpu_ratio:.3f}  (what a loaded machine's other work changes least; "
          f"all runs' wall ratios: {_rates(constrained_runs, plain_runs)})")


def _rates(constrained: list[Run], plain: list[Run]) -> str:
    return "/".join(f"{p.seconds / c.seconds:.2f}" for c, p in zip(constrained, plain))


if __name__ == "__main__":
    main()
