"""Model and engine configuration."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.errors import ModelLoadError

SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[name.lower()]
    except KeyError:
        raise ModelLoadError(f"unsupported dtype {name!r}; use one of float32, bfloat16, float16") from None


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Llama 3 style frequency scaling; `rope_type == "default"` means none."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The parts of a Hugging Face `config.json` a Llama-family decoder needs."""

    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    attention_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    torch_dtype: torch.dtype
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    sliding_window: int | None = None

    @classmethod
    def from_dict(cls, raw: dict) -> ModelConfig:
        architecture = _architecture(raw)
        family = SUPPORTED_ARCHITECTURES[architecture]
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        return cls(
            architecture=architecture,
            family=family,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(_rope_parameters(raw).get("rope_theta", raw.get("rope_theta", 10000.0))),
            rope_scaling=_rope_scaling(raw),
            # Qwen2 always has q/k/v biases; Llama and Mistral make it optional.
            attention_bias=family == "qwen2" or bool(raw.get("attention_bias", False)),
            qk_norm=family == "qwen3",
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            torch_dtype=parse_dtype(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            eos_token_ids=_token_ids(raw.get("eos_token_id")),
            bos_token_id=raw.get("bos_token_id"),
            sliding_window=_sliding_window(raw, family),
        )

    @classmethod
    def from_folder(cls, folder: Path) -> ModelConfig:
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"no config.json in model folder {folder}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise ModelLoadError(f"config.json in {folder} is not valid JSON: {error.msg}") from None
        config = cls.from_dict(raw)
        extra_eos = _generation_eos(Path(folder))
        if extra_eos:
            merged = tuple(dict.fromkeys(config.eos_token_ids + extra_eos))
            config = dataclasses.replace(config, eos_token_ids=merged)
        return config

    @property
    def max_context(self) -> int:
        """Longest sequence served: the sliding window caps it because the engine has no windowed attention."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings


def _architecture(raw: dict) -> str:
    names = raw.get("architectures") or []
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    found = ", ".join(map(str, names)) or "none declared"
    raise ModelLoadError(f"unsupported model architecture ({found}); supported: {supported}")


def _rope_parameters(raw: dict) -> dict:
    # Newer configs nest rope settings under "rope_parameters".
    return raw.get("rope_parameters") or {}


def _rope_scaling(raw: dict) -> RopeScaling:
    scaling = raw.get("rope_scaling") or _rope_parameters(raw)
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type == "default":
        return RopeScaling()
    if rope_type != "llama3":
        raise ModelLoadError(f"unsupported rope scaling {rope_type!r}; supported: default, llama3")
    return RopeScaling(
        rope_type="llama3",
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 8192)),
    )


def _sliding_window(raw: dict, family: str) -> int | None:
    window = raw.get("sliding_window")
    if family in ("qwen2", "qwen3") and not raw.get("use_sliding_window", False):
        return None
    return int(window) if window else None


def _token_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _generation_eos(folder: Path) -> tuple[int, ...]:
    path = folder / "generation_config.json"
    if not path.is_file():
        return ()
    try:
        return _token_ids(json.loads(path.read_text()).get("eos_token_id"))
    except (json.JSONDecodeError, TypeError, ValueError):
        raise ModelLoadError(f"generation_config.json in {folder} is malformed") from None


@dataclass(slots=True)
class EngineConfig:
    """How the engine sizes and schedules its work."""

    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    # CPU: a fixed KV budget in GiB. CUDA: a fraction of free device memory.
    kv_cache_gib: float = 1.0
    gpu_memory_utilization: float = 0.85
    num_blocks: int | None = None  # overrides both budgets (tests force preemption with it)
    max_model_len: int | None = None
    dtype: str | None = None  # default: the model's own dtype
    device: str | None = None  # default: cuda when available
    # Measuring the cost of zero-on-free is the only reason to turn it off; the node never does.
    unsafe_skip_zeroing: bool = False
