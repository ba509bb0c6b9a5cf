"""The built-in tiny model: a deterministic random-weight Llama written as a real Hugging Face folder.

Nothing is downloaded: the tokenizer is a byte-level BPE trained here on a fixed text, and the
weights come from a seeded generator, so the same preset and seed always give the same bytes.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS, EOS, EOT = "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"
HEADER_START, HEADER_END = "<|start_header_id|>", "<|end_header_id|>"
SPECIAL_TOKENS = [BOS, EOS, HEADER_START, HEADER_END, EOT]

# Tools are shown, and calls written, in the Hermes format (Qwen2.5's): one a node reads (enclave.tool_calls),
# so that a fleet of this model serves `tool_choice: "auto"`. (A "\n" right after a block tag is written as
# {{ "\n" }}: templates render with trim_blocks, which drops it.)
_TOOLS_TEMPLATE = (
    "{% if tools %}<|start_header_id|>system<|end_header_id|>\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\n' }}{{ tool | tojson }}{% endfor %}{{ '\n' }}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n"
    "</tool_call><|eot_id|>{% endif %}"
)
_CALLS_TEMPLATE = (
    "{% for call in message.tool_calls or [] %}<tool_call>\n"
    "{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}\n</tool_call>{% endfor %}"
)
CHAT_TEMPLATE = (
    "{{ bos_token }}" + _TOOLS_TEMPLATE + "{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n{{ message['content'] }}" + _CALLS_TEMPLATE
    + "<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

_CORPUS = """\
Veil answers questions without anyone but the person who asked ever seeing the question or the answer.
A request is encrypted on the user's machine to a node whose code, policy and weights were measured and
verified. The gateway forwards it without knowing who sent it, and picks a node at random. The node runs
the model, streams the answer back encrypted, zeroes the memory that held the conversation, and keeps
nothing. The quick brown fox jumps over the lazy dog. Hello, world! How are you today? I am fine, thank
you. Once upon a time there was a small model that knew very little, but it answered every question it
was asked, one token at a time, and forgot each conversation the moment it ended. 0123456789
"""


@dataclass(frozen=True, slots=True)
class TinyPreset:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int | None  # None: exactly the tokenizer's vocabulary, so every id decodes to text
    max_position_embeddings: int


# The trainer stops below this when the fixed text runs out of merges.
TOKENIZER_VOCAB = 1024

PRESETS: dict[str, TinyPreset] = {
    # A few hundred thousand parameters: the demo and the tests.
    "tiny": TinyPreset(64, 172, 2, 4, 2, None, 2048),
    # About 46M parameters: the engine throughput benchmark.
    "bench": TinyPreset(512, 1536, 12, 8, 4, 8192, 2048),
}


def build_tokenizer(vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines() * 4, trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tokenizer


def random_weights(preset: TinyPreset, vocab_size: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    head_dim = preset.hidden_size // preset.num_attention_heads
    kv_width = preset.num_key_value_heads * head_dim

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        # 1/sqrt(fan_in) keeps activations at unit scale, so greedy choices are decisive, not ties.
        return torch.randn(out_features, in_features, generator=generator) / in_features**0.5

    weights = {"model.embed_tokens.weight": torch.randn(vocab_size, preset.hidden_size, generator=generator)}
    for layer in range(preset.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        weights |= {
            prefix + "self_attn.q_proj.weight": linear(preset.hidden_size, preset.hidden_size),
            prefix + "self_attn.k_proj.weight": linear(kv_width, preset.hidden_size),
            prefix + "self_attn.v_proj.weight": linear(kv_width, preset.hidden_size),
            prefix + "self_attn.o_proj.weight": linear(preset.hidden_size, preset.hidden_size),
            prefix + "mlp.gate_proj.weight": linear(preset.intermediate_size, preset.hidden_size),
            prefix + "mlp.up_proj.weight": linear(preset.intermediate_size, preset.hidden_size),
            prefix + "mlp.down_proj.weight": linear(preset.hidden_size, preset.intermediate_size),
            prefix + "input_layernorm.weight": torch.ones(preset.hidden_size),
            prefix + "post_attention_layernorm.weight": torch.ones(preset.hidden_size),
        }
    weights["model.norm.weight"] = torch.ones(preset.hidden_size)
    weights["lm_head.weight"] = linear(vocab_size, preset.hidden_size)
    return weights


def write_tiny_model(folder: str | Path, preset: str = "tiny", seed: int = 0) -> Path:
    """Writes config.json, model.safetensors, tokenizer.json and tokenizer_config.json into `folder`."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    spec = PRESETS[preset]
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(TOKENIZER_VOCAB)
    tokenizer.save(str(folder / "tokenizer.json"))
    vocab_size = spec.vocab_size or tokenizer.get_vocab_size()
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    _write_json(folder / "config.json", _config(spec, vocab_size, ids))
    _write_json(folder / "generation_config.json", {"bos_token_id": ids[BOS], "eos_token_id": [ids[EOS], ids[EOT]]})
    _write_json(
        folder / "tokenizer_config.json",
        {"bos_token": BOS, "eos_token": EOT, "chat_template": CHAT_TEMPLATE, "model_max_length": spec.max_position_embeddings},
    )
    save_file(random_weights(spec, vocab_size, seed), str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def _config(spec: TinyPreset, vocab_size: int, ids: dict[str, int]) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **asdict(spec),
        "vocab_size": vocab_size,
        "head_dim": spec.hidden_size // spec.num_attention_heads,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": ids[BOS],
        "eos_token_id": [ids[EOS], ids[EOT]],
    }


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")
