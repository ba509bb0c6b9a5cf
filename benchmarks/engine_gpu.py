"""The engine on one CUDA GPU: decode step time against the weights-only floor, offline throughput against
`transformers` with a static cache and `torch.compile`, and the cost of zero-on-free, on a random
Llama-shaped model.

Model (random bf16 weights written to a temporary folder, nothing downloaded):
  --preset 1b  Llama-3.2-1B shape: hidden 2048, 16 layers, 32 query / 8 KV heads of 64, intermediate 8192,
               vocab 128,256, tied embeddings, rope_theta 500,000 with llama3 scaling;
  --preset 8b  Llama-3.1-8B shape: hidden 4096, 32 layers, 32 / 8 heads of 128, intermediate 14,336, untied.
Measured in one run:
  1. decode ms per engine step at each --batches size, every sequence past its --decode-prompt-len prompt,
     next to the weights-only floor: the weights' bytes over the device copy bandwidth measured here.
     Decode steps replay CUDA graphs unless --eager is given, and each step is launched before the previous
     one's tokens are read unless --sync-scheduling is given: run with and without either to compare (every
     line says which way the engine ran); then, at --profile-batch, --decode-steps decode steps under the CUDA
     profiler: the host<->device copies the device ran (HtoD and DtoH, pinned or pageable) against the
     bridge's own count of the same steps (`engine.bridge_profile`), one each way per step;
  2. offline output tokens/s of the engine on --requests requests (prompts 64-1,024 tokens, outputs 32-512,
     seeded, greedy, ignore_eos); every engine run below runs the workload twice and times the second pass;
  3. the same requests through the engine with zeroing skipped (a fresh engine), to price zero-on-free;
  4. the same requests through `transformers.generate` in static left-padded batches of --hf-batch-size
     with a static cache and `torch.compile` (each batch runs to its longest output; the workload runs
     twice and the second pass is timed, so compilation is not);
  5. with --bridge-toll-us T: the same requests through an engine whose every host<->device crossing waits
     T us, one at a time (`engine.bridge`, a confidential-computing bounce buffer simulated), against run 2.
Also the engine's load time and the bridge crossings its weights took (they cross in large pinned chunks).
--decode-only stops after 1 (a variant's decode times in little device time).
The targets are printed next to each figure (set for the 1b preset). Progress goes to stderr.

    python benchmarks/engine_gpu.py [--preset 1b|8b] [--batches 1 16 64 256] [--requests 256] [--eager] [--sync-scheduling]
                                    [--bridge-toll-us 300]

Needs CUDA: without a CUDA device it exits with status 2.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

# Run as a script, this folder would come first on sys.path and its kernels.py would shadow the package.
sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402

from benchmarks.common import Workload, progress  # noqa: E402

if TYPE_CHECKING:
    from engine.bridge import CrossingCount
    from engine.bridge_profile import ProfiledCopies

DECODE_TARGET_MS = {1: 2.0, 64: 4.0, 256: 8.0}
OFFLINE_TARGET_TOKENS_PER_S = 25_000
OFFLINE_TARGET_RATIO = 3.0
ZEROING_TARGET_PERCENT = 2.0
TOLL_TARGET_RATIO = 0.95  # throughput through a simulated 300 us bridge toll, of the toll-free throughput
PROMPT_RANGE, OUTPUT_RANGE = (64, 1024), (32, 512)
SHARD_BYTES = 4 << 30


@dataclass(frozen=True, slots=True)
class LlamaShape:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool


PRESETS = {
    "1b": LlamaShape(2048, 16, 32, 8, 64, 8192, 128256, True),
    "8b": LlamaShape(4096, 32, 32, 8, 128, 14336, 128256, False),
}


# ----- the model folder ---------------------------------------------------------------------------------


def model_config(shape: LlamaShape, bos: int, eos: list[int]) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": shape.hidden_size, "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_hidden_layers, "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads, "head_dim": shape.head_dim,
        "vocab_size": shape.vocab_size, "tie_word_embeddings": shape.tie_word_embeddings,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "attention_bias": False, "mlp_bias": False, "torch_dtype": "bfloat16", "bos_token_id": bos, "eos_token_id": eos,
    }


def weight_shapes(shape: LlamaShape) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint, Hugging Face names, in file order."""
    hidden, kv_width = shape.hidden_size, shape.num_key_value_heads * shape.head_dim
    q_width = shape.num_attention_heads * shape.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (shape.vocab_size, hidden)}
    for layer in range(shape.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        shapes |= {
            prefix + "self_attn.q_proj.weight": (q_width, hidden), prefix + "self_attn.k_proj.weight": (kv_width, hidden),
            prefix + "self_attn.v_proj.weight": (kv_width, hidden), prefix + "self_attn.o_proj.weight": (hidden, q_width),
            prefix + "mlp.gate_proj.weight": (shape.intermediate_size, hidden),
            prefix + "mlp.up_proj.weight": (shape.intermediate_size, hidden),
            prefix + "mlp.down_proj.weight": (hidden, shape.intermediate_size),
            prefix + "input_layernorm.weight": (hidden,), prefix + "post_attention_layernorm.weight": (hidden,),
        }
    shapes["model.norm.weight"] = (hidden,)
    if not shape.tie_word_embeddings:
        shapes["lm_head.weight"] = (shape.vocab_size, hidden)
    return shapes


def write_random_llama(folder: Path, shape: LlamaShape, device: torch.device, seed: int = 0) -> Path:
    """A Hugging Face folder: config, the built-in tiny tokenizer, random bf16 weights in shards with an index."""
    from safetensors.torch import save_file

    from engine.tiny import BOS, EOS, EOT, TOKENIZER_VOCAB, build_tokenizer

    tokenizer = build_tokenizer(TOKENIZER_VOCAB)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOT}))
    ids = [tokenizer.token_to_id(token) for token in (BOS, EOS, EOT)]
    (folder / "config.json").write_text(json.dumps(model_config(shape, ids[0], ids[1:]), indent=2))
    generator = torch.Generator(device).manual_seed(seed)
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = 0
    for name, dims in weight_shapes(shape).items():
        shard[name] = _random_weight(dims, generator, device).cpu()
        shard_bytes += shard[name].numel() * 2
        if shard_bytes >= SHARD_BYTES:
            _save_shard(folder, shard, weight_map, save_file)
            shard, shard_bytes = {}, 0
    if shard:
        _save_shard(folder, shard, weight_map, save_file)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def _random_weight(dims: tuple[int, ...], generator: torch.Generator, device: torch.device) -> torch.Tensor:
    if len(dims) == 1:
        return torch.ones(dims, dtype=torch.bfloat16, device=device)  # norm weights
    # 1/sqrt(fan_in) keeps activations at unit scale through the layers.
    weight = torch.randn(dims, generator=generator, device=device, dtype=torch.float32) / dims[1] ** 0.5
    return weight.to(torch.bfloat16)


def _save_shard(folder: Path, shard: dict[str, torch.Tensor], weight_map: dict[str, str], save_file) -> None:
    name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
    save_file(shard, str(folder / name), metadata={"format": "pt"})
    weight_map |= dict.fromkeys(shard, name)


# ----- measurements -------------------------------------------------------------------------------------


def copy_bandwidth(device: torch.device, gib: int = 2, repeats: int = 10) -> float:
    """Bytes per second a device-to-device copy moves (read plus write), best of `repeats` (on a CPU: memory)."""
    # Written before it is read: on a CPU an untouched allocation is the kernel's one zero page, read from the
    # cache, which made the copy about 1.3x faster than memory (51 against 40 GB/s on one core) and the weights
    # floor that much too low.
    source = torch.ones(gib << 30, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda _device: None)
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        started = time.perf_counter()
        target.copy_(source)
        synchronize(device)
        best = min(best, time.perf_counter() - started)
    return 2 * source.numel() / best


def weight_bytes(model: torch.nn.Module) -> int:
    unique = {param.data_ptr(): param for param in model.parameters()}  # tied embeddings count once
    return sum(param.numel() * param.element_size() for param in unique.values())


def make_workload(requests: int, vocab: int, seed: int) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(*PROMPT_RANGE))] for _ in range(requests)]
    return Workload(prompts, [rng.randint(*OUTPUT_RANGE) for _ in range(requests)])


def start_decoding(engine, batch: int, prompt_len: int, steps: int, vocab: int) -> list[str]:
    """`batch` sequences of `prompt_len` random prompt tokens, prefilled, each with room for `steps` decode steps."""
    from engine import SamplingParams

    rng = random.Random(batch)
    # Room for the decode steps taken while later sequences still prefill (a large batch prefills over many
    # steps), so that every sequence still decodes through the timed steps and is there to abort.
    prefill_steps = -(-batch * prompt_len // engine.config.max_num_batched_tokens)
    params = SamplingParams(max_tokens=steps + prefill_steps + 8, temperature=0.0, ignore_eos=True)
    requests = [engine.add_request([rng.randrange(vocab) for _ in range(prompt_len)], params) for _ in range(batch)]
    while any(seq.num_computed_tokens < seq.num_prompt_tokens for seq in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    engine.step()  # the first decode step of the last prefilled sequences
    return requests


def stop_decoding(engine, requests: list[str]) -> None:
    for request_id in requests:
        engine.abort(request_id)
    while engine.has_unfinished():
        engine.step()


def decode_ms_per_step(engine, batch: int, prompt_len: int, steps: int, vocab: int) -> float:
    """Every sequence prefilled first; then the mean wall time of `steps` engine steps that only decode."""
    requests = start_decoding(engine, batch, prompt_len, steps, vocab)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    stop_decoding(engine, requests)
    return 1000 * elapsed / steps


def profiled_crossings(engine, batch: int, prompt_len: int, steps: int, vocab: int) -> tuple[ProfiledCopies, CrossingCount]:
    """`steps` decode steps under the CUDA profiler: the copies the device ran, and those the bridge counted."""
    from engine.bridge_profile import profile_copies

    requests = start_decoding(engine, batch, prompt_len, steps, vocab)
    with engine.runner.bridge.counting() as counted:
        copies = profile_copies(lambda: [engine.step() for _ in range(steps)])
    stop_decoding(engine, requests)
    return copies, counted


def run_engine_offline(engine, workload: Workload) -> float:
    from engine import SamplingParams

    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in workload.output_lens]
    # A whole untimed pass first, as transformers gets: the first pass of a process compiles the prefill
    # kernels for the workload's shapes, which cost the first engine measured on the H100 (2026-11-27) more
    # than a third of its time and made the engines measured after it look faster than it.
    engine.generate(workload.prompts, params)
    torch.cuda.synchronize()
    started = time.perf_counter()
    outputs = engine.generate(workload.prompts, params)
    elapsed = time.perf_counter() - started
    produced = sum(len(output.outputs[0].token_ids) for output in outputs)
    assert produced == workload.output_tokens, "every request must produce exactly its max_tokens"
    return elapsed


def run_transformers_compiled(model_dir: str, workload: Workload, batch_size: int) -> float:
    """transformers.generate with a static cache and torch.compile, in static left-padded batches.

    The whole workload runs twice with the same shapes and only the second pass is timed, so neither
    compilation nor a recompilation for a new cache length is counted against transformers.
    """
    from transformers import AutoModelForCausalLM, CompileConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to("cuda").eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.cache_implementation = "static"
    model.generation_config.compile_config = CompileConfig()
    batches = [range(begin, min(begin + batch_size, len(workload.prompts)))
               for begin in range(0, len(workload.prompts), batch_size)]
    elapsed = 0.0
    for timed in (False, True):
        torch.cuda.synchronize()
        started = time.perf_counter()
        for number, batch in enumerate(batches, 1):
            progress(f"transformers {'timed' if timed else 'compile'} pass: batch {number} of {len(batches)} ...")
            _hf_batch(model, workload, batch)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - started
    return elapsed


def _hf_batch(model, workload: Workload, batch: range) -> None:
    prompts = [workload.prompts[i] for i in batch]
    max_new_tokens = max(workload.output_lens[i] for i in batch)
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    with torch.inference_mode():
        model.generate(input_ids=ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=max_new_tokens,
                       min_new_tokens=max_new_tokens, do_sample=False)


# ----- report -------------------------------------------------------------------------------------------


def verdict(met: bool) -> str:
    return "met" if met else "NOT met"


def decode_line(batch: int, ms: float, floor_ms: float, targets: bool, mode: str) -> str:
    target = DECODE_TARGET_MS.get(batch) if targets else None
    note = f"[target <= {target:.1f} ms: {verdict(ms <= target)}]" if target else "[no target at this batch]"
    return (f"decode batch {batch:4d} ({mode}): {ms:8.2f} ms/step  {batch * 1000 / ms:10.1f} tok/s  "
            f"{ms / floor_ms:6.1f}x the weights floor  {note}")


def crossings_lines(batch: int, steps: int, mode: str, copies: ProfiledCopies, counted: CrossingCount) -> list[str]:
    """The profiler's copies per decode step against the bridge's count: one each way, equal, none pageable."""
    met = (copies.h2d, copies.d2h) == (counted.h2d, counted.d2h) == (steps, steps) and not copies.pageable
    return [f"crossings under the CUDA profiler, decode batch {batch} ({mode}), {steps} steps: "
            f"{copies.h2d / steps:.2f} HtoD + {copies.d2h / steps:.2f} DtoH per step, {copies.pageable} pageable; "
            f"the bridge counted {counted.h2d / steps:.2f} + {counted.d2h / steps:.2f}  "
            f"[target 1 + 1, the same as the bridge's, none pageable: {verdict(met)}]",
            f"  copies seen: {copies.describe()}"]


def engine_mode(engine) -> str:
    """How the engine runs decode steps: with CUDA graphs or eagerly, steps overlapped or synchronous."""
    sizes = engine.runner.graph_batch_sizes
    graphs = f"cuda graphs, batch <= {sizes[-1]}" if sizes else "eager"
    return graphs + (", async steps" if engine.async_scheduling else ", synchronous steps")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="1b",
                        help="model shape: 1b (Llama-3.2-1B, the default) or 8b (Llama-3.1-8B)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256],
                        help="batch sizes for the decode step time (default: 1 16 64 256)")
    parser.add_argument("--decode-steps", type=int, default=20, help="decode steps timed per batch size (default: 20)")
    parser.add_argument("--decode-prompt-len", type=int, default=512,
                        help="prompt tokens of every sequence in the decode measurement (default: 512)")
    parser.add_argument("--profile-batch", type=int, default=64,
                        help="count the decode steps' host<->device copies under the CUDA profiler at this batch "
                             "size, against the bridge's own count (0: skip; default: 64)")
    parser.add_argument("--requests", type=int, default=256, help="requests in the offline workload (default: 256)")
    parser.add_argument("--hf-batch-size", type=int, default=64,
                        help="static batch size for transformers.generate (default: 64)")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="engine: most sequences per step (default: 256)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192,
                        help="engine: most tokens per step (default: 8192)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85,
                        help="engine: fraction of free device memory for the KV cache and the decode graphs "
                             "(default: 0.85)")
    parser.add_argument("--eager", action="store_true",
                        help="engine: run every step eagerly, without CUDA graphs (compare the decode ms/step)")
    parser.add_argument("--sync-scheduling", action="store_true",
                        help="engine: read each step's tokens before launching the next (no async scheduling)")
    parser.add_argument("--decode-only", action="store_true",
                        help="stop after the decode step times and the profiled crossings: no offline runs (to "
                             "compare --eager or --sync-scheduling with the default in little device time)")
    parser.add_argument("--skip-transformers", action="store_true",
                        help="leave out the transformers baseline (no ratio is printed)")
    parser.add_argument("--seed", type=int, default=1234, help="seed of the workload and the weights (default: 1234)")
    parser.add_argument("--bridge-toll-us", type=float, default=0.0,
                        help="also run the offline workload with every host<->device crossing waiting this long "
                             "(a simulated confidential-computing bridge) and compare it with the toll-free run")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("engine_gpu.py measures the engine on a CUDA GPU and none is available here "
              "(torch.cuda.is_available() is False); run it on a CUDA machine, or use "
              "benchmarks/engine_throughput.py on a CPU", file=sys.stderr)
        return 2
    shape, device = PRESETS[args.preset], torch.device("cuda")
    with tempfile.TemporaryDirectory(prefix="veil-gpu-bench-") as model_dir:
        progress(f"writing a random {args.preset} Llama to {model_dir} ...")
        write_random_llama(Path(model_dir), shape, device, seed=args.seed)
        measure(args, model_dir, shape, device)
    return 0


def report(*lines: str) -> None:
    """Prints result lines as they are measured: a run cut off by its time limit keeps what it measured."""
    print("\n".join(lines), flush=True)


def measure(args: argparse.Namespace, model_dir: str, shape: LlamaShape, device: torch.device) -> None:
    from engine import LLMEngine

    targets = args.preset == "1b"
    bandwidth = copy_bandwidth(device)
    progress("loading the engine ...")
    started = time.perf_counter()
    engine = LLMEngine(model_dir, engine_config(args))
    load_s, loaded = time.perf_counter() - started, engine.runner.bridge.total.copy()
    weights = weight_bytes(engine.runner.model)
    floor_ms = 1000 * weights / bandwidth
    mode = engine_mode(engine)
    report(f"device: {torch.cuda.get_device_name(device)}, copy bandwidth {bandwidth / 1e12:.2f} TB/s",
             f"model: random {args.preset} Llama, {weights / 1e9:.2f} GB of bf16 weights; "
             f"weights-only floor {floor_ms:.2f} ms/step" + ("" if targets else " (targets are set for the 1b preset)"),
             memory_line(engine),
             f"load: {load_s:.1f} s from disk to device (graphs captured), weights in {loaded.h2d} bridge crossings "
             f"of {loaded.h2d_bytes / 1e9:.2f} GB")
    for batch in args.batches:
        progress(f"decode at batch {batch} ({mode}) ...")
        ms = decode_ms_per_step(engine, batch, args.decode_prompt_len, args.decode_steps, shape.vocab_size)
        report(decode_line(batch, ms, floor_ms, targets, mode))
    if args.profile_batch:
        progress(f"decode at batch {args.profile_batch} under the CUDA profiler, counting copies ...")
        copies, counted = profiled_crossings(engine, args.profile_batch, args.decode_prompt_len, args.decode_steps,
                                             shape.vocab_size)
        report(*crossings_lines(args.profile_batch, args.decode_steps, mode, copies, counted))
    if args.decode_only:
        return
    workload = make_workload(args.requests, shape.vocab_size, args.seed)
    progress(f"engine offline: {args.requests} requests, {workload.output_tokens} output tokens ...")
    engine_rate = workload.output_tokens / run_engine_offline(engine, workload)
    target = f"  [target >= {OFFLINE_TARGET_TOKENS_PER_S:,} tok/s: {verdict(engine_rate >= OFFLINE_TARGET_TOKENS_PER_S)}]"
    report(f"offline, veil engine ({mode}): {engine_rate:10.1f} output tok/s" + (target if targets else ""))
    del engine
    free_device_memory()
    report(*price_zeroing(args, model_dir, workload, engine_rate))
    if args.bridge_toll_us:
        report(*price_toll(args, model_dir, workload, engine_rate))
    if not args.skip_transformers:
        hf_rate = workload.output_tokens / run_transformers_compiled(model_dir, workload, args.hf_batch_size)
        ratio = engine_rate / hf_rate
        report(f"offline, transformers static+compile: {hf_rate:10.1f} output tok/s "
               f"(batches of {args.hf_batch_size})")
        report(f"ratio veil / transformers compiled: {ratio:.2f}x"
               + (f"  [target >= {OFFLINE_TARGET_RATIO:.0f}x: {verdict(ratio >= OFFLINE_TARGET_RATIO)}]" if targets else ""))


def engine_config(args: argparse.Namespace, skip_zeroing: bool = False, toll_us: float = 0.0):
    from engine import EngineConfig

    return EngineConfig(
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization, cuda_graphs=False if args.eager else None,
        async_scheduling=False if args.sync_scheduling else None, unsafe_skip_zeroing=skip_zeroing,
        bridge_toll_us=toll_us)


def price_toll(args: argparse.Namespace, model_dir: str, workload: Workload, engine_rate: float) -> list[str]:
    """The offline workload again through a simulated confidential bridge: what its tolls cost."""
    from engine import LLMEngine

    progress(f"engine offline with a bridge toll of {args.bridge_toll_us:g} us per crossing ...")
    engine = LLMEngine(model_dir, engine_config(args, toll_us=args.bridge_toll_us))
    with engine.runner.bridge.counting() as crossed:
        steps = engine.runner.bridge.steps
        tolled_rate = workload.output_tokens / run_engine_offline(engine, workload)
        steps = engine.runner.bridge.steps - steps
    del engine
    free_device_memory()
    ratio = tolled_rate / engine_rate
    return [f"offline, veil engine, bridge toll {args.bridge_toll_us:g} us: {tolled_rate:10.1f} output tok/s, "
            f"{crossed.h2d / steps:.2f} + {crossed.d2h / steps:.2f} crossings per step",
            f"ratio tolled / toll-free: {ratio:.3f}  [target >= {TOLL_TARGET_RATIO}: {verdict(ratio >= TOLL_TARGET_RATIO)}]"]


def price_zeroing(args: argparse.Namespace, model_dir: str, workload: Workload, engine_rate: float) -> list[str]:
    """The offline workload again with zeroing skipped: what zero-on-free costs in throughput."""
    from engine import LLMEngine

    progress("engine offline with zeroing skipped, to price zero-on-free ...")
    engine = LLMEngine(model_dir, engine_config(args, skip_zeroing=True))
    unsafe_rate = workload.output_tokens / run_engine_offline(engine, workload)
    del engine
    free_device_memory()
    cost = 100 * (1 - engine_rate / unsafe_rate)
    return [f"offline, veil engine, zeroing skipped: {unsafe_rate:10.1f} output tok/s",
            f"cost of zero-on-free: {cost:+.2f}% of throughput  [target < {ZEROING_TARGET_PERCENT:.0f}%: "
            f"{verdict(cost < ZEROING_TARGET_PERCENT)}]"]


def free_device_memory() -> None:
    """Gives a deleted engine's device memory back before the next model loads."""
    gc.collect()
    torch.cuda.empty_cache()


def memory_line(engine) -> str:
    runner = engine.runner
    kv_gib = runner.kv_cache.numel() * runner.kv_cache.element_size() / (1 << 30)
    mib = 1 << 20
    return (f"memory: KV pool {kv_gib:.2f} GiB ({runner.num_blocks} blocks), decode graphs "
            f"{runner.graph_memory_bytes / mib:.0f} MiB (reserved {runner.graph_reserve_bytes / mib:.0f} MiB), "
            f"budget {runner.memory_budget_bytes / (1 << 30):.2f} GiB")


if __name__ == "__main__":
    sys.exit(main())
