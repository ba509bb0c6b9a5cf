"""Embeddings throughput: Veil's pooled prefill (`LLMEngine.embed`) vs `transformers` on the same model and inputs.

Workload: --inputs inputs (default 64) of 16-256 random token ids (seeded), on the built-in ~46M-parameter
random-weight Llama, fp32 on the CPU, pooled the same way on both sides (--pooling last|mean of the final
hidden states, after the final norm, L2-normalized). Two batch sizes:
  - batch 1: the inputs one at a time (an `embed` call each; a `transformers` forward each);
  - batch 64 (--batch): the inputs in calls of that many (Veil batches them itself in its scheduler;
    `transformers` runs right-padded batches with an attention mask and pools the unpadded rows).
Each configuration runs once a round, best of --repeats each, so that a busy moment on a shared machine
lands on no side alone. Every Veil vector is checked against `transformers`' (cosine >= 0.999) before
anything is timed. Prints inputs/s and input tokens/s for each and Veil / transformers at each batch size.

    python benchmarks/embeddings.py [--inputs 64] [--batch 64] [--pooling last] [--threads 1] [--quick]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# Run as a script, this folder would come first on sys.path and its kernels.py would shadow the package.
sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402

from benchmarks.common import progress  # noqa: E402

Vectors = list[list[float]]


@dataclass(frozen=True, slots=True)
class Rate:
    """One side's best run at one batch size."""

    seconds: float
    inputs: int
    tokens: int

    @property
    def inputs_per_s(self) -> float:
        return self.inputs / self.seconds

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def make_inputs(count: int, length_range: tuple[int, int], vocab: int) -> list[list[int]]:
    rng = random.Random(1234)
    return [[rng.randrange(vocab) for _ in range(rng.randint(*length_range))] for _ in range(count)]


def batches(inputs: list[list[int]], size: int) -> list[list[list[int]]]:
    return [inputs[begin : begin + size] for begin in range(0, len(inputs), size)]


class VeilSide:
    """Veil's offline engine: every call's inputs are prefill-only requests batched by its scheduler."""

    def __init__(self, model_dir: str, pooling: str, max_batch: int) -> None:
        from engine import EngineConfig, LLMEngine, PoolingKind, PoolingParams

        self.engine = LLMEngine(model_dir, EngineConfig(device="cpu", dtype="float32", kv_cache_gib=2.0,
                                                        max_num_seqs=max(max_batch, 1), max_num_batched_tokens=4096))
        self.params = PoolingParams(PoolingKind(pooling))

    def embed(self, inputs: list[list[int]], batch: int) -> Vectors:
        return [vector for group in batches(inputs, batch) for vector in self.engine.embed(group, self.params)]


class TransformersSide:
    """`transformers`' base model (no LM head): right-padded batches, pooled over each row's own tokens."""

    def __init__(self, model_dir: str, pooling: str) -> None:
        from transformers import AutoModel, logging

        logging.set_verbosity_error()  # the base model leaves the folder's LM head unused, as pooling does
        self.model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.pooling = pooling

    @torch.inference_mode()
    def embed(self, inputs: list[list[int]], batch: int) -> Vectors:
        return [vector for group in batches(inputs, batch) for vector in self._embed_batch(group).tolist()]

    def _embed_batch(self, group: list[list[int]]) -> torch.Tensor:
        lengths = torch.tensor([len(ids) for ids in group])
        ids = torch.zeros(len(group), int(lengths.max()), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(group):
            ids[row, : len(prompt)] = torch.tensor(prompt)
            mask[row, : len(prompt)] = 1
        states = self.model(input_ids=ids, attention_mask=mask).last_hidden_state
        if self.pooling == "mean":
            pooled = (states * mask.unsqueeze(-1)).sum(1) / lengths.unsqueeze(-1)
        else:
            pooled = states[torch.arange(len(group)), lengths - 1]
        return torch.nn.functional.normalize(pooled, dim=-1)


def check_same_vectors(veil: Vectors, reference: Vectors) -> float:
    """The lowest cosine between the two sides' vectors; the run stops if they do not agree."""
    cosines = torch.nn.functional.cosine_similarity(torch.tensor(veil), torch.tensor(reference), dim=-1)
    lowest = float(cosines.min())
    assert lowest >= 0.999, f"Veil's vectors differ from transformers' (lowest cosine {lowest:.6f})"
    return lowest


def timed(side: VeilSide | TransformersSide, inputs: list[list[int]], batch: int) -> float:
    started = time.perf_counter()
    side.embed(inputs, batch)
    return time.perf_counter() - started


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--inputs", type=int, default=64, help="inputs in the workload (default: 64)")
    parser.add_argument("--batch", type=int, default=64, help="the large batch size, inputs per call (default: 64)")
    parser.add_argument("--pooling", choices=("last", "mean"), default="last", help="pooling on both sides (default: last)")
    parser.add_argument("--quick", action="store_true", help="tiny model and short inputs (a smoke run)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="rounds of runs, each configuration once a round (best is kept; default: 2)")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from engine.tiny import write_tiny_model

    preset = "tiny" if args.quick else "bench"
    length_range = (4, 32) if args.quick else (16, 256)
    with tempfile.TemporaryDirectory(prefix="veil-bench-") as model_dir:
        write_tiny_model(model_dir, preset=preset)
        veil, hf = VeilSide(model_dir, args.pooling, args.batch), TransformersSide(model_dir, args.pooling)
        inputs = make_inputs(args.inputs, length_range, veil.engine.model_config.vocab_size)
        tokens = sum(map(len, inputs))
        print(f"model: built-in '{preset}' Llama, fp32, {torch.get_num_threads()} CPU threads, {args.pooling} pooling")
        print(f"workload: {args.inputs} inputs of {length_range[0]}-{length_range[1]} tokens, {tokens} tokens in all")
        lowest = check_same_vectors(veil.embed(inputs, args.batch), hf.embed(inputs, args.batch))  # also a warm-up
        print(f"vectors: Veil's equal transformers' (lowest cosine {lowest:.6f})")
        runs = measure({"transformers": hf, "veil": veil}, inputs, (1, args.batch), args.repeats)
    for size in (1, args.batch):
        report(size, {name: Rate(min(runs[name, size]), len(inputs), tokens) for name in ("transformers", "veil")},
               runs["veil", size])


def measure(sides: dict[str, VeilSide | TransformersSide], inputs: list[list[int]], sizes: tuple[int, ...],
            repeats: int) -> dict[tuple[str, int], list[float]]:
    """Seconds of every run, by side and batch size: each configuration once a round, --repeats rounds."""
    runs: dict[tuple[str, int], list[float]] = {(name, size): [] for name in sides for size in sizes}
    for repeat in range(1, repeats + 1):
        for size in sizes:
            for name, side in sides.items():
                progress(f"{name}, batch {size}, run {repeat} of {repeats} ...")
                runs[name, size].append(timed(side, inputs, size))
    return runs


def report(size: int, rates: dict[str, Rate], veil_runs: list[float]) -> None:
    for name, rate in rates.items():
        print(f"batch {size:3d} {name + ':':14s} {rate.inputs_per_s:9.1f} inputs/s {rate.tokens_per_s:10.1f} "
              f"tokens/s ({rate.seconds:.2f} s)")
    ratio = rates["veil"].tokens_per_s / rates["transformers"].tokens_per_s
    all_runs = "/".join(f"{rates['veil'].inputs / seconds:.1f}" for seconds in veil_runs)
    print(f"batch {size:3d} ratio veil / transformers: {ratio:.2f}x  (best of each; veil's runs {all_runs} inputs/s)")


if __name__ == "__main__":
    main()
