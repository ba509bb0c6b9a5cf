"""Engine throughput: Veil's continuous batching vs `transformers.generate` on the same model and requests.

Workload: 64 requests, prompt lengths 32-512 and output lengths 16-256 (seeded), greedy, on the
built-in ~46M-parameter random-weight Llama. Runs in one process, same requests, in turn, best of
--repeats each (so a busy moment on a shared machine lands on no side alone):
  1. transformers.generate in static, left-padded batches (each batch runs to its longest output);
  2. Veil with zero-on-free (the only way a node runs);
  3. Veil with zeroing skipped, to price it;
  4. with --bridge-toll-us T: Veil with zero-on-free where every host<->device crossing waits T us, one
     at a time (`engine.bridge`: a confidential-computing bounce buffer simulated on any device),
     alternating with 2 so that its ratio to the toll-free run is taken in the same conditions.
Prints output tokens/s for each and the ratios, the bridge crossings per step, and the time spent inside
the zeroing calls of run 2 (on a CPU every call completes before it returns, so that share is free of
the noise between runs), and with a toll the time the step loop waited at it: the toll's cost within one
run, which a ratio of two runs on a shared machine can hide or inflate.

With --dtype bfloat16 both sides run in bf16 (the engine's projections over prepacked weights on a CPU
with native bf16: `kernels.cpu_linear`).

    python benchmarks/engine_throughput.py [--requests 64] [--hf-batch-size 16] [--quick] [--bridge-toll-us 300]
                                           [--dtype float32|bfloat16] [--threads N]
"""

from __future__ import annotations

import argparse
import random
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

from benchmarks.common import Workload, kernels_line, progress  # noqa: E402


def make_workload(requests: int, prompt_range: tuple[int, int], output_range: tuple[int, int], vocab: int) -> Workload:
    rng = random.Random(1234)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(*prompt_range))] for _ in range(requests)]
    output_lens = [rng.randint(*output_range) for _ in range(requests)]
    return Workload(prompts, output_lens)


@dataclass(frozen=True, slots=True)
class VeilRun:
    seconds: float
    blocks_zeroed: int
    zeroing_seconds: float  # wall time inside the zeroing calls
    steps: int
    h2d: int  # bridge crossings in the run, each way
    d2h: int
    toll_seconds: float  # wall time the scheduling thread waited at the simulated bridge's toll


@contextmanager
def timed_toll() -> Iterator[list[float]]:
    """Adds up the wall time the calling thread waits at the simulated bridge (`engine.bridge.Toll.pay`):
    with nothing to overlap it, a tolled run takes its toll-free time plus this, so this share of the run
    is the toll's cost measured within one run, free of the noise between two."""
    import threading

    from engine.bridge import Toll

    real_pay, thread = Toll.pay, threading.get_ident()
    spent = [0.0]

    def pay(toll: Toll) -> None:
        started = time.perf_counter()
        try:
            real_pay(toll)
        finally:
            if threading.get_ident() == thread:  # a drain on a worker thread does not hold the step loop
                spent[0] += time.perf_counter() - started

    Toll.pay = pay  # type: ignore[method-assign]
    try:
        yield spent
    finally:
        Toll.pay = real_pay  # type: ignore[method-assign]


@contextmanager
def timed_zeroing() -> Iterator[list[float]]:
    """Adds up the wall time spent in `kernels.zero_blocks`. On a CPU each call runs to completion before
    it returns, so this is zeroing's own share of a run, free of the noise between two runs."""
    import kernels

    real_zero_blocks = kernels.zero_blocks
    spent = [0.0]

    def zero_blocks(kv_cache, block_ids, **options) -> None:
        started = time.perf_counter()
        try:
            real_zero_blocks(kv_cache, block_ids, **options)
        finally:
            spent[0] += time.perf_counter() - started

    kernels.zero_blocks = zero_blocks
    try:
        yield spent
    finally:
        kernels.zero_blocks = real_zero_blocks


def run_veil(model_dir: str, workload: Workload, skip_zeroing: bool, toll_us: float = 0.0,
             dtype: str | None = None) -> VeilRun:
    from engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(
        model_dir,
        EngineConfig(kv_cache_gib=2.0, max_num_seqs=64, max_num_batched_tokens=2048, unsafe_skip_zeroing=skip_zeroing,
                     bridge_toll_us=toll_us, dtype=dtype),
    )
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in workload.output_lens]
    engine.generate([workload.prompts[0]], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    bridge = engine.runner.bridge
    steps_before = bridge.steps
    with timed_zeroing() as zeroing, timed_toll() as tolled, bridge.counting() as crossed:
        started = time.perf_counter()
        outputs = engine.generate(workload.prompts, params)
        elapsed = time.perf_counter() - started
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert produced == workload.output_tokens, "every request must produce exactly its max_tokens"
    return VeilRun(elapsed, engine.block_manager.blocks_scrubbed, zeroing[0], bridge.steps - steps_before,
                   crossed.h2d, crossed.d2h, tolled[0])


def run_transformers(model_dir: str, workload: Workload, batch_size: int, dtype: torch.dtype = torch.float32) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    model.generation_config.pad_token_id = 0
    started = time.perf_counter()
    for begin in range(0, len(workload.prompts), batch_size):
        prompts = workload.prompts[begin : begin + batch_size]
        longest_output = max(workload.output_lens[begin : begin + batch_size])
        input_ids, attention_mask = _left_pad(prompts)
        with torch.inference_mode():
            model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                max_new_tokens=longest_output,
                min_new_tokens=longest_output,
                do_sample=False,
            )
    return time.perf_counter() - started


def _left_pad(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    return ids, mask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64, help="requests in the workload (default: 64)")
    parser.add_argument("--hf-batch-size", type=int, default=16, help="static batch size for transformers.generate")
    parser.add_argument("--quick", action="store_true", help="tiny model and short requests (a smoke run)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--repeats", type=int, default=2, help="rounds of runs, each configuration once a round (best is kept; default: 2)")
    parser.add_argument("--bridge-toll-us", type=float, default=0.0,
                        help="also run Veil with every host<->device crossing waiting this long (a simulated "
                             "confidential-computing bridge) and compare it with the toll-free run")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="dtype of both sides, Veil and transformers (default: float32, the model's own)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from engine.tiny import PRESETS, write_tiny_model

    preset = "tiny" if args.quick else "bench"
    prompt_range, output_range = ((4, 32), (2, 16)) if args.quick else ((32, 512), (16, 256))
    with tempfile.TemporaryDirectory(prefix="veil-bench-") as model_dir:
        write_tiny_model(model_dir, preset=preset)
        params_m = sum(p.numel() for p in _param_shapes(model_dir)) / 1e6
        vocab_size = PRESETS[preset].vocab_size or _config_vocab(model_dir)
        workload = make_workload(args.requests, prompt_range, output_range, vocab_size)
        print(f"model: built-in '{preset}' Llama, {params_m:.1f}M parameters, {args.dtype} on both sides, "
              f"{torch.get_num_threads()} CPU threads")
        print(kernels_line("cpu"))
        print(f"workload: {args.requests} requests, prompts {prompt_range}, outputs {output_range}, "
              f"{workload.output_tokens} output tokens, greedy")
        # Every configuration runs once per round, best of --repeats each, so that a busy moment on a
        # shared machine does not land on one side only.
        hf_runs: list[float] = []
        veil_runs, unsafe_runs, tolled_runs = [], [], []
        for repeat in range(1, args.repeats + 1):
            progress(f"transformers.generate, run {repeat} of {args.repeats} ...")
            hf_runs.append(run_transformers(model_dir, workload, args.hf_batch_size, getattr(torch, args.dtype)))
            progress(f"veil with zero-on-free, run {repeat} of {args.repeats} ...")
            veil_runs.append(run_veil(model_dir, workload, skip_zeroing=False, dtype=args.dtype))
            progress(f"veil with zeroing skipped, run {repeat} of {args.repeats} ...")
            unsafe_runs.append(run_veil(model_dir, workload, skip_zeroing=True, dtype=args.dtype))
            if args.bridge_toll_us:
                progress(f"veil with a bridge toll of {args.bridge_toll_us:g} us, run {repeat} of {args.repeats} ...")
                tolled_runs.append(run_veil(model_dir, workload, skip_zeroing=False, toll_us=args.bridge_toll_us,
                                            dtype=args.dtype))
        veil = min(veil_runs, key=lambda run: run.seconds)
        unsafe_seconds = min(run.seconds for run in unsafe_runs)
        hf_seconds = min(hf_runs)

    tokens = workload.output_tokens
    hf_rate, veil_rate, unsafe_rate = tokens / hf_seconds, tokens / veil.seconds, tokens / unsafe_seconds
    print(f"transformers.generate (static batches of {args.hf_batch_size}): {hf_rate:9.1f} output tokens/s ({hf_seconds:.1f} s)")
    print(f"veil, zero-on-free:                          {veil_rate:9.1f} output tokens/s ({veil.seconds:.1f} s, {veil.blocks_zeroed} blocks zeroed)")
    print(f"veil, zeroing skipped:                       {unsafe_rate:9.1f} output tokens/s ({unsafe_seconds:.1f} s)")
    print(f"ratio veil / transformers: {veil_rate / hf_rate:.2f}x  (target >= 3x; best of each; all runs: transformers "
          f"{'/'.join(f'{tokens / seconds:.0f}' for seconds in hf_runs)}, veil {_rates(veil_runs, tokens)})")
    print(f"cost of zero-on-free: {100 * (1 - veil_rate / unsafe_rate):+.2f}% of throughput  (target < 2%; "
          "two runs compared, so machine noise included)")
    print(f"time inside zeroing: {1000 * veil.zeroing_seconds:.1f} ms of the zero-on-free run, "
          f"{100 * veil.zeroing_seconds / veil.seconds:.2f}% of it  (target < 2%; measured within one run)")
    print(f"bridge crossings: {veil.h2d} host-to-device and {veil.d2h} device-to-host in {veil.steps} steps "
          f"({veil.h2d / veil.steps:.2f} and {veil.d2h / veil.steps:.2f} per step)")
    if tolled_runs:
        tolled = min(tolled_runs, key=lambda run: run.seconds)
        tolled_rate = tokens / tolled.seconds
        print(f"veil, bridge toll {args.bridge_toll_us:g} us per crossing:    {tolled_rate:9.1f} output tokens/s "
              f"({tolled.seconds:.1f} s)")
        print(f"ratio tolled / toll-free: {tolled_rate / veil_rate:.3f}  (target >= 0.90; runs alternate, so machine "
              f"noise included; all runs: toll-free {_rates(veil_runs, tokens)}, tolled {_rates(tolled_runs, tokens)})")
        waited = tolled.toll_seconds / tolled.seconds
        print(f"time waiting at the toll: {1000 * tolled.toll_seconds:.0f} ms of the tolled run, {100 * waited:.2f}% "
              f"of it: tolled / toll-free {1 - waited:.3f} within one run, free of the noise between runs")


def _rates(runs: list[VeilRun], tokens: int) -> str:
    return "/".join(f"{tokens / run.seconds:.0f}" for run in runs)


def _config_vocab(model_dir: str) -> int:
    import json

    with open(f"{model_dir}/config.json") as config:
        return int(json.load(config)["vocab_size"])


def _param_shapes(model_dir: str):
    from safetensors import safe_open

    with safe_open(f"{model_dir}/model.safetensors", "pt") as f:
        return [f.get_tensor(name) for name in f.keys()]


if __name__ == "__main__":
    main()
