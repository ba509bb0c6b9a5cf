"""`veil model init-tiny` and `veil generate`: the engine alone, without a node."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.config import EngineConfig


def register(subparsers: argparse._SubParsersAction) -> None:
    model = subparsers.add_parser("model", help="write the built-in tiny model folder (init-tiny)")
    model_commands = model.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    init = model_commands.add_parser("init-tiny", help="write the built-in random-weight Llama (nothing is downloaded)")
    init.add_argument("dir", type=Path, help="folder to write the model into")
    init.add_argument("--preset", choices=("tiny", "bench"), default="tiny", help="tiny: tests and demo; bench: ~46M parameters")
    init.add_argument("--seed", type=int, default=0, help="weight seed (same seed, same bytes)")
    init.set_defaults(handler=_init_tiny)

    generate = subparsers.add_parser("generate", help="generate text locally through the engine (no network, no encryption)")
    generate.add_argument("prompt", help="the prompt")
    generate.add_argument("--model", type=Path, required=True, help="Hugging Face model folder")
    _add_sampling_arguments(generate)
    generate.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    generate.set_defaults(handler=_generate)


def _add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate (default: 64)")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature, 0 = greedy (default: %(default)s, greedy)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0, off)")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (default: 0, off)")
    parser.add_argument("--seed", type=int, default=None,
                        help="sampling seed: the same seed gives the same text (default: none, a fresh random draw)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                        help="compute dtype (default: the model's own where this device computes it natively, else float32)")
    parser.add_argument("--kv-cache-gib", type=float, default=0.5, help="KV pool size on CPU")
    parser.add_argument("--eager", action="store_true",
                        help="run every step eagerly: no CUDA graphs for decode steps (graphs never run on a CPU)")
    parser.add_argument("--sync-scheduling", action="store_true",
                        help="read each step's tokens before launching the next (default: async steps on CUDA only)")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine settings `veil generate` asks for; graphs and async steps unset mean on where the device is CUDA."""
    from engine import EngineConfig

    return EngineConfig(dtype=args.dtype, kv_cache_gib=args.kv_cache_gib, cuda_graphs=False if args.eager else None,
                        async_scheduling=False if args.sync_scheduling else None)


def _init_tiny(args: argparse.Namespace) -> int:
    from engine.tiny import write_tiny_model

    try:
        folder = write_tiny_model(args.dir, preset=args.preset, seed=args.seed)
    except OSError as error:
        print(f"veil model init-tiny: cannot write the model to {args.dir} ({error.strerror})", file=sys.stderr)
        return 1
    print(f"wrote the {args.preset} model (seed {args.seed}) to {folder}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from engine import EngineError, LLMEngine, SamplingParams
    from engine.tokenizer import ChatMessage

    try:
        engine = LLMEngine(args.model, engine_config(args))
        choice = engine.runner.dtype_choice  # the engine itself logs nothing: its command line says it
        if choice.widened:  # slower and larger than the checkpoint: worth a line
            print(f"veil generate: weights and KV in {choice.name} ({choice.reason})", file=sys.stderr)
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed
        )
        prompt = engine.tokenizer.encode_chat([ChatMessage("user", args.prompt)]) if args.chat else args.prompt
        engine.add_request(prompt, params)
        for delta in engine.stream():
            sys.stdout.write(delta.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
    except EngineError as error:
        print(f"veil generate: {error}", file=sys.stderr)
        return 1
    return 0

