"""Models and helpers shared by the engine tests.

The oracle is Hugging Face `transformers`: each reference model is built from a config with seeded
random weights, saved with `save_pretrained`, and given the tokenizer of the built-in tiny model, so
the engine loads the very weights `transformers` runs. Folders are built once per test run.
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import engine.sampler as sampler_module
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.scheduler import ScheduledChunk
from engine.sequence import Sequence
from engine.tiny import TOKENIZER_VOCAB, build_tokenizer, write_tiny_model

# The tiny model's vocabulary (exactly its tokenizer's), shared by every reference model here.
VOCAB_SIZE = build_tokenizer(TOKENIZER_VOCAB).get_vocab_size()
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True, slots=True)
class ReferenceModel:
    """A `transformers` model and the folder it was saved to."""

    name: str
    model: torch.nn.Module
    folder: Path


def _hf_classes(name: str):
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    return {
        # Grouped-query attention: 4 query heads share 2 KV heads.
        "llama": (LlamaForCausalLM, LlamaConfig, {}),
        # Qwen2 always has q/k/v biases; here the embeddings double as the output head.
        "qwen2": (Qwen2ForCausalLM, Qwen2Config, {"tie_word_embeddings": True}),
        # Qwen3 normalises q and k per head; head_dim is set explicitly and differs from hidden / heads.
        "qwen3": (Qwen3ForCausalLM, Qwen3Config, {"head_dim": 32}),
        "mistral": (MistralForCausalLM, MistralConfig, {"sliding_window": None}),
        # Llama 3 frequency scaling, with an original context short enough that it changes most frequencies.
        "llama3-rope": (LlamaForCausalLM, LlamaConfig, {"rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0}),
        # Biases on every attention projection (the output one too) and on the MLP.
        "llama-biases": (LlamaForCausalLM, LlamaConfig, {"attention_bias": True, "mlp_bias": True}),
        "qwen3-biases": (Qwen3ForCausalLM, Qwen3Config, {"head_dim": 32, "attention_bias": True}),
    }[name]


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
REFERENCE_NAMES = ("llama", "qwen2", "qwen3")  # the three the generate parity runs on
MORE_REFERENCE_NAMES = ("mistral", "llama3-rope", "llama-biases", "qwen3-biases")  # logits parity only


@cache
def _scratch_root() -> Path:
    root = Path(tempfile.mkdtemp(prefix="veil-engine-tests-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


@cache
def tiny_model_dir() -> Path:
    """The built-in tiny Llama (seed 0), written once per test run."""
    return write_tiny_model(_scratch_root() / "tiny")


SMALL_VOCAB = 16  # fewer ids than the most logprobs a request may ask for


@cache
def small_vocab_model_dir() -> Path:
    """The tiny model with its embeddings and output head cut to the first SMALL_VOCAB ids."""
    folder = write_tiny_model(_scratch_root() / "small-vocab")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"vocab_size": SMALL_VOCAB}))
    weights = load_file(folder / "model.safetensors")
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        weights[name] = weights[name][:SMALL_VOCAB].clone()
    save_file(weights, folder / "model.safetensors")
    return folder


def build_hf_model(name: str, dtype: torch.dtype = torch.float32):
    """A `transformers` model of family `name` with seeded random weights (not saved)."""
    model_class, config_class, extra = _hf_classes(name)
    torch.manual_seed(0)
    config = config_class(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        # Large weights make the top logit stand clear of the next, so greedy choices are decisive.
        initializer_range=0.2,
        **extra,
    )
    model = model_class(config).eval()
    _randomize_defaults(model)
    return model.to(dtype)


def _randomize_defaults(model: torch.nn.Module) -> None:
    """Biases start at zero and norm weights at one; random values prove they are loaded and applied."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
            elif "norm" in name:
                param.copy_(1.0 + torch.randn(param.shape, generator=generator) * 0.1)


def save_with_tokenizer(model: torch.nn.Module, folder: Path, **save_kwargs) -> Path:
    model.save_pretrained(folder, **save_kwargs)
    for file_name in TOKENIZER_FILES:
        shutil.copy(tiny_model_dir() / file_name, folder / file_name)
    return folder


@cache
def reference_model(name: str) -> ReferenceModel:
    """The fp32 reference model of family `name`, saved once per test run."""
    model = build_hf_model(name)
    return ReferenceModel(name, model, save_with_tokenizer(model, _scratch_root() / f"hf-{name}"))


@cache
def trained_model() -> ReferenceModel:
    """The shipped trained model (stories260K, `veil.models`) as `transformers` loads it from the same folder.

    Its generation config's end tokens are dropped: the engine's reference runs (`greedy`) ignore them,
    and `hf_greedy`'s `min_new_tokens` would otherwise keep them from being picked.
    """
    from transformers import LlamaForCausalLM

    from veil.models import shipped_model_dir

    folder = shipped_model_dir()
    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return ReferenceModel("stories260K", model, folder)


def random_prompts(count: int, shortest: int, longest: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(shortest, longest + 1, (count,), generator=generator).tolist()
    return [torch.randint(0, VOCAB_SIZE, (length,), generator=generator).tolist() for length in lengths]


def random_lengths(count: int, shortest: int, longest: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(shortest, longest + 1, (count,), generator=generator).tolist()


@torch.no_grad()
def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """What `transformers.generate` picks greedily for one prompt, exactly `max_new_tokens` tokens.

    The attention mask is given: inferred, it would mask every prompt token equal to the pad id.
    """
    generated = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    return generated[0, len(prompt) :].tolist()


@torch.no_grad()
def hf_logits(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    return model(torch.tensor([prompt])).logits[0].float()


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kwargs)


def output_tokens(engine: LLMEngine, prompts: list, params: list[SamplingParams] | SamplingParams) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in engine.generate(prompts, params)]


def prefill_logits(engine: LLMEngine, prompts: list[list[int]], chunk: int | None = None) -> list[torch.Tensor]:
    """The engine's logits at every prompt position, all prompts flattened into the same steps.

    With `chunk`, each prompt is prefilled `chunk` tokens per step (chunked prefill over the paged cache).
    The sequences' blocks are freed and zeroed afterwards, so the engine stays clean.
    """
    sequences = [
        Sequence(seq_id=10_000 + i, request_id=f"logits-{i}", sample_index=0, prompt_token_ids=list(p),
                 params=greedy(1), seed=None, max_tokens=1)
        for i, p in enumerate(prompts)
    ]
    rows: list[list[torch.Tensor]] = [[] for _ in prompts]
    step = chunk or max(len(p) for p in prompts)
    try:
        with torch.inference_mode():
            while any(seq.num_uncomputed_tokens for seq in sequences):
                _prefill_step(engine, sequences, rows, step)
    finally:
        for seq in sequences:
            engine.block_manager.free(seq)
        engine.block_manager.scrub_freed()
    return [torch.cat(parts) for parts in rows]


def _prefill_step(engine: LLMEngine, sequences: list[Sequence], rows: list[list[torch.Tensor]], step: int) -> None:
    active = [(i, seq) for i, seq in enumerate(sequences) if seq.num_uncomputed_tokens]
    chunks = []
    for _, seq in active:
        num_tokens = min(step, seq.num_uncomputed_tokens)
        engine.block_manager.reserve(seq, num_tokens)
        chunks.append(ScheduledChunk(seq, num_tokens))
    inputs = engine.runner.prepare(chunks)
    hidden = engine.runner.model(inputs.input_ids, inputs.positions, engine.runner.kv_cache, inputs.meta)
    logits = engine.runner.model.compute_logits(hidden)
    start = 0
    for (index, seq), scheduled in zip(active, chunks):
        rows[index].append(logits[start : start + scheduled.num_tokens].clone())
        start += scheduled.num_tokens
        seq.num_computed_tokens += scheduled.num_tokens


def tiny_engine(**config) -> LLMEngine:
    return LLMEngine(tiny_model_dir(), EngineConfig(**config))


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    """The built-in tiny model's folder, written once per run."""
    return tiny_model_dir()


@pytest.fixture(scope="session")
def reference_models() -> dict[str, ReferenceModel]:
    """The three `transformers` reference models, each built and saved once per run."""
    return {name: reference_model(name) for name in REFERENCE_NAMES}


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """These models are tiny: extra intra-op threads only add synchronisation, and on a busy two-core
    machine they oversubscribe it and make every step several times slower. Restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@contextmanager
def only_the_read_may_wait(monkeypatch) -> Iterator[list]:
    """Runs the block with CUDA's sync debug mode at "error", so that any wait on the device raises,
    except inside the sampler's `_to_host`: the one read of a step's picks that may wait. Yields the
    list of what each such read was given (`sampler.HostCopy`)."""
    reads: list = []
    real_to_host = sampler_module._to_host

    def read(copy):
        reads.append(copy)
        torch.cuda.set_sync_debug_mode("default")
        try:
            return real_to_host(copy)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    monkeypatch.setattr(sampler_module, "_to_host", read)
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield reads
    finally:
        torch.cuda.set_sync_debug_mode("default")


def staging_in_use_is_pinned(bridge) -> bool:
    """Whether every download buffer the bridge has used is pinned host memory (one never used is still
    empty, and an empty tensor reads as unpinned)."""
    used = [slot.staging.tensor for slot in bridge._slots if slot.staging.capacity]
    return bool(used) and all(tensor.is_pinned() for tensor in used)


def bridge_buffers(bridge) -> dict[str, torch.Tensor]:
    """Every buffer of the bridge a step's crossings pass through, by a name for a failure message: the
    upload staging buffers, the device buffers each way, and the download slots."""
    buffers = {f"upload staging {turn}": staging.tensor for turn, staging in enumerate(bridge._uploads.staging)}
    buffers |= {"device in": bridge._device_in.tensor, "device out": bridge._device_out.tensor}
    return buffers | {f"download slot {n}": slot.staging.tensor for n, slot in enumerate(bridge._slots)}


@contextmanager
def running_core(model_dir: Path, config: EngineConfig) -> Iterator["EngineCoreClient"]:
    """An engine core process on `model_dir`, started, and stopped when the block ends."""
    from engine.core_client import EngineCoreClient

    client = EngineCoreClient(model_dir, config)
    client.start()
    try:
        yield client
    finally:
        client.stop()
