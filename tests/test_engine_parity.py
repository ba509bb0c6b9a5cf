"""Parity with Hugging Face `transformers` on the same random weights.

Greedy tokens must be identical to `transformers.generate` for a batch run with continuous batching,
chunked prefill and forced preemption; prefill logits must match within fp32 tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import engine.compute_dtype as compute_dtype
from engine import EngineConfig, LLMEngine
from tests.engine_models import (  # noqa: F401 (fixtures)
    one_torch_thread,
    MORE_REFERENCE_NAMES,
    REFERENCE_NAMES,
    reference_model,
    build_hf_model,
    greedy,
    hf_greedy,
    hf_logits,
    output_tokens,
    prefill_logits,
    random_lengths,
    random_prompts,
    reference_models,
    save_with_tokenizer,
)

# fp32 tolerance. Both sides sum the same products in different orders: on these models (logits up to
# about 8 in magnitude) the largest difference seen is about 6e-6, so this leaves a tenfold margin.
LOGIT_ATOL = 5e-5
LOGIT_RTOL = 1e-5

NUM_REQUESTS = 18
BUDGET = 32  # tokens per step: prompts longer than this are prefilled in chunks
# 20 blocks of 4 tokens hold 80 tokens: far less than the batch needs at once, so it must preempt.
SMALL_POOL = EngineConfig(num_blocks=20, block_size=4, max_num_batched_tokens=BUDGET)


@dataclass(frozen=True, slots=True)
class ScheduledWork:
    """What one scheduled chunk did, recorded for assertions about how the batch was run."""

    seq_id: int
    computed_before: int
    num_tokens: int
    prompt_len: int

    @property
    def is_decode(self) -> bool:
        return self.computed_before >= self.prompt_len

    @property
    def is_partial_prefill(self) -> bool:
        return not self.is_decode and self.computed_before + self.num_tokens < self.prompt_len


def record_schedule(engine: LLMEngine) -> list[list[ScheduledWork]]:
    """Wraps the real scheduler so every step's chunks are recorded (the scheduler itself runs unchanged)."""
    steps: list[list[ScheduledWork]] = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        chunks = schedule()
        steps.append([
            ScheduledWork(c.seq.seq_id, c.seq.num_computed_tokens, c.num_tokens, c.seq.num_prompt_tokens) for c in chunks
        ])
        return chunks

    engine.scheduler.schedule = recording_schedule
    return steps


@pytest.fixture(scope="module")
def batch() -> tuple[list[list[int]], list[int]]:
    prompts = random_prompts(NUM_REQUESTS, 3, 45, seed=1)
    # At least one prompt longer than the step budget, so chunked prefill is exercised for sure.
    prompts[0] = random_prompts(1, BUDGET + 9, BUDGET + 9, seed=2)[0]
    return prompts, random_lengths(NUM_REQUESTS, 1, 30, seed=3)


@pytest.mark.parametrize("name", REFERENCE_NAMES)
def test_greedy_tokens_match_transformers_under_batching_chunking_and_preemption(name, batch, reference_models):
    prompts, max_tokens = batch
    reference = reference_models[name]
    expected = [hf_greedy(reference.model, p, n) for p, n in zip(prompts, max_tokens)]

    engine = LLMEngine(reference.folder, SMALL_POOL)
    steps = record_schedule(engine)
    produced = output_tokens(engine, prompts, [greedy(n) for n in max_tokens])

    for index, (got, want) in enumerate(zip(produced, expected)):
        assert got == want, f"request {index} differs from transformers"
    assert engine.scheduler.num_preemptions > 0
    work = [w for step in steps for w in step]
    assert any(w.is_partial_prefill for w in work), "no prompt was prefilled in chunks"
    assert any(
        any(w.is_decode for w in step) and any(not w.is_decode for w in step) for step in steps
    ), "no step mixed decoding with prefill (continuous batching)"
    assert max(len(step) for step in steps) > 1
    assert engine.residue_check() == []


@pytest.mark.parametrize("name", REFERENCE_NAMES)
def test_prefill_logits_match_transformers(name, batch, reference_models):
    prompts, _ = batch
    reference = reference_models[name]
    engine = LLMEngine(reference.folder, EngineConfig(num_blocks=256, block_size=4))
    chosen = prompts[:6]
    for prompt, logits in zip(chosen, prefill_logits(engine, chosen)):
        torch.testing.assert_close(logits, hf_logits(reference.model, prompt), atol=LOGIT_ATOL, rtol=LOGIT_RTOL)
    assert engine.residue_check() == []


@pytest.mark.parametrize("name", MORE_REFERENCE_NAMES)
def test_more_families_prefill_logits_match_transformers(name, batch):
    """Mistral, Llama 3 frequency scaling (read from the saved config's rope parameters), and the optional biases."""
    prompts, _ = batch
    reference = reference_model(name)
    engine = LLMEngine(reference.folder, EngineConfig(num_blocks=256, block_size=4))
    assert engine.model_config.family == name.split("-")[0].replace("llama3", "llama")
    if name.endswith("-biases"):
        assert engine.model_config.attention_bias and engine.model_config.output_bias
    if name == "llama3-rope":
        assert engine.model_config.rope_scaling.rope_type == "llama3"
    chosen = prompts[:4]
    for prompt, logits in zip(chosen, prefill_logits(engine, chosen, chunk=7)):
        torch.testing.assert_close(logits, hf_logits(reference.model, prompt), atol=LOGIT_ATOL, rtol=LOGIT_RTOL)


@pytest.mark.parametrize("name", REFERENCE_NAMES)
def test_chunked_prefill_logits_match_transformers(name, batch, reference_models):
    """Chunks of 5 tokens attend to earlier chunks through the paged cache, across block boundaries."""
    prompts, _ = batch
    reference = reference_models[name]
    engine = LLMEngine(reference.folder, EngineConfig(num_blocks=256, block_size=4))
    chosen = [p for p in prompts if len(p) > 12][:4]
    for prompt, logits in zip(chosen, prefill_logits(engine, chosen, chunk=5)):
        torch.testing.assert_close(logits, hf_logits(reference.model, prompt), atol=LOGIT_ATOL, rtol=LOGIT_RTOL)


def test_logits_tolerance_is_tight_enough_to_catch_a_wrong_weight(batch, reference_models):
    """The tolerance above is meaningful: one perturbed norm weight breaks it."""
    prompts, _ = batch
    reference = reference_models["llama"]
    engine = LLMEngine(reference.folder, EngineConfig(num_blocks=64, block_size=4))
    with torch.no_grad():
        engine.runner.model.model.norm.weight[0] += 0.01
    logits = prefill_logits(engine, prompts[:1])[0]
    with pytest.raises(AssertionError):
        torch.testing.assert_close(logits, hf_logits(reference.model, prompts[0]), atol=LOGIT_ATOL, rtol=LOGIT_RTOL)


def test_bf16_checkpoint_loads_in_bf16_and_generates(tmp_path, batch, monkeypatch):
    prompts, _ = batch
    # On a CPU with native bf16 (`engine.compute_dtype`; one without widens it to fp32: its own test).
    monkeypatch.setattr(compute_dtype, "native_dtypes", lambda device: frozenset({torch.float32, torch.bfloat16}))
    folder = save_with_tokenizer(build_hf_model("llama", torch.bfloat16), tmp_path / "bf16")
    engine = LLMEngine(folder, EngineConfig(num_blocks=64, block_size=4))
    assert engine.runner.dtype == torch.bfloat16
    assert engine.runner.kv_cache.dtype == torch.bfloat16
    produced = output_tokens(engine, prompts[:4], greedy(12))
    assert [len(tokens) for tokens in produced] == [12] * 4
    assert engine.residue_check() == []


def test_fp32_checkpoint_can_be_served_in_bf16(batch, reference_models):
    prompts, _ = batch
    reference = reference_models["qwen2"]
    engine = LLMEngine(reference.folder, EngineConfig(num_blocks=64, block_size=4, dtype="bfloat16"))
    assert all(p.dtype == torch.bfloat16 for p in engine.runner.model.parameters())
    # bf16 rounds the weights, so the first tokens are compared loosely: most positions agree with fp32.
    logits = prefill_logits(engine, prompts[1:2])[0]
    agree = (logits.argmax(-1) == hf_logits(reference.model, prompts[1]).argmax(-1)).float().mean()
    assert agree >= 0.8


def test_sharded_checkpoint_gives_the_same_greedy_tokens(tmp_path, batch, reference_models):
    prompts, _ = batch
    reference = reference_models["qwen3"]
    folder = save_with_tokenizer(reference.model, tmp_path / "sharded", max_shard_size="100KB")
    shards = sorted(folder.glob("*.safetensors"))
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(shards) > 1
    params = [greedy(n) for n in (8, 15, 3, 20)]
    sharded = output_tokens(LLMEngine(folder, EngineConfig(num_blocks=128, block_size=4)), prompts[:4], params)
    whole = output_tokens(LLMEngine(reference.folder, EngineConfig(num_blocks=128, block_size=4)), prompts[:4], params)
    assert sharded == whole


def test_n_samples_match_transformers_when_a_sibling_is_preempted_before_its_copy_on_write(reference_models):
    """A request of two greedy samples shares a half-filled prompt block beside a second request.

    In the first decode step sample 0 copies the shared block on write, then the second request needs
    a block and preempts sample 1, the other holder: the shared block is freed and zeroed in that very
    step. Sample 0 must still attend to its real prompt, token for token as `transformers` does.
    """
    reference = reference_models["qwen3"]
    shared_prompt = random_prompts(1, 6, 6, seed=21)[0]  # one full block and half of another
    other_prompt = random_prompts(1, 8, 8, seed=22)[0]  # exactly two blocks
    engine = LLMEngine(reference.folder, EngineConfig(num_blocks=5, block_size=4))

    pair, other = engine.generate([shared_prompt, other_prompt], [greedy(6, n=2), greedy(6)])

    expected = hf_greedy(reference.model, shared_prompt, 6)
    assert [sample.token_ids for sample in pair.outputs] == [expected, expected]
    assert other.outputs[0].token_ids == hf_greedy(reference.model, other_prompt, 6)
    assert engine.scheduler.num_preemptions > 0
    assert engine.residue_check() == []
