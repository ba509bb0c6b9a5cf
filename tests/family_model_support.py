"""Random-weight models in an instruct family's shapes, with that family's real tokenizer and template.

A family's own vocabulary (Qwen's 151,936 ids, Mistral's 32,768, Llama 3's 128,256) with one tiny layer:
the engine runs it on the CPU, and everything that reads text (detokenizer, tool-call and reasoning
parsers, grammars) meets the real tokens (`<tool_call>`, `[TOOL_CALLS]`, `<|python_tag|>`). The weights
mean nothing, so a test makes the model write what it needs with a constraint (`guided_regex`).
"""

from __future__ import annotations

import atexit
import functools
import json
import shutil
import tempfile
from pathlib import Path

import torch

from tests.engine_models import _hf_classes, _randomize_defaults
from tests.family_support import family_folder

# Our shapes for the family's architecture: one layer, narrow, the family's vocabulary.
_SHAPES = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
               num_key_value_heads=1, max_position_embeddings=4096, initializer_range=0.2)


@functools.cache
def random_family_model(family: str) -> Path:
    """A folder with the family's tokenizer files and a random one-layer model of its architecture."""
    source = family_folder(family)
    config = json.loads((source / "config.json").read_text())
    model_class, config_class, extra = _hf_classes(config["model_type"])  # llama, mistral, qwen2, qwen3
    if "head_dim" in extra:  # Qwen3's head size is its own setting
        extra = extra | {"head_dim": 16}
    torch.manual_seed(0)
    hf_config = config_class(vocab_size=config["vocab_size"], **_SHAPES, **extra,
                             bos_token_id=config.get("bos_token_id"), eos_token_id=config.get("eos_token_id"))
    model = model_class(hf_config).eval()
    _randomize_defaults(model)
    folder = _root() / family
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, folder / name)
    return folder


@functools.cache
def _root() -> Path:
    root = Path(tempfile.mkdtemp(prefix="veil-family-models-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root
