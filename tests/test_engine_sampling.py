"""Sampling: seeds reproduce across batch mixes, filters, stops, lengths, logprobs and n samples."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from engine import EngineConfig, FinishReason, LLMEngine, SamplingParams
from engine.sampler import SampleRequest, Sampler, filter_probs
from engine.sampling_params import MIN_TEMPERATURE
from tests.engine_models import (  # noqa: F401 (fixtures)
    greedy,
    one_torch_thread,
    prefill_logits,
    random_prompts,
    tiny_engine,
    tiny_model_dir,
)

PROMPTS = random_prompts(6, 4, 24, seed=21)
SEEDED = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=42, ignore_eos=True)


def first_new_token_index(tokens: list[int], start: int = 2) -> int:
    """A position whose token has not appeared before it, so stopping on that token stops exactly there."""
    return next(k for k in range(start, len(tokens)) if tokens[k] not in tokens[:k])


def sampled_tokens(engine: LLMEngine, prompt, params: SamplingParams) -> list[int]:
    return engine.generate([prompt], params)[0].outputs[0].token_ids


# ----- reproducibility ----------------------------------------------------------------------


def test_seeded_request_gives_the_same_tokens_in_any_batch_mix():
    target = PROMPTS[0]
    alone = sampled_tokens(tiny_engine(num_blocks=64, block_size=4), target, SEEDED)

    mixed = tiny_engine(num_blocks=64, block_size=4)
    others = [greedy(10), SamplingParams(max_tokens=12, temperature=1.3, seed=7, ignore_eos=True)]
    outputs = mixed.generate([PROMPTS[1], target, PROMPTS[2]], [others[0], SEEDED, others[1]])
    assert outputs[1].outputs[0].token_ids == alone

    # Another mix: more neighbours, chunked prefill and a pool small enough to force preemption.
    crowded = tiny_engine(num_blocks=14, block_size=4, max_num_batched_tokens=8)
    params = [SamplingParams(max_tokens=14, temperature=0.7, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    outputs = crowded.generate([PROMPTS[3], PROMPTS[4], target, PROMPTS[5]], [params[0], params[1], SEEDED, params[2]])
    assert crowded.scheduler.num_preemptions > 0
    assert outputs[2].outputs[0].token_ids == alone


def test_different_seeds_give_different_tokens_and_the_same_seed_the_same():
    engine = tiny_engine(num_blocks=64, block_size=4)
    params = {seed: SamplingParams(max_tokens=16, temperature=1.0, seed=seed, ignore_eos=True) for seed in (1, 2)}
    first = sampled_tokens(engine, PROMPTS[0], params[1])
    assert sampled_tokens(engine, PROMPTS[0], params[2]) != first
    assert sampled_tokens(tiny_engine(num_blocks=64, block_size=4), PROMPTS[0], params[1]) == first


def test_sampling_is_not_greedy():
    engine = tiny_engine(num_blocks=64, block_size=4)
    sampled = sampled_tokens(engine, PROMPTS[0], SamplingParams(max_tokens=16, temperature=1.0, seed=1, ignore_eos=True))
    assert sampled != sampled_tokens(engine, PROMPTS[0], greedy(16))


@pytest.mark.parametrize(
    "settings",
    [{"top_k": 1}, {"min_p": 1.0}, {"top_p": 1e-6}],
    ids=["top_k=1", "min_p=1", "top_p~0"],
)
def test_filters_that_leave_one_token_equal_greedy(settings):
    engine = tiny_engine(num_blocks=64, block_size=4)
    expected = sampled_tokens(engine, PROMPTS[1], greedy(16))
    params = SamplingParams(max_tokens=16, temperature=1.5, seed=11, ignore_eos=True, **settings)
    assert sampled_tokens(engine, PROMPTS[1], params) == expected


@pytest.mark.parametrize("temperature", [1e-38, 1e-30, MIN_TEMPERATURE / 2])
def test_temperatures_below_the_floor_are_greedy(temperature):
    """At 1e-38 the scaled logits overflow fp32: without the floor every token came out as id 0."""
    engine = tiny_engine(num_blocks=64, block_size=4)
    expected = sampled_tokens(engine, PROMPTS[1], greedy(16))
    assert set(expected) != {0}
    params = SamplingParams(max_tokens=16, temperature=temperature, seed=3, ignore_eos=True)
    assert params.greedy
    assert sampled_tokens(engine, PROMPTS[1], params) == expected


def test_the_floor_itself_still_samples():
    assert not SamplingParams(temperature=MIN_TEMPERATURE).greedy


@pytest.mark.parametrize(
    ("poison", "expected"),
    [(math.nan, 26), (math.inf, 3)],  # NaN ranks last; an infinite logit is a certain token
    ids=["nan", "inf"],
)
def test_non_finite_probabilities_are_never_drawn_from(poison, expected):
    """A non-finite logit makes softmax all NaN, and NaN wins argmax: the draw falls back to greedy."""
    logits = torch.linspace(-2.0, 2.0, 32).roll(-5).unsqueeze(0)  # the best finite logit is at index 26
    logits[0, 3] = poison
    request = SampleRequest(0, SamplingParams(temperature=1.0, seed=0), torch.Generator().manual_seed(0))
    [(token, _)] = Sampler()(logits, [request])
    assert token == expected

# ----- ending -------------------------------------------------------------------------------


def test_max_tokens_ends_with_reason_length():
    engine = tiny_engine(num_blocks=64, block_size=4)
    outputs = engine.generate(PROMPTS[:3], [greedy(n) for n in (1, 5, 9)])
    assert [len(o.outputs[0].token_ids) for o in outputs] == [1, 5, 9]
    assert all(o.outputs[0].finish_reason is FinishReason.LENGTH for o in outputs)


def test_stop_token_ids_end_the_output_before_that_token():
    engine = tiny_engine(num_blocks=64, block_size=4)
    full = sampled_tokens(engine, PROMPTS[2], greedy(20))
    k = first_new_token_index(full)
    output = engine.generate([PROMPTS[2]], greedy(20, stop_token_ids=(full[k],)))[0].outputs[0]
    assert output.token_ids == full[:k]
    assert output.finish_reason is FinishReason.STOP


def test_eos_from_generation_config_stops_unless_ignored(tmp_path):
    full = sampled_tokens(tiny_engine(num_blocks=64, block_size=4), PROMPTS[3], greedy(20))
    k = first_new_token_index(full)
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir(), folder)
    generation = json.loads((folder / "generation_config.json").read_text())
    generation["eos_token_id"] = [full[k]]
    (folder / "generation_config.json").write_text(json.dumps(generation))
    engine = LLMEngine(folder, EngineConfig(num_blocks=64, block_size=4))

    stopped = engine.generate([PROMPTS[3]], SamplingParams(max_tokens=20, temperature=0.0))[0].outputs[0]
    assert stopped.token_ids == full[:k]
    assert stopped.finish_reason is FinishReason.STOP
    assert sampled_tokens(engine, PROMPTS[3], greedy(20)) == full  # ignore_eos


STOP_PROMPTS = ("The quick brown fox", "Once upon a time", "Hello, world!", "Privacy is the product", "Veil answers")


def _stop_string_case(engine: LLMEngine) -> tuple[str, str, str, str]:
    """A prompt, its greedy output text, a stop string from the text's middle (spanning tokens), the text before it.

    Random weights often emit lone bytes of multi-byte characters, so the first prompt whose text has a
    clean stretch is used.
    """
    for prompt in STOP_PROMPTS:
        text = engine.generate([prompt], greedy(24))[0].outputs[0].text
        for start in range(4, len(text) - 6):
            stop = text[start : start + 6]
            if "\ufffd" not in text[: start + 6] and text.find(stop) == start:
                return prompt, text, stop, text[:start]
    raise AssertionError("no greedy text has a usable stop string")


def test_stop_string_truncates_the_text_and_ends_with_reason_stop():
    engine = tiny_engine(num_blocks=64, block_size=4)
    prompt, full_text, stop, before = _stop_string_case(engine)
    output = engine.generate([prompt], greedy(24, stop=(stop, "never appears \u2603")))[0].outputs[0]
    assert output.text == before
    assert output.finish_reason is FinishReason.STOP
    assert len(output.token_ids) < 24
    assert stop in engine.tokenizer.decode(output.token_ids)  # the tokens that made the stop string are kept


def test_streamed_text_never_contains_the_stop_string():
    engine = tiny_engine(num_blocks=64, block_size=4)
    prompt, _, stop, before = _stop_string_case(engine)
    engine.add_request(prompt, greedy(24, stop=(stop,)))
    streamed = ""
    reasons = []
    for delta in engine.stream():
        streamed += delta.text
        reasons.append(delta.finish_reason)
        assert stop not in streamed
    assert streamed == before
    assert reasons[-1] is FinishReason.STOP and all(r is None for r in reasons[:-1])


# ----- logprobs and n -----------------------------------------------------------------------


def test_logprobs_are_those_of_the_engines_own_logits():
    engine = tiny_engine(num_blocks=64, block_size=4)
    prompt = PROMPTS[4]
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=9, logprobs=3, ignore_eos=True)
    output = engine.generate([prompt], params)[0].outputs[0]
    assert [entry.token_id for entry in output.logprobs] == output.token_ids

    logits = prefill_logits(engine, [prompt + output.token_ids[:-1]])[0][len(prompt) - 1 :]
    log_probs = torch.log_softmax(logits, dim=-1)
    chosen = log_probs[torch.arange(8), torch.tensor(output.token_ids)]
    reported = torch.tensor([entry.logprob for entry in output.logprobs])
    torch.testing.assert_close(reported, chosen, atol=1e-4, rtol=0)
    assert (reported <= 0).all()
    for position, entry in enumerate(output.logprobs):
        top = torch.topk(log_probs[position], 3)
        assert [token for token, _ in entry.top] == top.indices.tolist()
        assert [value for _, value in entry.top] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert entry.logprob <= entry.top[0][1] + 1e-6
    assert engine.residue_check() == []


def test_logprobs_zero_reports_the_chosen_token_only_and_none_reports_nothing():
    engine = tiny_engine(num_blocks=64, block_size=4)
    chosen_only = engine.generate([PROMPTS[0]], greedy(5, logprobs=0))[0].outputs[0]
    assert len(chosen_only.logprobs) == 5
    assert all(entry.top == () and entry.logprob <= 0 for entry in chosen_only.logprobs)
    assert engine.generate([PROMPTS[0]], greedy(5))[0].outputs[0].logprobs == []


def test_n_samples_come_back_indexed_and_seeded_samples_reproduce_in_a_batch():
    params = SamplingParams(max_tokens=10, temperature=1.0, n=3, seed=5, ignore_eos=True)
    alone = tiny_engine(num_blocks=64, block_size=4).generate([PROMPTS[1]], params)[0]
    assert [o.index for o in alone.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 10 and o.finish_reason is FinishReason.LENGTH for o in alone.outputs)
    assert len({tuple(o.token_ids) for o in alone.outputs}) == 3, "the samples drew the same tokens"

    batch = tiny_engine(num_blocks=64, block_size=4).generate([PROMPTS[0], PROMPTS[1]], [greedy(7), params])[1]
    assert [o.token_ids for o in batch.outputs] == [o.token_ids for o in alone.outputs]


# ----- filter_probs -------------------------------------------------------------------------

PROBS = torch.tensor([0.05, 0.5, 0.15, 0.3])


def kept(**settings) -> list[int]:
    filtered = filter_probs(PROBS.clone(), SamplingParams(**settings))
    return torch.nonzero(filtered).flatten().tolist()


@pytest.mark.parametrize(("top_k", "expected"), [(1, [1]), (2, [1, 3]), (3, [1, 2, 3]), (0, [0, 1, 2, 3]), (9, [0, 1, 2, 3])])
def test_top_k_keeps_the_k_most_likely(top_k, expected):
    assert kept(top_k=top_k) == expected


@pytest.mark.parametrize(("top_p", "expected"), [(0.4, [1]), (0.75, [1, 3]), (0.85, [1, 2, 3]), (0.99, [0, 1, 2, 3])])
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, expected):
    assert kept(top_p=top_p) == expected


@pytest.mark.parametrize(("min_p", "expected"), [(0.0, [0, 1, 2, 3]), (0.2, [1, 2, 3]), (0.5, [1, 3]), (0.9, [1]), (1.0, [1])])
def test_min_p_keeps_tokens_at_least_min_p_times_the_best(min_p, expected):
    assert kept(min_p=min_p) == expected


def test_filters_compose_and_never_drop_the_best_token():
    assert kept(top_k=3, top_p=0.75) == [1, 3]
    assert kept(top_k=3, min_p=0.4) == [1, 3]
    assert kept(top_k=1, top_p=0.01, min_p=1.0) == [1]


def test_filter_keeps_the_surviving_probabilities_unchanged():
    filtered = filter_probs(PROBS.clone(), SamplingParams(top_k=2))
    assert filtered.tolist() == pytest.approx([0.0, 0.5, 0.0, 0.3])
    assert not math.isclose(float(filtered.sum()), 1.0)  # renormalising is the sampler's draw's business
