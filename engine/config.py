"""Model and engine configuration."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.errors import EngineError, ModelLoadError
from engine.sampling_draw import DRAWS, INVERSE, RACE
from engine.sampling_params import is_integer

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


# transformers' names for SiLU; the decoder implements no other activation.
_SILU_NAMES = ("silu", "swish")
_LAYER_TYPES = ("full_attention", "sliding_attention")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# transformers' defaults where a config leaves the window out.
_DEFAULT_WINDOW = 4096
_DEFAULT_MAX_WINDOW_LAYERS = 28


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
    attention_bias: bool  # q, k and v projections
    output_bias: bool  # the attention output projection
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    torch_dtype: torch.dtype
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    sliding_window: int | None = None

    @classmethod
    def from_dict(cls, raw: dict) -> ModelConfig:
        """Reads a config the decoder computes exactly as `transformers` does; refuses any other by name."""
        architecture = _architecture(raw)
        family = SUPPORTED_ARCHITECTURES[architecture]
        _check_computation(raw)
        qkv_bias, output_bias, mlp_bias = _biases(raw, family)
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
            attention_bias=qkv_bias,
            output_bias=output_bias,
            mlp_bias=mlp_bias,
            qk_norm=family == "qwen3",
            tie_word_embeddings=_flag(raw, "tie_word_embeddings", False),
            torch_dtype=parse_dtype(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            eos_token_ids=_token_ids(raw.get("eos_token_id")),
            bos_token_id=raw.get("bos_token_id"),
            sliding_window=_sliding_window(raw, family, int(raw["num_hidden_layers"])),
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
        """Longest sequence served. The engine has no windowed attention, so the sliding window caps it:
        up to the window, windowed and full attention see the same tokens."""
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
    if scaling.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ModelLoadError("unsupported partial_rotary_factor; this engine rotates the whole head (1.0)")
    if rope_type == "default":
        return RopeScaling()
    if rope_type != "llama3":
        raise ModelLoadError(f"unsupported rope scaling {rope_type!r}; supported: default, llama3")
    missing = [key for key in _LLAMA3_KEYS if key not in scaling]
    if missing:
        raise ModelLoadError(f"llama3 rope scaling lacks {', '.join(missing)}; every one of {', '.join(_LLAMA3_KEYS)} is needed")
    return RopeScaling(
        rope_type="llama3",
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
    )


def _check_computation(raw: dict) -> None:
    """Refuses settings that change what the decoder computes and that it does not implement."""
    activation = raw.get("hidden_act", "silu")
    if activation not in _SILU_NAMES:
        raise ModelLoadError(f"unsupported hidden_act {activation!r}; this engine implements silu only")
    if raw.get("quantization_config"):
        raise ModelLoadError("quantized checkpoints (quantization_config) are not supported; use unquantized weights")


def _biases(raw: dict, family: str) -> tuple[bool, bool, bool]:
    """(q/k/v, attention output, MLP) biases, as `transformers` builds each family."""
    if family == "qwen2":
        return True, False, False  # always on q, k and v; attention_bias is not read
    if family == "mistral":
        return False, False, False  # transformers reads neither attention_bias nor mlp_bias here
    attention = _flag(raw, "attention_bias", False)
    mlp = _flag(raw, "mlp_bias", False) if family == "llama" else False
    return attention, attention, mlp


def _flag(raw: dict, name: str, default: bool) -> bool:
    value = raw.get(name, default)
    if not isinstance(value, bool):
        raise ModelLoadError(f"config.json field {name} must be true or false")
    return value


def _sliding_window(raw: dict, family: str, num_layers: int) -> int | None:
    """The attention window if any layer has one; Llama has none (transformers ignores the field)."""
    if family == "llama":
        return None
    if family in ("qwen2", "qwen3") and not _slides(raw, num_layers):
        return None
    window = raw.get("sliding_window", _DEFAULT_WINDOW)
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ModelLoadError("config.json field sliding_window must be a positive integer or null")
    return window


def _slides(raw: dict, num_layers: int) -> bool:
    """Whether any Qwen layer uses windowed attention, read the way transformers reads it."""
    layer_types = raw.get("layer_types")
    if layer_types is not None:
        unknown = sorted({str(t) for t in layer_types} - set(_LAYER_TYPES))
        if unknown:
            raise ModelLoadError(f"unsupported layer_types {', '.join(unknown)}; supported: {', '.join(_LAYER_TYPES)}")
    if not _flag(raw, "use_sliding_window", False):
        return False
    if layer_types is None:
        first = raw.get("max_window_layers", _DEFAULT_MAX_WINDOW_LAYERS)
        return first < num_layers
    return "sliding_attention" in layer_types


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
    # CPU: a fixed KV budget in GiB. CUDA: a fraction of the device memory free once the weights are
    # loaded, which the KV pool and the decode graphs' memory share.
    kv_cache_gib: float = 1.0
    gpu_memory_utilization: float = 0.85
    num_blocks: int | None = None  # overrides both budgets (tests force preemption with it)
    max_model_len: int | None = None
    dtype: str | None = None  # default: the model's own dtype
    device: str | None = None  # default: cuda when available
    # Measuring the cost of zero-on-free is the only reason to turn it off; the node never does.
    unsafe_skip_zeroing: bool = False
    # Decode steps replay captured CUDA graphs. None: on where the device is CUDA and the kernels are
    # Triton's, off elsewhere (graphs never run on a CPU); False: every step runs eagerly.
    cuda_graphs: bool | None = None
    # Step N+1 is launched before step N's tokens are read back (`engine.overlap`). None: on where the
    # device is CUDA; True on a CPU runs the same order, which changes no token (the tests rely on it).
    async_scheduling: bool | None = None
    # Simulated confidential-computing bridge: every host<->device crossing waits this long, one at a
    # time across threads (`engine.bridge`). For benchmarks and tests; 0 on a real node.
    bridge_toll_us: float = 0.0
    # Speculative decoding (`engine.speculative`): "ngram" drafts from each request's own tokens,
    # "draft:DIR" from the model in DIR (`engine.draft_model`); None: one token per sample per step.
    # Speculative steps run synchronously (async scheduling off).
    speculative: str | None = None
    num_speculative_tokens: int = 3  # drafts per sample per step, at most
    # How samples draw (`engine.sampling_draw`): "inverse" (inverse transform, one uniform per row: the
    # cheapest) or "race" (exponential race, a noise per token: the coupling that makes a draft model's
    # sampled drafts agree with the target's draws). None: "race" with a draft model, else "inverse".
    # Seeded tokens are reproducible under one kind; the two kinds draw different tokens.
    sampling_draw: str | None = None
    # Whether `LLMEngine` makes text (`engine.output_processor`): False for an engine core, whose loop
    # runs token steps only (`LLMEngine.step_tokens`) while its client makes the text.
    detokenize: bool = True

    def __post_init__(self) -> None:
        self._check_sizes()
        self._check_speculation()
        # A string such as "false" would be truthy: only the three documented values are accepted.
        for name in ("cuda_graphs", "async_scheduling"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise EngineError(f"{name} must be true, false or unset (null: on where the device is CUDA)")
        if not isinstance(self.detokenize, bool):
            raise EngineError("detokenize must be true or false")

    def _check_sizes(self) -> None:
        """Refuses sizes of zero or below by name: a zero batch or step budget admits requests that never
        run, a zero block size divides by zero, and None, not 0, is how a size is left unset."""
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if not _is_count(getattr(self, name)):
                raise EngineError(f"{name} must be an integer >= 1")
        for name, unset in (("max_model_len", "the model's own context"), ("num_blocks", "sized from the memory budget")):
            value = getattr(self, name)
            if value is not None and not _is_count(value):
                raise EngineError(f"{name} must be an integer >= 1, or unset (null: {unset})")


    def _check_speculation(self) -> None:
        draft = draft_speculation(self.speculative)
        if self.speculative not in (None, "ngram") and not (draft and len(self.speculative) > len("draft:")):
            raise EngineError("speculative must be \"ngram\", \"draft:DIR\" (a draft model's folder) or unset "
                              "(null: no speculation)")
        if not _is_count(self.num_speculative_tokens):
            raise EngineError("num_speculative_tokens must be an integer >= 1")
        if self.sampling_draw is not None and self.sampling_draw not in DRAWS:
            raise EngineError(f"sampling_draw must be one of {', '.join(map(repr, DRAWS))} or unset "
                              "(null: \"race\" with a draft model, else \"inverse\")")

    @property
    def draw_kind(self) -> str:
        """How samples draw: `sampling_draw`, or its default for this engine's speculation."""
        if self.sampling_draw is not None:
            return self.sampling_draw
        return RACE if draft_speculation(self.speculative) else INVERSE


def draft_speculation(speculative: object) -> bool:
    """Whether `EngineConfig.speculative` names a draft model ("draft:DIR")."""
    return isinstance(speculative, str) and speculative.startswith("draft:")


def _is_count(value: object) -> bool:
    return is_integer(value) and value >= 1
