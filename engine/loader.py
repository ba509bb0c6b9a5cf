"""Loading a Hugging Face model folder: config.json and (sharded) safetensors, read straight into memory."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.models import LlamaFamilyForCausalLM


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a model folder, in index order when the checkpoint is sharded."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ModelLoadError(f"{index.name} in {folder} is malformed") from None
        return [folder / name for name in dict.fromkeys(weight_map.values())]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in model folder {folder}")
    return files


def load_model(folder: str | Path, dtype: torch.dtype | None, device: torch.device) -> LlamaFamilyForCausalLM:
    folder = Path(folder)
    config = ModelConfig.from_folder(folder)
    dtype = dtype or config.torch_dtype
    with torch.device("meta"):
        model = LlamaFamilyForCausalLM(config)
    state = _read_state(folder, device)
    _check_names(model, state)
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.rotary = type(model.rotary)(
        config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
    )
    return model.to(device=device, dtype=dtype).eval()


def _read_state(folder: Path, device: torch.device) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for path in weight_files(folder):
        if not path.is_file():
            raise ModelLoadError(f"weight shard {path.name} listed in the index is missing from {folder}")
        try:
            state.update(load_file(str(path), device=str(device)))
        except (SafetensorError, OSError) as error:
            raise ModelLoadError(f"cannot read weights from {path.name}: {type(error).__name__}") from None
    return state


def _check_names(model: LlamaFamilyForCausalLM, state: dict[str, torch.Tensor]) -> None:
    expected = {name for name, _ in model.named_parameters()}
    if model.config.tie_word_embeddings:
        expected.discard("lm_head.weight")
        state.pop("lm_head.weight", None)
    given = {name for name in state if not name.endswith("rotary_emb.inv_freq")}
    missing, unexpected = sorted(expected - given), sorted(given - expected)
    if missing or unexpected:
        raise ModelLoadError(
            f"weights do not match the {model.config.architecture} layout: "
            f"{len(missing)} missing (e.g. {missing[:3]}), {len(unexpected)} unexpected (e.g. {unexpected[:3]})"
        )
    for name, param in model.named_parameters():
        if name in state and tuple(state[name].shape) != tuple(param.shape):
            raise ModelLoadError(
                f"weight {name} has shape {tuple(state[name].shape)}, config implies {tuple(param.shape)}"
            )
