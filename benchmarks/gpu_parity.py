"""Greedy parity on a CUDA GPU: the engine's tokens against `transformers`' on the same device and weights.

Three checks, each printed as one line per configuration (`parity:`), with the first position where the
two disagree when they do:
  1. the shipped trained model (stories260K, fp32): the engine on CUDA against the engine on the CPU and
     against `transformers` on CUDA, for every opening of `tests/test_engine_trained_model.py`, and the
     story it writes from "Once upon a time" (a published model's output, no user's data);
  2. the random-weight reference families of the CPU parity tests (Llama with grouped-query attention,
     Qwen2 with biases and tied embeddings, Qwen3 with q/k norms), in fp32 and bf16;
  3. with --preset-1b, the random 1B Llama of `engine_gpu.py` in bf16 (random weights at that size leave
     near-ties, so a late divergence there is rounding, reported, not a failure).
fp32 must match exactly; bf16 reports how far the tokens agree (kernels differ from cuBLAS in summation
order, so a bf16 near-tie may break the other way). Exits 1 when an fp32 configuration differs.

    python benchmarks/gpu_parity.py [--tokens 48] [--preset-1b]

Needs CUDA: without a CUDA device it exits with status 2.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

# Run as a script, this folder would come first on sys.path and its kernels.py would shadow the package.
sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402

from benchmarks.common import progress  # noqa: E402


@dataclass(frozen=True, slots=True)
class Agreement:
    """How far two runs' tokens agree over a set of prompts."""

    prompts: int
    identical: int
    first_divergence: int | None  # the earliest position where any prompt's tokens differ

    def line(self, label: str) -> str:
        if self.identical == self.prompts:
            return f"parity: {label}: all {self.prompts} prompts identical"
        return (f"parity: {label}: {self.identical}/{self.prompts} prompts identical, "
                f"first divergence at output token {self.first_divergence}")


def agreement(got: list[list[int]], want: list[list[int]]) -> Agreement:
    divergences = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
                   for g, w in zip(got, want) if g != w]
    return Agreement(len(want), len(want) - len(divergences), min(divergences) if divergences else None)


def engine_tokens(folder: Path, prompts: list[list[int]], tokens: int, device: str, dtype: str) -> list[list[int]]:
    from engine import EngineConfig, LLMEngine
    from tests.engine_models import greedy, output_tokens

    # A fixed pool: a fraction of an 80 GB device would take seconds to zero for a model this small.
    engine = LLMEngine(folder, EngineConfig(device=device, dtype=dtype, num_blocks=1024))
    tokens_out = output_tokens(engine, prompts, greedy(tokens))
    del engine
    torch.cuda.empty_cache()
    return tokens_out


def hf_tokens(model: torch.nn.Module, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    from tests.engine_models import hf_greedy

    with torch.device("cuda"):
        return [hf_greedy(model, prompt, tokens) for prompt in prompts]


def trained_model_lines(tokens: int) -> tuple[list[str], bool]:
    from engine.tokenizer import Tokenizer
    from tests.engine_models import trained_model
    from tests.test_engine_trained_model import OPENINGS

    reference = trained_model()
    tokenizer = Tokenizer(reference.folder)
    prompts = [tokenizer.encode(text) for text in OPENINGS]
    progress("stories260K: the engine on the CPU ...")
    on_cpu = engine_tokens(reference.folder, prompts, tokens, "cpu", "float32")
    progress("stories260K: the engine on CUDA ...")
    on_cuda = engine_tokens(reference.folder, prompts, tokens, "cuda", "float32")
    progress("stories260K: transformers on CUDA ...")
    hf = hf_tokens(reference.model.to("cuda"), prompts, tokens)
    reference.model.to("cpu")
    versus_cpu, versus_hf = agreement(on_cuda, on_cpu), agreement(on_cuda, hf)
    story = tokenizer.decode(prompts[0] + on_cuda[0])
    lines = [versus_cpu.line("stories260K fp32, engine CUDA vs engine CPU"),
             versus_hf.line("stories260K fp32, engine CUDA vs transformers CUDA"),
             f"parity: stories260K story on CUDA: {story!r}"]
    return lines, versus_cpu.identical == versus_cpu.prompts and versus_hf.identical == versus_hf.prompts


def family_lines(tokens: int) -> tuple[list[str], bool]:
    """fp32 must match exactly; in bf16 both the engine and transformers are also held to the fp32 tokens,
    which tells rounding (both drift from fp32 about as early) from a fault (the engine drifts first)."""
    from tests.engine_models import REFERENCE_NAMES, build_hf_model, random_prompts, save_with_tokenizer

    prompts = random_prompts(8, 3, 40, seed=7)
    lines, exact = [], True
    with tempfile.TemporaryDirectory(prefix="veil-gpu-parity-") as scratch:
        for name in REFERENCE_NAMES:
            model = build_hf_model(name)
            folder = save_with_tokenizer(model, Path(scratch) / name)
            progress(f"{name}: the engine and transformers on CUDA, fp32 and bf16 ...")
            fp32 = hf_tokens(model.to("cuda", torch.float32), prompts, tokens)
            found = agreement(engine_tokens(folder, prompts, tokens, "cuda", "float32"), fp32)
            lines.append(found.line(f"{name} float32, engine CUDA vs transformers CUDA"))
            exact &= found.identical == found.prompts
            engine_bf16 = engine_tokens(folder, prompts, tokens, "cuda", "bfloat16")
            hf_bf16 = hf_tokens(model.to("cuda", torch.bfloat16), prompts, tokens)
            lines += [agreement(engine_bf16, hf_bf16).line(f"{name} bfloat16, engine CUDA vs transformers CUDA"),
                      agreement(engine_bf16, fp32).line(f"{name} bfloat16, engine CUDA vs fp32 transformers"),
                      agreement(hf_bf16, fp32).line(f"{name} bfloat16, transformers CUDA vs fp32 transformers")]
            del model
    return lines, exact


def preset_1b_lines(tokens: int) -> list[str]:
    from transformers import AutoModelForCausalLM

    from benchmarks.engine_gpu import PRESETS, write_random_llama

    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 128_000, (length,), generator=generator).tolist() for length in (16, 64, 200, 500)]
    with tempfile.TemporaryDirectory(prefix="veil-gpu-parity-1b-") as scratch:
        progress("writing the random 1b Llama ...")
        folder = write_random_llama(Path(scratch), PRESETS["1b"], torch.device("cuda"))
        got = engine_tokens(folder, prompts, tokens, "cuda", "bfloat16")
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to("cuda").eval()
        model.generation_config.eos_token_id = None
        want = hf_tokens(model, prompts, tokens)
    return [agreement(got, want).line("random 1b Llama bf16, engine CUDA vs transformers CUDA")]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=48, help="greedy output tokens per prompt (default: 48)")
    parser.add_argument("--preset-1b", action="store_true", help="also the random 1B Llama in bf16")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_parity.py needs a CUDA device", file=sys.stderr)
        return 2
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    lines, trained_exact = trained_model_lines(args.tokens)
    print("\n".join(lines), flush=True)
    lines, families_exact = family_lines(args.tokens)
    print("\n".join(lines), flush=True)
    if args.preset_1b:
        print("\n".join(preset_1b_lines(args.tokens)), flush=True)
    exact = trained_exact and families_exact
    print(f"parity: fp32 {'exact everywhere (target met)' if exact else 'DIFFERS (target missed)'}")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
