"""The decoder with every kernel on the Triton path matches `transformers`, as the reference path does.

On a CPU the kernels run in the Triton interpreter, so a few short prompts only; on a CUDA machine the same
test runs the compiled kernels. Same fp32 tolerance as tests/test_engine_parity.py.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before the lazily imported Triton modules load

import pytest  # noqa: E402

import kernels  # noqa: E402
from engine import EngineConfig, LLMEngine  # noqa: E402
from tests.engine_models import hf_logits, one_torch_thread, prefill_logits, random_prompts, reference_model  # noqa: E402,F401
from tests.test_engine_parity import LOGIT_ATOL, LOGIT_RTOL  # noqa: E402


@pytest.mark.parametrize("name", ["qwen3", "llama-biases", "llama3-rope"])
def test_triton_kernels_give_transformers_prefill_logits(name: str) -> None:
    """Qwen3's q/k norms run on strided heads, the biased Llama on every bias, Llama 3 on scaled rope caches."""
    reference = reference_model(name)
    engine = LLMEngine(reference.folder, EngineConfig(num_blocks=32, block_size=4))
    prompts = random_prompts(2, 5, 11, seed=31)
    with kernels.force("triton"):
        produced = prefill_logits(engine, prompts, chunk=4)
    for prompt, logits in zip(prompts, produced):
        torch.testing.assert_close(logits, hf_logits(reference.model, prompt), atol=LOGIT_ATOL, rtol=LOGIT_RTOL)
    assert engine.residue_check() == []
