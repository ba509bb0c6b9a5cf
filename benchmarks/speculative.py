"""Speculative decoding: acceptance rate, mean accepted length and output tokens/s against the same engine
without speculation, on the same requests, in one process (runs alternate; best of --repeats each).

Random weights agree with no other draft model, so the mechanism is measured where its outcome is known:
  (a) the target as its own draft (--speculative draft:DIR with the target's own folder): acceptance
      is 100%, so this is the machinery's overhead and gain with a draft as costly as the target; and
      oracle drafts (each request's own greedy continuation, from the plain run): the same drafts at no
      drafting cost, the most verification (k+1 query positions per sequence in one forward, drafted
      rows beside plain ones) can gain;
  (b) n-gram drafting (prompt lookup over the request's own tokens) on random prompts whose greedy
      continuation repeats: random-weight models fall into loops, and how many of --candidates prompts
      do is reported; the runs use those prompts.
  (c) what a real draft/target pair would need: from the step costs measured with oracle drafts, the
      per-token acceptance a draft costing a given fraction of the target per token must reach to break
      even, to gain 1.5x and to double.
Greedy throughout; every speculative run's tokens are checked against the plain run's.

    python benchmarks/speculative.py [--batches 1 8] [--k 4] [--max-tokens 64] [--candidates 48] [--repeats 2]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# Run as a script, this folder would come first on sys.path and its kernels.py would shadow the package.
sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402

from benchmarks.common import progress  # noqa: E402


@dataclass(frozen=True, slots=True)
class Run:
    seconds: float
    steps: int
    outputs: list[list[int]]
    drafted: int = 0
    accepted: int = 0
    rows: int = 0  # drafted samples verified, summed over steps

    @property
    def output_tokens(self) -> int:
        return sum(map(len, self.outputs))

    @property
    def rate(self) -> float:
        return self.output_tokens / self.seconds


class OracleDrafts:
    """Proposes each request's known greedy continuation: what the target as its own draft would propose."""

    def __init__(self, prompts: list[list[int]], outputs: list[list[int]], k: int) -> None:
        self.k = k
        self.continuations = {tuple(p): o for p, o in zip(prompts, outputs)}
        self.lengths = sorted({len(p) for p in prompts})

    def propose(self, tokens: list[int], limit: int | None = None) -> list[int]:
        for length in self.lengths:
            known = self.continuations.get(tuple(tokens[:length]))
            if known is not None and known[: len(tokens) - length] == tokens[length:]:
                done = len(tokens) - length
                return known[done : done + min(self.k, limit or 0)]
        return []


def run(model_dir: str, prompts: list[list[int]], max_tokens: int, batch: int, k: int | None,
        oracle: OracleDrafts | None = None, draft: str | None = None) -> Run:
    from engine import EngineConfig, LLMEngine, SamplingParams

    speculative = "ngram" if draft is None else f"draft:{draft}"
    speculation = {} if k is None else {"speculative": speculative, "num_speculative_tokens": k}
    engine = LLMEngine(model_dir, EngineConfig(max_num_seqs=batch, num_blocks=4096, block_size=16, **speculation))
    if oracle is not None:
        engine.scheduler.drafter.drafter = oracle
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    results = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    stats = engine.speculation
    return Run(seconds, engine.runner.bridge.steps, [r.outputs[0].token_ids for r in results],
               stats.drafted, stats.accepted, stats.rows)


def loops(output: list[int], longest_period: int = 16) -> bool:
    """Whether the second half of a greedy output repeats with a period of at most `longest_period` tokens."""
    tail = output[len(output) // 2 :]
    return any(all(tail[i] == tail[i + p] for i in range(len(tail) - p)) for p in range(1, longest_period + 1))


def best(runs: list[Run]) -> Run:
    return min(runs, key=lambda r: r.seconds)


def compare(label: str, model_dir: str, prompts: list[list[int]], args: argparse.Namespace, batch: int,
            oracle: OracleDrafts | None = None, draft: str | None = None) -> tuple[Run, Run]:
    plain_runs, speculative_runs = [], []
    for _ in range(args.repeats):
        plain_runs.append(run(model_dir, prompts, args.max_tokens, batch, None))
        speculative_runs.append(run(model_dir, prompts, args.max_tokens, batch, args.k, oracle, draft))
    plain, speculative = best(plain_runs), best(speculative_runs)
    identical = all(r.outputs == plain.outputs for r in plain_runs + speculative_runs)
    accepted_rate = speculative.accepted / speculative.drafted if speculative.drafted else 0.0
    mean_accepted = speculative.accepted / speculative.rows if speculative.rows else 0.0
    print(f"  {label}, batch {batch}: {len(prompts)} requests x {args.max_tokens} tokens, k = {args.k}")
    batch = min(batch, len(prompts))  # sequences that share a step
    print(f"    acceptance rate {accepted_rate:.1%}  mean accepted length {mean_accepted:.2f} of {args.k} "
          f"({speculative.output_tokens / speculative.steps:.2f} output tokens a step vs "
          f"{plain.output_tokens / plain.steps:.2f})")
    print(f"    plain:       {plain.rate:8.1f} output tokens/s  {1000 * plain.seconds / plain.output_tokens * batch:7.3f} "
          f"ms per output token per sequence  ({plain.steps} steps)")
    print(f"    speculative: {speculative.rate:8.1f} output tokens/s  "
          f"{1000 * speculative.seconds / speculative.output_tokens * batch:7.3f} ms per output token per sequence  "
          f"({speculative.steps} steps)")
    print(f"    ratio speculative / plain: {speculative.rate / plain.rate:.2f}x   tokens identical to plain: "
          f"{'yes' if identical else 'NO'}")
    return plain, speculative


def what_a_pair_needs(plain: Run, oracle: Run, k: int) -> None:
    """Speedup of a draft whose cost per token is c of the target's: E(alpha) t1 / (t_verify + k c t1)."""
    step_plain = plain.seconds / plain.steps
    step_verify = oracle.seconds / oracle.steps
    print(f"  (c) what a real draft/target pair needs (k = {k}; a plain step {1000 * step_plain:.2f} ms, a verify "
          f"step of k+1 positions {1000 * step_verify:.2f} ms, measured with oracle drafts at batch 1):")
    for cost in (0.02, 0.05, 0.1, 0.2):
        needed = [_acceptance_for(target, cost, k, step_plain, step_verify) for target in (1.0, 1.5, 2.0)]
        shown = ["unreachable" if a is None else f"{a:.0%}" for a in needed]
        print(f"    draft at {cost:.0%} of the target per token: break-even {shown[0]}, 1.5x {shown[1]}, 2x {shown[2]} "
              "per-token acceptance")


def _acceptance_for(speedup: float, cost: float, k: int, step_plain: float, step_verify: float) -> float | None:
    """The per-token acceptance at which a step emits enough to reach `speedup` (bisection; None if none can)."""
    def gain(alpha: float) -> float:
        emitted = k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
        return emitted * step_plain / (step_verify + k * cost * step_plain)

    if gain(1.0) < speedup:
        return None
    low, high = 0.0, 1.0
    for _ in range(40):
        middle = (low + high) / 2
        low, high = (middle, high) if gain(middle) < speedup else (low, middle)
    return high


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--k", type=int, default=4, help="drafts per sample per step")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--candidates", type=int, default=48, help="random prompts tried for (b)")
    parser.add_argument("--requests", type=int, default=8, help="requests per run (at most, of those that loop)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--preset", default="tiny")
    args = parser.parse_args()
    torch.manual_seed(0)
    from engine.tiny import write_tiny_model

    with tempfile.TemporaryDirectory() as folder:
        model_dir = str(write_tiny_model(Path(folder) / "model", preset=args.preset))
        print(f"device: {'CUDA' if torch.cuda.is_available() else 'CPU'}; model preset {args.preset!r} "
              "(random weights)")
        generator = torch.Generator().manual_seed(1234)
        candidates = [torch.randint(3, 500, (int(n),), generator=generator).tolist()
                      for n in torch.randint(8, 48, (args.candidates,), generator=generator)]
        progress(f"greedy outputs of {len(candidates)} candidate prompts")
        outputs = run(model_dir, candidates, args.max_tokens, 16, None).outputs
        looping = [p for p, o in zip(candidates, outputs) if loops(o)]
        print(f"  {len(looping)} of {len(candidates)} random prompts ({len(looping) / len(candidates):.0%}) have a "
              f"greedy continuation that repeats (period <= 16 over its second half of {args.max_tokens} tokens)")
        chosen = candidates[: args.requests]
        oracle = OracleDrafts(chosen, outputs[: args.requests], args.k)
        results = {}
        for batch in args.batches:
            progress(f"(a) the target as its own draft at batch {batch}")
            compare("(a) the target as its own draft (draft:DIR, 100% acceptance)", model_dir, chosen, args, batch,
                    draft=model_dir)
            progress(f"(a) oracle drafts at batch {batch}")
            results[batch] = compare("(a) oracle drafts (the same drafts at no drafting cost)", model_dir, chosen,
                                     args, batch, oracle)
            if looping:
                progress(f"(b) n-gram drafts at batch {batch}")
                compare("(b) n-gram drafts on prompts that loop", model_dir, looping[: args.requests], args, batch, None)
        first = min(args.batches)
        what_a_pair_needs(*results[first], args.k)


if __name__ == "__main__":
    main()
