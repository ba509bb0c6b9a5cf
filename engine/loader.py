"""Loading a Hugging Face model folder: config.json and (sharded) safetensors, read straight into memory.

The checkpoint keeps every projection apart; the model stacks q/k/v and gate/up into one matrix each
(`MergedLinear`), so after the names and shapes are checked against the checkpoint's own layout, the parts
are concatenated as they are assigned.

Weights are read into host memory, cast there, and cross to the device through the bridge in large
pinned chunks (`Bridge.load`): a few crossings for gigabytes, where one per tensor would pay the
confidential bridge's toll hundreds of times.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

import kernels
from engine.bridge import Bridge
from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.host_weights import place_in_huge_pages
from engine.models import LlamaFamilyForCausalLM
from engine.models.layers import MergedLinear, prepack_linears


_ROTARY = "\0rotary."  # the rotary tables cross with the weights, under names no checkpoint can hold


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


def load_model(folder: str | Path, dtype: torch.dtype | None, device: torch.device,
               bridge: Bridge | None = None) -> LlamaFamilyForCausalLM:
    folder = Path(folder)
    config = ModelConfig.from_folder(folder)
    dtype = dtype or config.torch_dtype
    with torch.device("meta"):
        model = LlamaFamilyForCausalLM(config)
    state = _read_state(folder)
    _check_names(model, state)
    _merge_projections(model, state)
    rotary = type(model.rotary)(config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling)
    state |= {f"{_ROTARY}{name}": buffer for name, buffer in rotary.named_buffers()}  # computed on the host, as before
    # Cast on the host (as `model.to` cast before), so what crosses is what the device keeps.
    state = {name: tensor.to(dtype) if tensor.is_floating_point() else tensor for name, tensor in state.items()}
    state = (bridge or Bridge(device)).load(iter(state.items()))
    for name, _ in list(rotary.named_buffers()):
        setattr(rotary, name, state.pop(f"{_ROTARY}{name}"))
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.rotary = rotary
    model = model.to(dtype=dtype).eval()
    if device.type == "cpu":
        place_in_huge_pages(model)  # a decode step streams every weight: fewer TLB misses (`engine.host_weights`)
    prepack_linears(model)  # bf16 on a CPU: its products over prepacked weights (`kernels.cpu_linear`)
    if dtype in (torch.bfloat16, torch.float32):  # the compiled decode (bf16) and attention (both)
        kernels.runs_native_decode(device)  # compiled now (about a second, once), not inside a first request
    return model


def _read_state(folder: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for path in weight_files(folder):
        if not path.is_file():
            raise ModelLoadError(f"weight shard {path.name} listed in the index is missing from {folder}")
        try:
            state.update(load_file(str(path)))  # host memory: the bridge moves it in chunks
        except (SafetensorError, OSError) as error:
            raise ModelLoadError(f"cannot read weights from {path.name}: {type(error).__name__}") from None
    return state


def checkpoint_layout(model: LlamaFamilyForCausalLM) -> dict[str, tuple[int, ...]]:
    """Every parameter the checkpoint must hold, by its Hugging Face name, with its shape."""
    layout: dict[str, tuple[int, ...]] = {}
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            if isinstance(module, MergedLinear):
                layout |= module.checkpoint_shapes(module_name, param_name)
            else:
                layout[f"{module_name}.{param_name}" if module_name else param_name] = tuple(param.shape)
    if model.config.tie_word_embeddings:
        layout.pop("lm_head.weight", None)
    return layout


def _check_names(model: LlamaFamilyForCausalLM, state: dict[str, torch.Tensor]) -> None:
    expected = checkpoint_layout(model)
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    given = {name for name in state if not name.endswith("rotary_emb.inv_freq")}
    missing, unexpected = sorted(expected.keys() - given), sorted(given - expected.keys())
    if missing or unexpected:
        raise ModelLoadError(
            f"weights do not match the {model.config.architecture} layout: "
            f"{len(missing)} missing (e.g. {missing[:3]}), {len(unexpected)} unexpected (e.g. {unexpected[:3]})"
        )
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise ModelLoadError(f"weight {name} has shape {tuple(state[name].shape)}, config implies {shape}")


def _merge_projections(model: LlamaFamilyForCausalLM, state: dict[str, torch.Tensor]) -> None:
    """Replaces each merged module's parts in `state` with their concatenation, one module at a time."""
    for module_name, module in model.named_modules():
        if not isinstance(module, MergedLinear):
            continue
        for param_name, _ in module.named_parameters(recurse=False):
            parts = [state.pop(name) for name in module.checkpoint_shapes(module_name, param_name)]
            state[f"{module_name}.{param_name}"] = torch.cat(parts)
