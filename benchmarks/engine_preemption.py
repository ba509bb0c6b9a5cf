"""Preemption under a full KV cache: how much prefill work is done again, and how many blocks are zeroed.

Preemption is by recompute (`engine.scheduler`): a preempted request's blocks are freed (and zeroed) and
its tokens are computed again once it is readmitted. A scheduler that picks its victims badly, or admits
prompts it cannot finish, thrashes: the same prompts are prefilled again and again. This runs one seeded
workload twice on the built-in random-weight Llama, on CPU: on a pool that holds every request at once
(the baseline: every prompt prefilled once, every block zeroed once) and on a pool that holds a fraction
of them. It prints, for the full pool, the preemptions, the tokens computed again, the prefill work done
as a ratio to the minimum (the prompts' tokens) and the blocks zeroed as a ratio to the baseline's.
Counts, not times: they are the same on any machine.

    python benchmarks/engine_preemption.py [--requests 48] [--pool-blocks 96] [--async-scheduling]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

# Run as a script, this folder would come first on sys.path and its kernels.py would shadow the package.
sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.common import Workload, progress  # noqa: E402

BLOCK_SIZE = 4
STEP_TOKENS = 64


@dataclass(frozen=True, slots=True)
class PreemptionRun:
    tokens_computed: int  # every token run through the model, recomputed ones included
    recomputed_tokens: int
    preemptions: int
    blocks_zeroed: int


def make_workload(requests: int, seed: int = 7) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(5, 250) for _ in range(rng.randint(8, 80))] for _ in range(requests)]
    return Workload(prompts, [rng.randint(4, 40) for _ in range(requests)])


def run(model_dir: Path, workload: Workload, num_blocks: int, async_scheduling: bool) -> PreemptionRun:
    from engine import EngineConfig, LLMEngine, SamplingParams

    config = EngineConfig(num_blocks=num_blocks, block_size=BLOCK_SIZE, max_num_batched_tokens=STEP_TOKENS,
                          device="cpu", async_scheduling=async_scheduling)
    engine = LLMEngine(model_dir, config)
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0) for n in workload.output_lens]
    for _ in engine.generate(workload.prompts, params):
        pass
    return PreemptionRun(engine.num_tokens_computed, engine.scheduler.num_recomputed_tokens,
                         engine.scheduler.num_preemptions, engine.block_manager.blocks_scrubbed)


def roomy_blocks(workload: Workload) -> int:
    """A pool that holds every request whole at once: nothing is ever preempted."""
    return sum(-(-(len(p) + n) // BLOCK_SIZE) for p, n in zip(workload.prompts, workload.output_lens))


def report(workload: Workload, baseline: PreemptionRun, full: PreemptionRun, pool_blocks: int) -> None:
    prompt_tokens = sum(len(p) for p in workload.prompts)
    prefill_done = prompt_tokens + full.recomputed_tokens
    print(f"requests: {len(workload.prompts)}, prompt tokens: {prompt_tokens}, output tokens: {workload.output_tokens}")
    print(f"baseline pool ({roomy_blocks(workload)} blocks): preemptions {baseline.preemptions}, "
          f"blocks zeroed {baseline.blocks_zeroed}")
    print(f"full pool ({pool_blocks} blocks of {BLOCK_SIZE} tokens): preemptions {full.preemptions}, "
          f"tokens computed again {full.recomputed_tokens}")
    print(f"recomputed prefill tokens / minimum: {full.recomputed_tokens / prompt_tokens:.2f}x")
    print(f"prefill work / minimum: {prefill_done / prompt_tokens:.2f}x")
    print(f"blocks zeroed / baseline: {full.blocks_zeroed / baseline.blocks_zeroed:.2f}x")
    # The model ran every token of the baseline, and the recomputed ones on top: the two counts agree.
    print(f"tokens computed, full / baseline: {full.tokens_computed / baseline.tokens_computed:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=48, help="requests in the workload (default: 48)")
    parser.add_argument("--pool-blocks", type=int, default=96,
                        help=f"KV blocks of {BLOCK_SIZE} tokens in the full pool (default: 96)")
    parser.add_argument("--async-scheduling", action="store_true", help="launch each step before reading the last")
    args = parser.parse_args()

    from engine.tiny import write_tiny_model

    workload = make_workload(args.requests)
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = write_tiny_model(Path(scratch) / "tiny")
        progress("baseline: a pool that holds every request")
        baseline = run(model_dir, workload, roomy_blocks(workload), args.async_scheduling)
        progress(f"full: a pool of {args.pool_blocks} blocks")
        full = run(model_dir, workload, args.pool_blocks, args.async_scheduling)
    report(workload, baseline, full, args.pool_blocks)


if __name__ == "__main__":
    main()
