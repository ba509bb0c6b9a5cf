"""Model configs: what the decoder does not compute is refused by name; what it reads, it reads as `transformers` does.

Each case starts from a config.json written by `transformers` itself (a reference model's folder) and
changes one field, so nothing but that field can explain the outcome.
"""

from __future__ import annotations

import json

import pytest

from engine import ModelLoadError
from engine.config import ModelConfig
from tests.engine_models import one_torch_thread, reference_model  # noqa: F401 (fixture)

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def saved_config(name: str, **changes) -> dict:
    """The config.json `transformers` saved for reference model `name`, with `changes` applied (None deletes)."""
    raw = json.loads((reference_model(name).folder / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    return raw


def refusal(raw: dict) -> str:
    with pytest.raises(ModelLoadError) as raised:
        ModelConfig.from_dict(raw)
    return str(raised.value)


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "rope_theta": 10000.0}
LLAMA3_WITHOUT_LOW = {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64, "rope_theta": 500000.0}

REFUSED = {
    "gelu_pytorch_tanh": ("llama", {"hidden_act": "gelu_pytorch_tanh"}, "gelu_pytorch_tanh"),
    "relu": ("llama", {"hidden_act": "relu"}, "relu"),
    "mistral gelu": ("mistral", {"hidden_act": "gelu"}, "gelu"),
    "qwen2 gelu_new": ("qwen2", {"hidden_act": "gelu_new"}, "gelu_new"),
    "qwen3 relu2": ("qwen3", {"hidden_act": "relu2"}, "relu2"),
    "yarn": ("qwen2", {"rope_parameters": YARN}, "yarn"),
    "legacy linear": ("llama", {"rope_scaling": {"type": "linear", "factor": 2.0}}, "linear"),
    "dynamic": ("mistral", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
    "llama3 without a factor": ("llama", {"rope_parameters": LLAMA3_WITHOUT_LOW}, "low_freq_factor"),
    "partial rotary": ("llama", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    "partial rotary in rope": ("qwen3", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                             "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
    "quantized": ("llama", {"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quantization_config"),
    "tie as text": ("qwen2", {"tie_word_embeddings": "false"}, "tie_word_embeddings"),
    "attention_bias as text": ("llama", {"attention_bias": "yes"}, "attention_bias"),
    "mlp_bias as number": ("llama", {"mlp_bias": 1}, "mlp_bias"),
    "unknown layer type": ("qwen3", {"layer_types": ["full_attention", "chunked_attention"]}, "chunked_attention"),
    "use_sliding_window as text": ("qwen2", {"use_sliding_window": "true"}, "use_sliding_window"),
    "negative window": ("mistral", {"sliding_window": -5}, "sliding_window"),
    "window as text": ("mistral", {"sliding_window": "4096"}, "sliding_window"),
}


@pytest.mark.parametrize(("name", "changes", "named"), REFUSED.values(), ids=REFUSED.keys())
def test_what_the_decoder_does_not_compute_is_refused_by_name(name, changes, named):
    assert named in refusal(saved_config(name, **changes))


@pytest.mark.parametrize("name", FAMILIES)
def test_saved_configs_of_every_family_load(name):
    config = ModelConfig.from_dict(saved_config(name))
    assert config.family == name
    assert config.sliding_window is None


@pytest.mark.parametrize("activation", ["silu", "swish"])
def test_both_names_of_silu_load(activation):
    assert ModelConfig.from_dict(saved_config("llama", hidden_act=activation)).family == "llama"


# ----- read as transformers reads them ------------------------------------------------------

BIAS_CASES = {
    "llama attention and mlp": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "llama none": ("llama", {}),
    "mistral ignores both": ("mistral", {"attention_bias": True, "mlp_bias": True}),
    "qwen2 always q/k/v": ("qwen2", {"attention_bias": False, "mlp_bias": True}),
    "qwen3 attention, not mlp": ("qwen3", {"attention_bias": True, "mlp_bias": True}),
}


def hf_biases(name: str, changes: dict) -> tuple[bool, bool, bool]:
    """Which projections of a `transformers` model built from this config carry a bias."""
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = saved_config(name, **changes)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(raw.pop("model_type"), **raw))
    layer = model.model.layers[0]
    return (layer.self_attn.q_proj.bias is not None, layer.self_attn.o_proj.bias is not None,
            layer.mlp.gate_proj.bias is not None)


@pytest.mark.parametrize(("name", "changes"), BIAS_CASES.values(), ids=BIAS_CASES.keys())
def test_biases_are_those_transformers_builds(name, changes):
    config = ModelConfig.from_dict(saved_config(name, **changes))
    assert (config.attention_bias, config.output_bias, config.mlp_bias) == hf_biases(name, changes)


def test_mistral_without_a_window_key_gets_the_transformers_default():
    from transformers import MistralConfig

    raw = saved_config("mistral", sliding_window=None)
    expected = MistralConfig(**{k: v for k, v in raw.items() if k != "architectures"}).sliding_window
    assert expected == 4096
    assert ModelConfig.from_dict(raw).sliding_window == expected
    assert ModelConfig.from_dict(raw).max_context == min(raw["max_position_embeddings"], expected)


def test_llama_ignores_a_sliding_window_as_transformers_does():
    config = ModelConfig.from_dict(saved_config("llama", sliding_window=16))
    assert config.sliding_window is None
    assert config.max_context == config.max_position_embeddings


@pytest.mark.parametrize(("max_window_layers", "slides"), [(1, True), (2, False)])
def test_qwen_windows_only_when_some_layer_slides(max_window_layers, slides):
    """Two layers: transformers gives layers from max_window_layers on the window."""
    from transformers import Qwen2Config

    raw = saved_config("qwen2", use_sliding_window=True, sliding_window=64, max_window_layers=max_window_layers,
                       layer_types=None)
    hf = Qwen2Config(**{k: v for k, v in raw.items() if k != "architectures"})
    assert ("sliding_attention" in hf.layer_types) == slides
    assert ModelConfig.from_dict(raw).sliding_window == (64 if slides else None)
    with_types = dict(raw, layer_types=hf.layer_types)
    assert ModelConfig.from_dict(with_types).sliding_window == (64 if slides else None)
