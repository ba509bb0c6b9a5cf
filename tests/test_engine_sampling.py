"""Sampling: seeds reproduce across batch mixes, filters, stops, lengths, logprobs and n samples; the
batched sampler draws from the filtered distribution in a fixed set of ops with one copy to the host."""

from __future__ import annotations

import json
import math
import random
import shutil

import pytest
import torch
from torch.overrides import TorchFunctionMode

import engine.sampler as sampler_module
from engine.bridge import Bridge, Download
from engine import EngineConfig, FinishReason, LLMEngine, SamplingParams
from engine.errors import EngineError
from engine.sampler import Filters, SampleRequest, Sampler, filter_batch, filter_probs
from engine.logits_processors import LogitsProcessors, Penalties, penalize
from engine.sampling_draw import DRAWS as DRAW_KINDS
from engine.sampling_draw import INVERSE, RACE, block_width, descending_keys, draw_order, first_index, inverse_draw
from engine.sampling_noise import (
    ACCEPTANCE_COUNTER, draw_uniforms, exponential_noise, negated_exponential_noise, row_bits, row_keys, row_uniforms,
    token_bits, uniform_from_bits,
)
from engine.sampling_params import MIN_TEMPERATURE
from tests.engine_models import (  # noqa: F401 (fixtures)
    bridge_buffers,
    greedy,
    one_torch_thread,
    only_the_read_may_wait,
    prefill_logits,
    random_prompts,
    staging_in_use_is_pinned,
    tiny_engine,
    tiny_model_dir,
)
from tests.sampling_support import flat_draw, reference_draw

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
    request = SampleRequest(0, SamplingParams(temperature=1.0, seed=0), seed=0)
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


def reference_filter(probs: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The one-row filter the batched one replaced, kept as the definition of its semantics."""
    if params.top_k and params.top_k < probs.shape[-1]:
        kth = torch.topk(probs, params.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, 0.0)
    if params.min_p > 0.0:
        probs = torch.where(probs >= params.min_p * probs.max(), probs, 0.0)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        keep_sorted = before < params.top_p * sorted_probs.sum()
        keep = torch.zeros_like(keep_sorted).scatter(0, order, keep_sorted)
        probs = torch.where(keep, probs, 0.0)
    return probs


def random_filter_settings(rng: random.Random, vocab: int) -> SamplingParams:
    return SamplingParams(
        top_k=rng.choice([0, 1, 2, 5, vocab - 1, vocab, vocab + 3]),
        top_p=rng.choice([1.0, 1.0, 0.999, 0.9, 0.5, 0.05]),
        min_p=rng.choice([0.0, 0.0, 0.01, 0.2, 0.7, 1.0]),
    )


def test_batched_filter_keeps_exactly_what_the_one_row_filter_keeps():
    rng = random.Random(8)
    vocab = 50
    for _ in range(20):
        rows = rng.randint(1, 12)
        # Steep rows leave a tail below float32's resolution of the mass before it: top_p = 1 must keep it.
        steepness = rng.choice([1.0, 3.0, 12.0])
        logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
        probs = torch.softmax(logits * steepness, -1)
        settings = [random_filter_settings(rng, vocab) for _ in range(rows)]
        top_ks = [k if 0 < k < vocab else vocab for k in (s.top_k for s in settings)]
        filters = Filters(
            torch.tensor(top_ks), torch.tensor([s.top_p for s in settings]), torch.tensor([s.min_p for s in settings]),
            sorts=any(k < vocab for k in top_ks) or any(s.top_p < 1.0 for s in settings),
        )
        batched = filter_batch(probs, filters)
        for row, params in enumerate(settings):
            assert torch.equal(batched[row], reference_filter(probs[row], params)), params


# ----- the batched sampler ------------------------------------------------------------------

# A fixed distribution over five tokens, and which tokens each filter keeps of it, worked out by hand.
FIVE = torch.tensor([0.4, 0.25, 0.15, 0.12, 0.08], dtype=torch.float64)
DRAWS = 20_000


def noise_seed(k: int) -> int:
    """Distinct, well-spread 62-bit seeds for a derandomized draw."""
    return (k * 0x9E3779B97F4A7C15 + 12345) % (1 << 62)


def draw_counts(params: SamplingParams, kind: str = INVERSE, draws: int = DRAWS) -> torch.Tensor:
    logits = FIVE.log().float().unsqueeze(0)
    requests = [SampleRequest(0, params, noise_seed(k), position=k % 13) for k in range(draws)]
    tokens = torch.tensor([token for token, _ in Sampler(draw_kind=kind)(logits, requests)])
    return torch.bincount(tokens, minlength=len(FIVE)).double()


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({"temperature": 1.0}, FIVE),
        ({"temperature": 0.5}, FIVE**2),
        ({"temperature": 1.0, "top_k": 3}, FIVE * torch.tensor([1, 1, 1, 0, 0])),
        ({"temperature": 1.0, "top_p": 0.5}, FIVE * torch.tensor([1, 1, 0, 0, 0])),  # mass before: 0, .4, .65
        ({"temperature": 1.0, "min_p": 0.3}, FIVE * torch.tensor([1, 1, 1, 1, 0])),  # keeps p >= .12
        # top-k leaves .92 of the mass; .65 before the third token is not under .7 of that.
        ({"temperature": 1.0, "top_k": 4, "top_p": 0.7, "min_p": 0.2}, FIVE * torch.tensor([1, 1, 0, 0, 0])),
    ],
    ids=["t=1", "t=0.5", "top_k=3", "top_p=0.5", "min_p=0.3", "all"],
)
@pytest.mark.parametrize("kind", DRAW_KINDS)
def test_draw_frequencies_match_the_filtered_distribution(settings, expected, kind):
    counts = draw_counts(SamplingParams(**settings), kind)
    kept = expected > 0
    assert counts[~kept].sum() == 0, "a token the filters exclude was drawn"
    expected_counts = expected[kept] / expected[kept].sum() * DRAWS
    chi_square = ((counts[kept] - expected_counts) ** 2 / expected_counts).sum()
    degrees = int(kept.sum()) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(degrees / 2), chi_square / 2))
    assert p_value > 1e-4, f"chi-square {float(chi_square):.1f} on {degrees} degrees of freedom"


def reference_key(seed: int, position: int) -> int:
    """A row's key, in Python's unbounded integers: splitmix64's finaliser over its counter mod 2**64."""
    mask64, gamma = (1 << 64) - 1, 0x9E3779B97F4A7C15
    z = (seed + (position + 1) * gamma) & mask64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask64
    return z ^ (z >> 31)


def reference_noise_bits(seed: int, position: int, counter: int) -> int:
    """The bits of one counter: lowbias32 over the key's low half plus the counter's step mod 2**32, its
    high half xored in between the multiplies."""
    mask32, key = (1 << 32) - 1, reference_key(seed, position)
    x = (key + counter * 0x9E3779B9) & mask32
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & mask32
    x = (((x ^ (x >> 15)) ^ (key >> 32)) * 0x846CA68B) & mask32
    return x ^ (x >> 16)


SEEDS = [0, 1, 2**62 - 1, 2**63 - 1, noise_seed(7)]
POSITIONS = [0, 5, 2**40, 3, 1_000_000]


@pytest.mark.parametrize("counter", [ACCEPTANCE_COUNTER, 1, 7])
def test_row_bits_are_splitmix64_then_lowbias32_with_wrapping_integer_arithmetic(counter):
    bits = row_bits(torch.tensor(SEEDS), torch.tensor(POSITIONS), counter).squeeze(-1)
    expected = [reference_noise_bits(seed, position, counter) for seed, position in zip(SEEDS, POSITIONS)]
    assert [b % (1 << 32) for b in bits.tolist()] == expected


def test_the_uniform_takes_31_bits_and_stays_inside_the_open_interval():
    bits = torch.tensor([0, 1, -1, 2**31 - 1, -(2**31)], dtype=torch.int32)
    uniform = uniform_from_bits(bits.clone()).double()
    assert uniform.tolist()[:2] == [0.5 * 2**-31, 1.5 * 2**-31]
    assert (uniform < 1).all() and (uniform > 0).all()
    assert uniform[2] == uniform[3]  # the sign bit is not used


def test_the_draws_uniform_is_the_keys_top_31_bits_exactly_in_float64():
    uniforms = draw_uniforms(torch.tensor(SEEDS), torch.tensor(POSITIONS))
    assert uniforms.dtype == torch.float64
    expected = [((reference_key(seed, position) >> 33) + 0.5) * 2**-31 for seed, position in zip(SEEDS, POSITIONS)]
    assert uniforms.tolist() == expected


def test_draw_uniforms_are_uniform_and_independent_of_the_acceptance_uniforms():
    seeds = torch.tensor([noise_seed(k) for k in range(50_000)])
    positions = torch.arange(50_000) % 97
    draws, accepts = draw_uniforms(seeds, positions), row_uniforms(seeds, positions).double()
    assert ((draws > 0) & (draws < 1)).all()
    assert abs(float(draws.mean()) - 0.5) < 0.005 and abs(float(draws.var()) - 1 / 12) < 0.002
    assert abs(float(torch.corrcoef(torch.stack([draws, accepts]))[0, 1])) < 0.02
    assert torch.equal(draw_uniforms(seeds[3:4], positions[3:4]), draws[3:4])  # a pure function of its row


def test_the_races_noise_bits_are_each_tokens_counter_of_the_row_key():
    bits = token_bits(row_keys(torch.tensor(SEEDS), torch.tensor(POSITIONS)), 300)
    for row, (seed, position) in enumerate(zip(SEEDS, POSITIONS)):
        assert [b % (1 << 32) for b in bits[row].tolist()] == [reference_noise_bits(seed, position, t + 1)
                                                              for t in range(300)]


def test_the_races_noise_is_exponential_positive_finite_and_differs_by_seed_and_position():
    noise = exponential_noise(torch.tensor([5, 5, 6]), torch.tensor([0, 1, 0]), 50_000)
    assert torch.isfinite(noise).all() and (noise > 0).all()
    assert not torch.equal(noise[0], noise[1]) and not torch.equal(noise[0], noise[2])
    assert abs(float(noise.mean()) - 1.0) < 0.01 and abs(float(noise.var()) - 1.0) < 0.03
    assert torch.equal(exponential_noise(torch.tensor([5]), torch.tensor([1]), 50_000)[0], noise[1])


def test_the_negated_noise_is_the_noise_negated_bit_for_bit():
    seeds, positions = torch.tensor([5, 5, 2**62 - 1]), torch.tensor([0, 1, 7])
    negated = negated_exponential_noise(seeds, positions, 5000)
    assert torch.equal((-negated).view(torch.int32), exponential_noise(seeds, positions, 5000).view(torch.int32))


def test_a_sampler_draws_by_a_kind_it_knows():
    with pytest.raises(EngineError, match="inverse, race"):
        Sampler(draw_kind="gumbel")


# ----- the two-level draw ------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [1, 2, 5, 50, 64, 525, 1000, 1024, 4099])
def test_the_two_level_draw_picks_what_one_cumulative_sum_picks(vocab):
    generator = torch.Generator().manual_seed(vocab)
    probs = torch.softmax(torch.randn(64, vocab, generator=generator) * 3, dim=-1)
    probs[::3] *= torch.rand(probs[::3].shape, generator=generator) > 0.6  # filtered rows: zeros between tokens
    probs[::3, 0] = probs[::3, 0] + 0.01  # ... and never none left
    uniforms = torch.rand(64, generator=generator, dtype=torch.float64)
    is_distribution, picks = inverse_draw(probs, uniforms)
    assert is_distribution.all()
    # Blocks are summed in float32 (within about width·2^-24 of their mass): a uniform that close to a
    # token's edge could land on its neighbour, which none of these seeded rows comes near.
    assert picks.tolist() == [flat_draw(row, float(u)) for row, u in zip(probs, uniforms)]


@pytest.mark.parametrize("vocab", [4099, 1000], ids=["a-short-last-row-of-blocks", "whole-blocks"])  # 4099: a prime
def test_a_zero_probability_token_is_never_drawn_at_the_edges_of_blocks_and_uniforms(vocab):
    width, order = block_width(vocab), draw_order(vocab)
    probs = torch.zeros(8, vocab)
    probs[0, order[width - 1]] = 1.0  # the last token of the first block
    probs[1, order[width]] = 1.0  # the first of the second
    probs[2, order[-1]] = 1.0  # the very last token in the draw's order
    probs[2, order[-width - 1]] = 1e-3  # and the last of the block before
    probs[3, [order[0], order[-1]]] = torch.tensor([1e-30, 1.0])  # a mass too small to move a float64 total
    probs[4, order[::width]] = 2.0**-20  # the first token of every block
    probs[5, order[: 3 * width]] = torch.rand(3 * width) * 1e-3  # all mass in the first blocks, nothing after
    probs[6, 7] = 3.0  # unnormalized
    probs[7, [order[1], order[width + 1]]] = torch.tensor([1e-38, 1e-38])  # subnormal-sized mass only
    for uniform in (0.5 * 2**-31, 1e-9, 0.25, 0.5, 0.999, 1 - 0.5 * 2**-31):
        is_distribution, picks = inverse_draw(probs, torch.full((8,), uniform, dtype=torch.float64))
        assert is_distribution.all()
        assert (probs.gather(-1, picks.unsqueeze(-1)) > 0).all(), f"u={uniform}: {picks.tolist()}"


def test_the_draws_order_is_each_token_once_block_by_block():
    for vocab in (1, 5, 525, 1000, 4099):
        order, width = draw_order(vocab), block_width(vocab)
        assert sorted(order) == list(range(vocab))
        assert order[:width] == list(range(0, width * -(-vocab // width), -(-vocab // width)))[:width]


def test_rows_that_are_no_distribution_are_flagged_and_still_draw_in_range():
    probs = torch.rand(5, 300)
    probs[0, 3] = float("nan")
    probs[1] = 0.0
    probs[2] = float("nan")
    is_distribution, picks = inverse_draw(probs, torch.full((5,), 0.7, dtype=torch.float64))
    assert is_distribution.tolist() == [False, False, False, True, True]
    assert ((picks >= 0) & (picks < 300)).all()


def test_positions_give_different_draws():
    logits = torch.zeros(1, 64)  # uniform: the draw is the noise's alone
    params = SamplingParams(temperature=1.0)
    requests = [SampleRequest(0, params, seed=3, position=p) for p in range(40)]
    tokens = [token for token, _ in Sampler()(logits, requests)]
    assert len(set(tokens)) > 20


def mixed_logits(rows: int, vocab: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 2


NEIGHBOUR_SETTINGS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(temperature=0.7, top_p=0.8, logprobs=3),
    SamplingParams(temperature=1.0, min_p=0.1),
    SamplingParams(temperature=0.0, logprobs=0),
    SamplingParams(temperature=2.0),
]


def neighbours(count: int, rows: int, rng: random.Random) -> list[SampleRequest]:
    return [
        SampleRequest(rng.randrange(rows), rng.choice(NEIGHBOUR_SETTINGS), noise_seed(rng.randrange(1000)), rng.randrange(50))
        for _ in range(count)
    ]


def test_a_seeded_sample_picks_the_same_token_in_any_batch():
    rng = random.Random(4)
    logits = mixed_logits(8)
    target_params = SamplingParams(temperature=1.1, top_k=40, top_p=0.97)
    for trial in range(12):
        target_row, seed, position = rng.randrange(8), noise_seed(100 + trial), rng.randrange(200)
        [(alone, _)] = Sampler()(logits[target_row : target_row + 1], [SampleRequest(0, target_params, seed, position)])
        for count in (1, 5, 40):
            batch = neighbours(count, 8, rng)
            slot = rng.randrange(count + 1)
            batch.insert(slot, SampleRequest(target_row, target_params, seed, position))
            assert Sampler()(logits, batch)[slot][0] == alone


def test_greedy_rows_in_a_mixed_batch_take_the_argmax():
    rng = random.Random(5)
    logits = mixed_logits(10, seed=1)
    batch = neighbours(60, 10, rng)
    results = Sampler()(logits, batch)
    greedy_rows = [(r.row, token) for r, (token, _) in zip(batch, results) if r.params.greedy]
    assert len(greedy_rows) > 10
    assert [token for _, token in greedy_rows] == [int(logits[row].argmax()) for row, _ in greedy_rows]
    drawn = [token for r, (token, _) in zip(batch, results) if not r.params.greedy]
    assert drawn != [int(logits[r.row].argmax()) for r in batch if not r.params.greedy]


@pytest.mark.parametrize("temperature", [MIN_TEMPERATURE / 2, MIN_TEMPERATURE, 1e-4])
def test_tiny_temperatures_pick_the_most_likely_token_next_to_hot_rows(temperature):
    logits = torch.stack([torch.randperm(64, generator=torch.Generator().manual_seed(s)).float() * 0.01 for s in range(6)])
    cold = SamplingParams(temperature=temperature)
    batch = [SampleRequest(row, cold, noise_seed(row)) for row in range(6)]
    batch += [SampleRequest(row, SamplingParams(temperature=5.0), noise_seed(row + 9)) for row in range(6)]
    tokens = [token for token, _ in Sampler()(logits, batch)]
    assert tokens[:6] == logits.argmax(dim=-1).tolist()


POISONED_FILTERS = [{}, {"top_k": 3}, {"top_p": 0.5}, {"min_p": 0.1}, {"top_k": 5, "top_p": 0.9, "min_p": 0.05}]


@pytest.mark.parametrize("settings", POISONED_FILTERS, ids=["plain", "top_k", "top_p", "min_p", "all"])
def test_non_finite_rows_fall_back_to_the_best_finite_logit_and_leave_other_rows_alone(settings):
    logits = mixed_logits(4, vocab=32, seed=3)
    logits[1] = torch.linspace(-2.0, 2.0, 32).roll(-5)  # the best finite logit is at index 26
    logits[1, 3] = math.nan
    logits[2] = logits[1]
    logits[2, 3] = math.inf
    params = SamplingParams(temperature=1.0, **settings)
    healthy = [SampleRequest(row, params, noise_seed(row), position=2) for row in (0, 3)]
    alone = [Sampler()(logits[r.row : r.row + 1], [SampleRequest(0, params, r.seed, 2)])[0][0] for r in healthy]
    batch = [healthy[0], SampleRequest(1, params, noise_seed(1)), SampleRequest(2, params, noise_seed(2)), healthy[1]]
    tokens = [token for token, _ in Sampler()(logits, batch)]
    assert tokens == [alone[0], 26, 3, alone[1]]


def awkward_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Rows with ties, NaN, infinities, signed zeros and logits that overflow once scaled, among plain ones."""
    logits = (torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3).round()  # many ties
    logits[1, 7] = logits[2] = math.nan
    logits[3, 5] = logits[3, 9] = math.inf
    logits[4] = -math.inf
    logits[5, 3], logits[5, 4] = 3e38, 3.2e38  # both overflow at a low temperature: only the second is best
    logits[6, 11], logits[6, 12] = math.nan, math.inf
    logits[7], logits[7, 5] = 0.0, -0.0  # tied zeros of both signs
    logits[8], logits[8, 20] = -0.0, 0.0
    return logits


def test_the_greedy_pick_is_argmax_with_nan_ranked_last_on_awkward_rows():
    logits = awkward_logits(12, 300, seed=5)
    keys = descending_keys(logits.shape[-1], logits.device)
    expected = torch.nan_to_num(logits, nan=-math.inf).argmax(dim=-1)
    assert sampler_module._most_likely(logits, keys).tolist() == expected.tolist()
    assert expected[2:9].tolist() == [0, 5, 0, 4, 12, 0, 0]  # the awkward rows, worked out by hand


def test_the_first_marked_column_is_what_argmax_picks():
    marks = (torch.rand(64, 500, generator=torch.Generator().manual_seed(1)) < 0.01).float()
    marks[0], marks[1, -1] = 1.0, 1.0  # every column marked; only the last column marked
    keys = descending_keys(marks.shape[-1], marks.device)
    assert first_index(marks.clone(), keys).tolist() == marks.argmax(dim=-1).tolist()


def reference_pick(logits: torch.Tensor, request: SampleRequest, kind: str = INVERSE) -> int:
    """One row's pick the plain way: the draw from the filtered softmax, greedy where p is no distribution."""
    greedy_pick = int(torch.nan_to_num(logits, nan=-math.inf).argmax())
    if request.params.greedy:
        return greedy_pick
    probs = filter_probs(torch.softmax(logits / request.params.temperature, dim=-1), request.params)
    if not (torch.isfinite(probs.sum()) and probs.sum() > 0):
        return greedy_pick
    if kind == RACE:  # argmax(p / E), E the token's exponential noise
        noise = exponential_noise(torch.tensor([request.seed]), torch.tensor([request.position]), len(logits))[0]
        return int((probs / noise).argmax())
    return reference_draw(probs, request.seed, request.position)


@pytest.mark.parametrize("kind", DRAW_KINDS)
@pytest.mark.parametrize("in_order", [True, False], ids=["a-pick-a-row", "shuffled-repeats"])
def test_a_mixed_batch_picks_what_the_plain_way_picks_row_by_row(in_order, kind):
    logits = torch.cat([awkward_logits(12, 300, seed=7), mixed_logits(20, vocab=300, seed=8)])
    rng = random.Random(9)
    settings = NEIGHBOUR_SETTINGS + [SamplingParams(temperature=1e-2), SamplingParams(temperature=0.9, top_k=4)]
    rows = list(range(len(logits))) * 3
    if not in_order:
        rng.shuffle(rows)
    batch = [SampleRequest(row, rng.choice(settings), noise_seed(k), rng.randrange(100)) for k, row in enumerate(rows)]
    if in_order:
        batch = batch[: len(logits)]  # one pick for each logits row, in row order
    tokens = [token for token, _ in Sampler(draw_kind=kind)(logits, batch)]
    assert tokens == [reference_pick(logits[r.row], r, kind) for r in batch]
    assert any(not r.params.greedy and 1 <= r.row <= 6 for r in batch)  # drawn rows that fall back are among them


def test_a_penalized_batch_picks_what_penalizing_then_picking_each_row_picks():
    vocab = 300
    logits = mixed_logits(6, vocab=vocab, seed=4)
    prompt = logits.argmax(dim=-1).tolist()  # each row's best token is penalized
    processors = LogitsProcessors(vocab, logits.device)
    settings = [SamplingParams(temperature=0.8, repetition_penalty=1.5, presence_penalty=0.4),
                SamplingParams(temperature=0.0, repetition_penalty=2.0), SamplingParams(temperature=1.1)]
    batch = []
    for row in range(6):
        params = settings[row % 3]
        slot = processors.slots.take(prompt) if params.penalized else None
        batch.append(SampleRequest(row, params, noise_seed(row), 0, slot=slot))
    tokens = [token for token, _ in Sampler(processors)(logits, batch)]
    in_prompt = torch.zeros(1, vocab, dtype=torch.bool)
    in_prompt[0, prompt] = True
    expected = []
    for request in batch:
        params, row = request.params, logits[request.row : request.row + 1]
        penalties = Penalties(*(torch.tensor([value]) for value in (
            params.repetition_penalty, params.frequency_penalty, params.presence_penalty)))
        penalized = penalize(row, torch.zeros(1, vocab, dtype=torch.int32), in_prompt, penalties)
        expected.append(reference_pick(penalized[0], request))
    assert tokens == expected
    assert expected != [reference_pick(logits[r.row], r) for r in batch]  # the penalties changed a pick


def test_logprobs_of_a_mixed_batch_are_each_rows_own():
    rng = random.Random(6)
    logits = mixed_logits(6, seed=2)
    counts = [None, 0, 2, 5, None, 20, 1]
    batch = [
        SampleRequest(rng.randrange(6), SamplingParams(temperature=rng.choice([0.0, 0.9]), logprobs=k), noise_seed(i), i)
        for i, k in enumerate(counts)
    ]
    log_probs = torch.log_softmax(logits, dim=-1)
    for request, (token, logprob) in zip(batch, Sampler()(logits, batch)):
        if request.params.logprobs is None:
            assert logprob is None
            continue
        assert logprob.token_id == token
        assert logprob.logprob == pytest.approx(float(log_probs[request.row, token]), abs=1e-6)
        top = torch.topk(log_probs[request.row], request.params.logprobs)
        assert [t for t, _ in logprob.top] == top.indices.tolist()
        assert [v for _, v in logprob.top] == pytest.approx(top.values.tolist(), abs=1e-6)


class TorchCalls(TorchFunctionMode):
    """Records the name of every torch function and tensor method called inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", repr(func)))
        return func(*args, **(kwargs or {}))


def sampler_calls(logits: torch.Tensor, batch: list[SampleRequest]) -> list[str]:
    with TorchCalls() as calls:
        Sampler()(logits, batch)
    return calls.names


def every_kind(count: int) -> list[SampleRequest]:
    return [SampleRequest(i % 8, NEIGHBOUR_SETTINGS[i % len(NEIGHBOUR_SETTINGS)], noise_seed(i), i) for i in range(count)]


def test_a_step_is_the_same_few_tensor_ops_however_many_rows_sample():
    logits = mixed_logits(8)
    few, many = sampler_calls(logits, every_kind(6)), sampler_calls(logits, every_kind(300))
    assert few == many


def test_a_step_crosses_the_bridge_once_each_way_and_reads_back_once(monkeypatch):
    copies = []
    real_to_host = sampler_module._to_host
    monkeypatch.setattr(sampler_module, "_to_host", lambda copy: copies.append(copy) or real_to_host(copy))
    logits = mixed_logits(8)
    for batch in (every_kind(40), [r for r in every_kind(40) if r.params.logprobs is None], every_kind(1)):
        copies.clear()
        sampler = Sampler(bridge=Bridge(logits.device))
        with sampler._bridge.counting() as counted:
            sampler(logits, batch)
        assert len(copies) == 1
        assert (counted.h2d, counted.d2h) == (1, 1)


@pytest.mark.parametrize("ending", ["read", "failed"])
def test_a_sampler_used_alone_keeps_nothing_of_a_call_in_its_own_bridge(monkeypatch, ending):
    """Without an engine's bridge a sampler makes its own, which no engine scrubs: once a call has returned
    (or raised after its picks were fetched), no byte of it holds the call's settings, prompt marks, picks
    or logprobs, host side or device side; later calls, which may cross fewer bytes, would leave them."""
    vocab = 300
    logits = mixed_logits(6, vocab=vocab, seed=5)
    processors = LogitsProcessors(vocab, logits.device)
    params = [SamplingParams(temperature=0.8, repetition_penalty=1.5, logit_bias=((7, 2.0),), logprobs=3),
              SamplingParams(temperature=0.0, logprobs=5), SamplingParams(temperature=1.1, top_k=9)]
    batch = [SampleRequest(row, params[row % 3], noise_seed(row), row,
                           slot=processors.slots.take([11, 12, 13]) if params[row % 3].penalized else None)
             for row in range(6)]
    sampler = Sampler(processors)
    if ending == "failed":  # the picks were fetched; reading them fails
        def failing_read(copy):
            raise RuntimeError("device lost")

        monkeypatch.setattr(sampler_module, "_to_host", failing_read)
        with pytest.raises(RuntimeError, match="device lost"):
            sampler(logits, batch)
    else:
        assert len(sampler(logits, batch)) == len(batch)
    assert sampler._bridge.total.h2d_bytes and sampler._bridge.total.d2h_bytes
    for name, tensor in bridge_buffers(sampler._bridge).items():
        assert int(tensor.count_nonzero()) == 0, f"the sampler's own bridge keeps bytes of a call in its {name}"
    assert all(slot.reader is None for slot in sampler._bridge._slots)  # nor a download's values


def test_a_sampler_leaves_the_engines_bridge_to_the_engine():
    bridge = Bridge(torch.device("cpu"))
    sampler = Sampler(bridge=bridge)
    sampler(mixed_logits(8), every_kind(4))
    assert bridge._device_in.held  # the engine's to scrub when it goes idle, queued after its steps
    sampler.scrub()
    assert bridge._device_in.held


@pytest.mark.parametrize(
    ("settings", "sorts"),
    [({"min_p": 0.1}, 0), ({"temperature": 0.0, "top_p": 0.5}, 0), ({"top_k": 3}, 1), ({"top_p": 0.9}, 1)],
    ids=["min_p", "greedy-top_p", "top_k", "top_p"],
)
def test_the_sort_runs_only_when_a_drawn_row_uses_top_k_or_top_p(settings, sorts):
    batch = [SampleRequest(0, SamplingParams(**settings), noise_seed(1)), SampleRequest(1, SamplingParams(), noise_seed(2))]
    assert sampler_calls(mixed_logits(2), batch).count("sort") == sorts


def test_a_drawing_sample_without_a_seed_is_refused():
    with pytest.raises(EngineError, match="needs a seed"):
        Sampler()(mixed_logits(1), [SampleRequest(0, SamplingParams(temperature=1.0), seed=None)])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_picks_the_cpu_tokens_for_the_same_seeds_with_one_sync(monkeypatch):
    vocab = 32_000
    logits = mixed_logits(16, vocab=vocab, seed=9)
    batch = every_kind(200) + [
        SampleRequest(i % 16, SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.02), noise_seed(500 + i), i)
        for i in range(64)
    ]
    seeds, positions = torch.tensor([r.seed for r in batch]), torch.tensor([r.position for r in batch])
    assert torch.equal(draw_uniforms(seeds.cuda(), positions.cuda()).cpu(), draw_uniforms(seeds, positions))
    assert torch.equal(row_uniforms(seeds.cuda(), positions.cuda()).cpu(), row_uniforms(seeds, positions))

    on_cpu = Sampler()(logits, batch)
    on_device = logits.cuda()  # copied before the check: a pageable copy to the device waits for it
    Sampler()(on_device, batch)  # warm-up: kernels and the pinned-memory pool
    sampler = Sampler()
    with only_the_read_may_wait(monkeypatch) as reads:
        on_cuda = sampler(on_device, batch)
    # One asynchronous download through the bridge's pinned staging, waited for once.
    assert len(reads) == 1 and isinstance(reads[0], Download)
    assert staging_in_use_is_pinned(sampler._bridge)
    assert [token for token, _ in on_cuda] == [token for token, _ in on_cpu]
    for (_, cuda_logprob), (_, cpu_logprob) in zip(on_cuda, on_cpu):
        assert (cuda_logprob is None) == (cpu_logprob is None)
        if cpu_logprob is not None:
            assert cuda_logprob.logprob == pytest.approx(cpu_logprob.logprob, abs=1e-4)
