"""Products over prepacked weights (`kernels.cpu_linear`): the same values as `F.linear`, bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import EngineConfig, LLMEngine
from engine.models.layers import Linear
from kernels import cpu_linear
from tests.engine_models import one_torch_thread, prefill_logits, random_prompts, tiny_model_dir  # noqa: F401


@pytest.mark.parametrize("rows", [0, 1, 3, 17])
@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_product_equals_f_linear_bit_for_bit(rows: int, bias: bool) -> None:
    generator = torch.Generator().manual_seed(rows)
    layer = Linear(96, 160, bias=bias).to(torch.bfloat16)
    hidden = torch.randn(rows, 96, generator=generator).to(torch.bfloat16)
    expected = F.linear(hidden, layer.weight, layer.bias)
    layer.prepack()
    assert (layer.packed is not None) == cpu_linear.can_pack(layer.weight)  # packed wherever this CPU can
    with torch.inference_mode():
        assert torch.equal(layer(hidden), expected)


def test_float32_weights_are_never_packed() -> None:
    # fp32 packed products sum in another order than F.linear: exactness with transformers would be lost.
    layer = Linear(8, 8)
    layer.prepack()
    assert layer.packed is None


def test_a_bf16_engine_on_a_cpu_gives_the_same_logits_packed_or_not() -> None:
    engine = LLMEngine(tiny_model_dir(), EngineConfig(num_blocks=64, block_size=4, dtype="bfloat16"))
    layers = [module for module in engine.runner.model.modules() if isinstance(module, Linear)]
    assert all((layer.packed is not None) == cpu_linear.can_pack(layer.weight) for layer in layers)
    prompts = random_prompts(3, 4, 20, seed=9)
    packed = prefill_logits(engine, prompts)
    for layer in layers:
        layer.packed = None
    for with_packing, without in zip(packed, prefill_logits(engine, prompts)):
        assert torch.equal(with_packing, without)
    assert engine.residue_check() == []
