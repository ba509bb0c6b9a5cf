"""A CPU model's weights are moved into one mapping advised for huge pages (`engine.host_weights`), unchanged."""

from __future__ import annotations

import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.host_weights import HUGE_PAGE_BYTES, place_in_huge_pages
from tests.engine_models import build_hf_model, reference_model


def test_every_weight_moves_into_one_mapping_unchanged_and_tied_weights_stay_tied() -> None:
    model = build_hf_model("qwen2")  # its output head is its embedding table
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    moved = place_in_huge_pages(model)
    params = list(model.parameters())
    assert moved >= sum(p.numel() * p.element_size() for p in params)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]), name
    starts = sorted(p.data_ptr() for p in params)
    assert starts[0] % HUGE_PAGE_BYTES == 0  # the mapping's first huge page holds the first weight
    assert starts[-1] - starts[0] < moved  # all inside the one mapping
    assert len({p.untyped_storage().data_ptr() for p in params}) == 1


def test_a_loaded_cpu_model_lives_in_the_mapping_and_still_computes_as_transformers() -> None:
    reference = reference_model("llama")
    engine = LLMEngine(reference.folder, EngineConfig(num_blocks=32, block_size=4, device="cpu"))
    params = list(engine.runner.model.parameters())
    assert len({p.untyped_storage().data_ptr() for p in params}) == 1
    prompt = [5, 9, 23, 7, 11]
    with torch.no_grad():
        expected = reference.model(torch.tensor([prompt])).logits[0, -1].argmax().item()
    out = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    assert out[0].outputs[0].token_ids == [expected]
