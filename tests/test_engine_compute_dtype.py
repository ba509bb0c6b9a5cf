"""The engine's dtype: the model's own where the device computes it natively, else float32; explicit is honoured.

bf16 parity with `transformers` in bf16: prefill logits within bf16's rounding, and the greedy token at
every position where the reference's top two logits stand further apart than that rounding (where it is
guaranteed).
Later tokens may diverge at a near-tie, as rounding in a different order breaks it the other way.
"""

from __future__ import annotations

import pytest
import torch

import engine.compute_dtype as compute_dtype
from engine import EngineConfig, EngineError, LLMEngine
from engine.compute_dtype import choose_dtype
from tests.engine_models import (  # noqa: F401 (fixtures)
    build_hf_model,
    greedy,
    hf_greedy,
    hf_logits,
    one_torch_thread,
    output_tokens,
    prefill_logits,
    random_prompts,
    save_with_tokenizer,
)

CPU = torch.device("cpu")
WITH_BF16 = frozenset({torch.float32, torch.bfloat16})
FP32_ONLY = frozenset({torch.float32})
# Both sides round every layer's outputs to bf16 (8 bits of mantissa), in different orders: logits of
# magnitude up to ~8 differ by a few of bf16's ulps at that size (1/32 each). The most seen on the Llama,
# Qwen2 and Qwen3 reference models (12 prompts each) is 0.09, so this leaves a margin.
BF16_LOGIT_ATOL = 0.25


def test_the_models_own_dtype_is_kept_where_the_cpu_computes_it_natively() -> None:
    choice = choose_dtype(None, torch.bfloat16, CPU, native=WITH_BF16)
    assert choice.dtype == torch.bfloat16 and "natively" in choice.reason


def test_a_bf16_model_is_widened_to_fp32_on_a_cpu_without_bf16() -> None:
    choice = choose_dtype(None, torch.bfloat16, CPU, native=FP32_ONLY)
    assert choice.dtype == torch.float32 and choice.widened
    assert choice.reason == "the model's bfloat16 widened: this cpu has no native bfloat16 arithmetic"


def test_fp32_models_stay_fp32_and_an_explicit_dtype_is_honoured() -> None:
    assert choose_dtype(None, torch.float32, CPU, native=WITH_BF16).dtype == torch.float32
    assert not choose_dtype(None, torch.float32, CPU, native=WITH_BF16).widened
    assert choose_dtype("bf16", torch.float32, CPU, native=FP32_ONLY).dtype == torch.bfloat16
    assert choose_dtype("float32", torch.bfloat16, CPU, native=WITH_BF16).dtype == torch.float32


def test_a_dtype_the_gpu_cannot_compute_is_refused_by_name() -> None:
    with pytest.raises(EngineError, match="'bfloat16' is not supported by this GPU"):
        choose_dtype("bfloat16", torch.float32, torch.device("cuda"), native=FP32_ONLY | {torch.float16})
    with pytest.raises(EngineError, match="unsupported dtype 'fp8'"):
        choose_dtype("fp8", torch.float32, CPU, native=WITH_BF16)


@pytest.fixture(scope="module")
def bf16_llama(tmp_path_factory):
    """A bf16 checkpoint's folder, and `transformers` loading it in bf16 (as a user would: its rotary
    frequencies computed in fp32, not rounded to bf16 as `model.to(torch.bfloat16)` would round them)."""
    folder = save_with_tokenizer(build_hf_model("llama", torch.bfloat16), tmp_path_factory.mktemp("bf16") / "llama")
    return hf_loaded(folder, torch.bfloat16), folder


def hf_loaded(folder, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(folder, dtype=dtype).eval()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(6, 3, 30, seed=5)


def _cpu_natively_computes(monkeypatch, native: frozenset[torch.dtype]) -> None:
    monkeypatch.setattr(compute_dtype, "native_dtypes", lambda device: native)


def test_a_bf16_checkpoint_on_a_cpu_without_bf16_runs_in_fp32_exactly_as_transformers_widened(
        monkeypatch, bf16_llama, prompts) -> None:
    _, folder = bf16_llama
    _cpu_natively_computes(monkeypatch, FP32_ONLY)
    engine = LLMEngine(folder, EngineConfig(num_blocks=64, block_size=4))
    assert engine.runner.dtype == engine.runner.kv_cache.dtype == torch.float32
    widened = hf_loaded(folder, torch.float32)  # bf16 -> fp32 is exact: the same weights
    assert output_tokens(engine, prompts, greedy(8)) == [hf_greedy(widened, p, 8) for p in prompts]
    assert engine.residue_check() == []


def test_bf16_on_a_bf16_cpu_matches_transformers_in_bf16(monkeypatch, bf16_llama, prompts) -> None:
    model, folder = bf16_llama
    _cpu_natively_computes(monkeypatch, WITH_BF16)
    engine = LLMEngine(folder, EngineConfig(num_blocks=64, block_size=4))
    assert engine.runner.dtype == engine.runner.kv_cache.dtype == torch.bfloat16
    decisive = 0
    for prompt, logits in zip(prompts, prefill_logits(engine, prompts)):
        expected = hf_logits(model, prompt)
        torch.testing.assert_close(logits, expected, atol=BF16_LOGIT_ATOL, rtol=0)
        # Where the top two stand apart by more than the tolerance twice, no rounding within it can flip the
        # greedy token: at every such position (the last one's is the first output token) they agree.
        top_two = expected.topk(2, dim=-1).values
        clear = top_two[:, 0] - top_two[:, 1] > 2 * BF16_LOGIT_ATOL
        assert torch.equal(logits.argmax(-1)[clear], expected.argmax(-1)[clear])
        decisive += int(clear.sum())
    assert decisive >= 10
    assert engine.residue_check() == []
