"""q/k/v and gate/up load as one stacked matrix each, built from the checkpoint's separate tensors.

Parity with `transformers` (tests/test_engine_parity.py) proves the stacked model computes the same
thing; these tests pin down the layout itself and the loader's checks against the checkpoint's names.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.errors import ModelLoadError
from engine.loader import checkpoint_layout, load_model
from engine.models.layers import MergedLinear
from tests.engine_models import one_torch_thread, reference_model  # noqa: F401 (fixture)

CPU = torch.device("cpu")


def _checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


@pytest.mark.parametrize("name", ["llama-biases", "qwen2", "qwen3"])
def test_stacked_projections_hold_the_checkpoint_parts_in_order(name: str) -> None:
    folder = reference_model(name).folder
    weights = _checkpoint(folder)
    model = load_model(folder, None, CPU)
    for index, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{index}."
        for merged, parts in ((layer.self_attn.qkv_proj, ("q_proj", "k_proj", "v_proj")),
                              (layer.mlp.gate_up_proj, ("gate_proj", "up_proj"))):
            owner = "self_attn." if parts[0] == "q_proj" else "mlp."
            for kind in ("weight", "bias"):
                names = [f"{prefix}{owner}{part}.{kind}" for part in parts]
                if names[0] not in weights:
                    assert getattr(merged, kind) is None
                    continue
                assert torch.equal(getattr(merged, kind), torch.cat([weights[n] for n in names]))
    assert not any(name.endswith(("q_proj.weight", "gate_proj.weight")) for name, _ in model.named_parameters())


def test_the_checkpoint_layout_names_each_part_with_its_own_shape() -> None:
    model = load_model(reference_model("qwen3").folder, None, CPU)
    layout = checkpoint_layout(model)
    config = model.config
    assert layout["model.layers.0.self_attn.q_proj.weight"] == (config.num_attention_heads * config.head_dim,
                                                               config.hidden_size)
    assert layout["model.layers.0.self_attn.k_proj.weight"] == (config.num_key_value_heads * config.head_dim,
                                                               config.hidden_size)
    assert layout["model.layers.0.mlp.up_proj.weight"] == (config.intermediate_size, config.hidden_size)
    assert "model.layers.0.self_attn.qkv_proj.weight" not in layout
    assert sum(torch.Size(shape).numel() for shape in layout.values()) == sum(p.numel() for p in model.parameters())
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, MergedLinear)


def test_a_part_of_the_wrong_shape_is_refused_by_its_checkpoint_name(tmp_path: Path) -> None:
    source = reference_model("llama").folder
    weights = _checkpoint(source)
    name = "model.layers.1.self_attn.v_proj.weight"
    weights[name] = weights[name][:-1].clone()  # one output row short: the stacked total would still be wrong
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_bytes((source / "config.json").read_bytes())
    with pytest.raises(ModelLoadError, match=name.replace(".", r"\.")):
        load_model(tmp_path, None, CPU)
