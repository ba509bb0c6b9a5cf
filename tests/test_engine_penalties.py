"""logit_bias, presence/frequency penalties (OpenAI) and the repetition penalty (vLLM, Hugging Face).

Every pick is held to a reference computed apart: `transformers`' logits for the same prefix, the
bias and penalties applied here in float64 numpy from the sample's own prompt and output, then the
greedy argmax or the draw from the same counter-based uniform (`tests/sampling_support.py`). Greedy and
sampled, n > 1, async scheduling, preemption by recompute; and the per-sample counts are zero once
their samples end, so nothing of one request reaches the next.
"""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch

from engine import EngineConfig, LLMEngine, RequestRejected, SamplingParams, StructuredOutput
from engine.logits_processors import Penalties, apply_bitmask, penalize
from tests.engine_models import (  # noqa: F401 (fixtures)
    hf_logits,
    one_torch_thread,
    random_prompts,
    reference_model,
    tiny_model_dir,
)
from tests.sampling_support import reference_draw

PENALIZED = {"presence_penalty": 1.5, "frequency_penalty": 0.7, "repetition_penalty": 1.8}
# 12 blocks of 4 tokens and 16 tokens a step: three requests of ~20 tokens cannot all stay resident.
TIGHT = {"num_blocks": 12, "block_size": 4, "max_num_batched_tokens": 16}


def reference_logits(model, prompt: list[int], output: list[int], params: SamplingParams) -> np.ndarray:
    logits = hf_logits(model, prompt + output)[-1].double().numpy().copy()
    for token, bias in params.logit_bias:
        logits[token] += bias
    for token in set(prompt) | set(output):
        penalty = params.repetition_penalty
        logits[token] = logits[token] / penalty if logits[token] > 0 else logits[token] * penalty
    for token, count in Counter(output).items():
        logits[token] -= params.frequency_penalty * count + params.presence_penalty
    return logits


def reference_pick(logits: np.ndarray, params: SamplingParams, seed: int | None, position: int) -> int:
    if params.greedy:
        return int(np.argmax(logits))
    scaled = logits / params.temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    return reference_draw(probs, seed, position)


def reference_tokens(model, prompt: list[int], params: SamplingParams, sample: int = 0) -> list[int]:
    seed = None if params.greedy else (params.seed * 1_000_003 + sample) % (1 << 63)
    output: list[int] = []
    for position in range(params.max_tokens):
        output.append(reference_pick(reference_logits(model, prompt, output, params), params, seed, position))
    return output


def samples(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[list[int]]]:
    return [[c.token_ids for c in sorted(o.outputs, key=lambda c: c.index)] for o in engine.generate(prompts, params)]


def assert_nothing_held(engine: LLMEngine) -> None:
    slots = engine.sampler.processors.slots
    assert slots.held == 0
    assert int(slots.counts.abs().sum()) == 0 and not bool(slots.in_prompt.any())


def settings(max_tokens: int = 12, **extra) -> list[SamplingParams]:
    """Greedy and seeded draws, each with the penalties, bias alone, and everything at once."""
    bias = ((3, 6.0), (17, -100.0), (40, 4.5))
    return [
        # The bias makes token 3 win every pick; the penalties must then make others win.
        SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logit_bias=((3, 8.0),), **PENALIZED,
                       **extra),
        SamplingParams(max_tokens=max_tokens, temperature=0.9, seed=11, ignore_eos=True, **PENALIZED, **extra),
        SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logit_bias=bias, **extra),
        SamplingParams(max_tokens=max_tokens, temperature=1.2, seed=5, ignore_eos=True, logit_bias=bias,
                       presence_penalty=-0.5, frequency_penalty=2.0, repetition_penalty=0.7, **extra),
    ]


@pytest.mark.parametrize("overlapped", [False, True], ids=["sync", "async"])
def test_every_pick_is_the_references_greedy_and_sampled(overlapped):
    ref = reference_model("llama")
    engine = LLMEngine(ref.folder, EngineConfig(async_scheduling=overlapped))
    prompts = random_prompts(4, 5, 9, seed=3)
    params = settings()
    got = samples(engine, prompts, params)
    for prompt, p, tokens in zip(prompts, params, got):
        assert tokens[0] == reference_tokens(ref.model, prompt, p)
    assert_nothing_held(engine)


def test_the_settings_change_what_is_picked():
    """The reference holds only if the settings matter: without them the same requests pick otherwise."""
    ref = reference_model("llama")
    engine = LLMEngine(ref.folder, EngineConfig())
    prompts = random_prompts(4, 5, 9, seed=3)
    # Penalties lower only tokens already seen, and the race's other tokens keep their odds, so a drawn
    # row changes only where its plain draw would repeat a token: 48 picks make that near certain.
    plain = [SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, seed=p.seed, ignore_eos=True)
             for p in settings(48)]
    assert all(a != b for a, b in zip(samples(engine, prompts, plain), samples(engine, prompts, settings(48))))
    penalized = settings()[0]
    bias_only = SamplingParams(max_tokens=penalized.max_tokens, temperature=0.0, ignore_eos=True,
                               logit_bias=penalized.logit_bias)
    assert samples(engine, prompts[:1], [bias_only]) != samples(engine, prompts[:1], [penalized])


@pytest.mark.parametrize("overlapped", [False, True], ids=["sync", "async"])
def test_each_of_n_samples_counts_its_own_tokens(overlapped):
    ref = reference_model("llama")
    engine = LLMEngine(ref.folder, EngineConfig(async_scheduling=overlapped))
    prompt = random_prompts(1, 6, 6, seed=8)[0]
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=21, n=3, ignore_eos=True, **PENALIZED)
    got = samples(engine, [prompt], [params])[0]
    assert len(set(map(tuple, got))) == 3
    for index, tokens in enumerate(got):
        assert tokens == reference_tokens(ref.model, prompt, params, sample=index)
    assert_nothing_held(engine)


@pytest.mark.parametrize("overlapped", [False, True], ids=["sync", "async"])
def test_preempted_samples_keep_their_counts(overlapped):
    ref = reference_model("llama")
    engine = LLMEngine(ref.folder, EngineConfig(async_scheduling=overlapped, **TIGHT))
    prompts = random_prompts(3, 6, 8, seed=4)
    params = [SamplingParams(max_tokens=14, temperature=t, seed=2, ignore_eos=True, **PENALIZED) for t in (0.0, 1.0, 0.0)]
    got = samples(engine, prompts, params)
    assert engine.scheduler.num_preemptions > 0
    for prompt, p, tokens in zip(prompts, params, got):
        assert tokens[0] == reference_tokens(ref.model, prompt, p)
    assert_nothing_held(engine)


def test_a_reused_slot_starts_from_zero():
    """Requests one after another take the same slots: each still picks what its reference picks."""
    ref = reference_model("llama")
    engine = LLMEngine(ref.folder, EngineConfig())
    prompts = random_prompts(4, 5, 9, seed=6)
    for prompt in prompts:
        params = settings(max_tokens=8)[0]
        assert samples(engine, [prompt], [params])[0][0] == reference_tokens(ref.model, prompt, params)
        assert_nothing_held(engine)


def test_an_aborted_penalized_request_leaves_no_counts():
    ref = reference_model("llama")
    engine = LLMEngine(ref.folder, EngineConfig())
    request_id = engine.add_request(random_prompts(1, 6, 6, seed=1)[0], settings(max_tokens=30)[0])
    for _ in range(3):
        engine.step()
    assert engine.sampler.processors.slots.held == 1
    engine.abort(request_id)
    assert_nothing_held(engine)


@pytest.mark.parametrize(("field", "value"), [
    ("presence_penalty", 2.5), ("presence_penalty", -2.01), ("frequency_penalty", 5.0),
    ("frequency_penalty", float("nan")), ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    ("logit_bias", ((0, 100.5),)), ("logit_bias", ((10**6, 1.0),)), ("logit_bias", ((True, 1.0),)),
    ("logit_bias", tuple((t, 1.0) for t in range(301))),
])
def test_out_of_range_settings_are_refused_by_name(field, value):
    with pytest.raises(RequestRejected) as refused:
        SamplingParams(**{field: value}).validate(vocab_size=1000)
    assert refused.value.reason == "invalid_sampling" and field in str(refused.value)


def test_penalize_matches_numpy_on_random_rows():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 50, generator=generator) * 3
    counts = torch.randint(0, 3, (5, 50), generator=generator, dtype=torch.int32)
    in_prompt = torch.rand(5, 50, generator=generator) < 0.2
    penalties = Penalties(torch.tensor([1.0, 1.5, 0.5, 2.0, 1.2]), torch.tensor([0.0, 0.5, -1.0, 2.0, 0.1]),
                          torch.tensor([0.0, -0.5, 1.0, 2.0, 0.3]))
    got = penalize(logits, counts, in_prompt, penalties).double().numpy()
    for row in range(5):
        expected = logits[row].double().numpy().copy()
        r = float(penalties.repetition[row])
        for token in range(50):
            if in_prompt[row, token] or counts[row, token] > 0:
                expected[token] = expected[token] / r if expected[token] > 0 else expected[token] * r
            expected[token] -= float(penalties.frequency[row]) * int(counts[row, token])
            expected[token] -= float(penalties.presence[row]) * (int(counts[row, token]) > 0)
        np.testing.assert_allclose(got[row], expected, rtol=1e-5, atol=1e-5)


def test_bitmask_keeps_exactly_the_set_bits():
    generator = torch.Generator().manual_seed(2)
    allowed = torch.rand(3, 70, generator=generator) < 0.3
    words = np.zeros((3, 3), dtype=np.uint32)
    for row, token in allowed.nonzero().tolist():
        words[row, token // 32] |= np.uint32(1 << (token % 32))
    logits = torch.randn(3, 70, generator=generator)
    masked = apply_bitmask(logits, torch.from_numpy(words.view(np.int32)))
    assert torch.equal(torch.isfinite(masked), allowed)
    assert torch.equal(masked[allowed], logits[allowed])


def test_slots_taken_in_a_step_that_waits_for_a_constrained_token_are_released():
    """Under async scheduling a step with a constrained sample picks after the previous step is read; a
    penalized request whose slots are taken (and the pool grown) then still ends with every slot zeroed."""
    engine = LLMEngine(tiny_model_dir(), EngineConfig(async_scheduling=True, kv_cache_gib=0.01))
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "string", "maxLength": 30}}, "required": ["a"]})
    engine.add_request("hello", SamplingParams(max_tokens=40, seed=1, structured=StructuredOutput("json_schema", schema)))
    for _ in range(3):
        engine.step()
    engine.add_request("again", SamplingParams(max_tokens=10, seed=2, n=8, **PENALIZED))
    for _ in engine.stream():
        pass
    assert_nothing_held(engine)
