"""Speculative decoding: request-scoped n-gram drafts, and verification by rejection sampling whose emitted
tokens follow the target's distribution (chi-square, as the sampler's draws are tested)."""

from __future__ import annotations

import dataclasses
import gc
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import EngineConfig, FinishReason, LLMEngine, SamplingParams
from engine.draft_model import DraftedSample, DraftPlan, DraftRequest
from engine.errors import EngineError
from engine.sampling_params import StructuredOutput
from engine.ngram_draft import NgramDrafter
from engine.scheduler import ScheduledChunk
from engine.sampler import SampleRequest, Sampler
from engine.spec_rejection import verify_deterministic, verify_greedy, verify_sampled
from engine.speculative import SpeculativeBatch, SpeculativePicks, VerifyPlan, VerifyRequest
from tests.engine_models import (  # noqa: F401 (fixtures)
    REFERENCE_NAMES,
    greedy,
    hf_greedy,
    one_torch_thread,
    output_tokens,
    random_lengths,
    random_prompts,
    reference_models,
    small_vocab_model_dir,
    tiny_engine,
    tiny_model_dir,
)
from engine.tiny import write_tiny_model
from tests.test_engine_sampling import _stop_string_case as stop_string_case

# ----- n-gram drafts ------------------------------------------------------------------------


def test_ngram_drafts_continue_the_latest_earlier_occurrence_of_the_suffix():
    drafter = NgramDrafter(num_speculative_tokens=3, max_ngram=2)
    #          the suffix (5, 6) occurs at 1 and at 6; the latest is followed by 9, 9, 4
    tokens = [1, 5, 6, 7, 8, 2, 5, 6, 9, 9, 4, 5, 6]
    assert drafter.propose(tokens) == [9, 9, 4]
    assert drafter.propose(tokens, limit=2) == [9, 9]
    assert drafter.propose(tokens, limit=0) == []


def test_ngram_drafts_prefer_the_longest_pattern_and_fall_back_to_shorter_ones():
    drafter = NgramDrafter(num_speculative_tokens=2, max_ngram=3)
    # (3, 4) last occurred before 8, but (2, 3, 4) only before 7: the longer match wins.
    assert drafter.propose([2, 3, 4, 7, 1, 3, 4, 8, 2, 3, 4]) == [7, 1]
    # Only the last token (4) recurs: a 1-gram match.
    assert drafter.propose([4, 9, 1, 2, 4]) == [9, 1]


def test_ngram_drafts_are_empty_without_a_match_and_stop_at_the_sequence_end():
    drafter = NgramDrafter(num_speculative_tokens=4, max_ngram=3)
    assert drafter.propose([1, 2, 3, 4, 5]) == []
    assert drafter.propose([7]) == []
    # A token repeating: the match one back proposes what is there, never past the end.
    assert drafter.propose([3, 7, 7]) == [7]


def test_the_drafter_holds_no_tokens_between_proposals():
    drafter = NgramDrafter(num_speculative_tokens=3)
    before = dataclasses.astuple(drafter)
    assert drafter.propose([1, 2, 3, 1, 2]) == [3, 1, 2]
    # Its only state is its settings (frozen, slotted): nothing of a request's tokens stays on it.
    assert dataclasses.astuple(drafter) == before
    assert not hasattr(drafter, "__dict__")
    assert drafter.propose([4, 5, 6]) == []


@pytest.mark.parametrize("settings", [{"num_speculative_tokens": 0}, {"num_speculative_tokens": 2, "min_ngram": 0},
                                      {"num_speculative_tokens": 2, "min_ngram": 3, "max_ngram": 2}])
def test_bad_drafter_settings_are_engine_errors(settings):
    with pytest.raises(EngineError):
        NgramDrafter(**settings)


# ----- greedy verification ------------------------------------------------------------------


def test_greedy_verification_accepts_the_run_of_drafts_equal_to_the_argmax():
    logits = torch.randn(4, 4, 10, generator=torch.Generator().manual_seed(0))
    best = logits.argmax(dim=-1)
    drafts = best[:, :3].clone()
    drafts[1, 1] = (best[1, 1] + 1) % 10  # row 1 diverges at its second draft
    drafts[2, 0] = (best[2, 0] + 1) % 10  # row 2 at its first
    lengths = torch.tensor([3, 3, 3, 2])  # row 3 proposed two drafts only
    tokens, counts = verify_greedy(logits, drafts, lengths)
    assert counts.tolist() == [4, 2, 1, 3]
    for row, count in enumerate(counts.tolist()):
        # What plain greedy decoding emits: the argmax at each position, the first mismatch corrected.
        assert tokens[row, :count].tolist() == best[row, :count].tolist()


def test_greedy_verification_ranks_nan_last():
    logits = torch.zeros(1, 2, 5)
    logits[0, :, 2] = 1.0
    logits[0, 0, 4] = torch.nan
    tokens, counts = verify_greedy(logits, torch.tensor([[2]]), torch.tensor([1]))
    assert counts.tolist() == [2] and tokens[0].tolist() == [2, 2]


# ----- sampled verification: the target's distribution --------------------------------------

FIVE = torch.tensor([0.4, 0.25, 0.15, 0.12, 0.08], dtype=torch.float64)
OTHER = torch.tensor([0.1, 0.1, 0.5, 0.05, 0.25], dtype=torch.float64)  # a draft that disagrees with FIVE
ROWS = 20_000


def seeds(count: int, salt: int = 0) -> torch.Tensor:
    return torch.tensor([(k * 0x9E3779B97F4A7C15 + 12345 + salt) % (1 << 62) for k in range(count)])


def assert_follows(tokens: torch.Tensor, expected: torch.Tensor) -> None:
    counts = torch.bincount(tokens, minlength=len(expected)).double()
    total = counts.sum()
    expected_counts = expected / expected.sum() * total
    chi_square = ((counts - expected_counts) ** 2 / expected_counts).sum()
    degrees = len(expected) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(degrees / 2), chi_square / 2))
    assert p_value > 1e-4, f"chi-square {float(chi_square):.1f} on {degrees} degrees of freedom"


def run_verify(draft: torch.Tensor | None, k: int, rows: int = ROWS, salt: int = 0):
    """Verifies k drafts per row against FIVE at every position; drafts drawn from `draft` (None: always 3)."""
    probs = FIVE.float().expand(rows, k + 1, 5).contiguous()
    if draft is None:
        drafts, draft_probs = torch.full((rows, k), 3), None
    else:
        generator = torch.Generator().manual_seed(salt + 1)
        drafts = torch.multinomial(draft.float(), rows * k, replacement=True, generator=generator).view(rows, k)
        draft_probs = draft.float().expand(rows, k, 5).contiguous()
    positions, lengths = torch.arange(rows) % 17, torch.full((rows,), k)
    if draft is None:
        return verify_deterministic(probs, drafts, lengths, seeds(rows, salt), positions), drafts
    return verify_sampled(probs, drafts, lengths, seeds(rows, salt), positions, draft_probs), drafts


@pytest.mark.parametrize("draft", [None, OTHER, FIVE], ids=["deterministic", "disagreeing", "agreeing"])
def test_the_first_emitted_token_follows_the_target_whatever_the_draft(draft):
    (tokens, counts), _ = run_verify(draft, k=2)
    assert_follows(tokens[:, 0], FIVE)


@pytest.mark.parametrize("draft", [None, OTHER], ids=["deterministic", "disagreeing"])
def test_the_second_token_follows_the_target_too(draft):
    (tokens, counts), _ = run_verify(draft, k=2, salt=7)
    emitted_two = counts >= 2
    assert emitted_two.sum() > 1000
    assert_follows(tokens[emitted_two, 1], FIVE)


def test_acceptance_is_the_overlap_of_target_and_draft():
    # One-hot draft of token 3: accepted with probability p(3) = 0.12.
    (_, counts), _ = run_verify(None, k=1)
    rate = float((counts == 2).double().mean())
    assert abs(rate - 0.12) < 0.015
    # A draft drawn from q is accepted with probability sum(min(p, q)) = 0.1+0.1+0.15+0.05+0.08 = 0.48.
    (_, counts), _ = run_verify(OTHER, k=1, salt=3)
    assert abs(float((counts == 2).double().mean()) - 0.48) < 0.02


def test_a_draft_with_the_targets_distribution_is_always_accepted():
    (tokens, counts), drafts = run_verify(FIVE, k=3, rows=500)
    assert counts.tolist() == [4] * 500
    assert torch.equal(tokens[:, :3], drafts)


def test_a_rejected_deterministic_draft_is_never_emitted_in_its_place():
    (tokens, counts), drafts = run_verify(None, k=1)
    rejected = counts == 1
    assert rejected.sum() > 0 and (tokens[rejected, 0] != 3).all()


def test_deterministic_drafts_emit_the_tokens_plain_sampling_draws():
    logits = torch.randn(6, 3, 40, generator=torch.Generator().manual_seed(8))
    params = SamplingParams(temperature=0.8, seed=1)
    row_seeds, positions = seeds(6, salt=9), torch.arange(6) * 5
    plain = [[token for token, _ in Sampler()(logits[row], [
        SampleRequest(i, params, int(row_seeds[row]), int(positions[row]) + i) for i in range(3)])] for row in range(6)]
    drafts = torch.tensor(plain)[:, :2].clone()
    drafts[1, 0] = (drafts[1, 0] + 1) % 40  # row 1 is rejected at once, row 2 after one draft
    drafts[2, 1] = (drafts[2, 1] + 1) % 40
    tokens, counts = verify_deterministic(torch.softmax(logits / 0.8, dim=-1), drafts, torch.full((6,), 2),
                                          row_seeds, positions)
    assert counts.tolist() == [3, 1, 2, 3, 3, 3]
    for row in range(6):
        assert tokens[row, : counts[row]].tolist() == plain[row][: counts[row]]


def test_a_seeded_rows_verification_does_not_depend_on_its_batch():
    probs = torch.softmax(torch.randn(9, 4, 50, generator=torch.Generator().manual_seed(2)), dim=-1)
    drafts = torch.randint(0, 50, (9, 3), generator=torch.Generator().manual_seed(3))
    lengths = torch.tensor([3, 1, 2, 3, 0, 3, 2, 3, 1])
    row_seeds, positions = seeds(9, salt=5), torch.arange(9) * 3
    tokens, counts = verify_sampled(probs, drafts, lengths, row_seeds, positions)
    for row in range(9):
        one = slice(row, row + 1)
        alone, count = verify_sampled(probs[one], drafts[one], lengths[one], row_seeds[one], positions[one])
        assert count.item() == counts[row].item()
        assert alone[0, : count.item()].tolist() == tokens[row, : count.item()].tolist()
    assert counts[4].item() == 1  # no drafts: the bonus token alone


# ----- the engine ---------------------------------------------------------------------------

SPECULATIVE = {"speculative": "ngram", "num_speculative_tokens": 3}
BUDGET = 32
# 20 blocks of 4 tokens: far less than the batch needs at once, so it must preempt (as the parity tests do).
CROWDED = {"num_blocks": 20, "block_size": 4, "max_num_batched_tokens": BUDGET}


@pytest.fixture(scope="module")
def batch() -> tuple[list[list[int]], list[int]]:
    prompts = random_prompts(18, 3, 45, seed=1)
    prompts[0] = random_prompts(1, BUDGET + 9, BUDGET + 9, seed=2)[0]  # prefilled in chunks for sure
    return prompts, random_lengths(18, 1, 30, seed=3)


def chunk_recorder(engine: LLMEngine) -> list[list[tuple[int, int, int]]]:
    """Each step's chunks as (tokens, drafts, computed before), from the real scheduler."""
    steps: list[list[tuple[int, int, int]]] = []
    schedule = engine.scheduler.schedule

    def recording():
        chunks = schedule()
        steps.append([(c.num_tokens, len(c.draft), c.seq.num_computed_tokens) for c in chunks])
        return chunks

    engine.scheduler.schedule = recording
    return steps


@pytest.mark.parametrize(("name", "drafts"), [(name, "ngram") for name in REFERENCE_NAMES]
                         + [(name, name) for name in REFERENCE_NAMES] + [("llama", "qwen3")])
def test_greedy_speculation_matches_transformers_under_batching_chunking_and_preemption(name, drafts, batch,
                                                                                        reference_models):
    """n-gram drafts, the target as its own draft, and another family's model as draft."""
    prompts, max_tokens = batch
    reference = reference_models[name]
    expected = [hf_greedy(reference.model, p, n) for p, n in zip(prompts, max_tokens)]
    speculative = "ngram" if drafts == "ngram" else f"draft:{reference_models[drafts].folder}"
    engine = LLMEngine(reference.folder, EngineConfig(**CROWDED, speculative=speculative, num_speculative_tokens=3))
    steps = chunk_recorder(engine)
    produced = output_tokens(engine, prompts, [greedy(n) for n in max_tokens])
    for index, (got, want) in enumerate(zip(produced, expected)):
        assert got == want, f"request {index} differs from transformers"
    assert engine.scheduler.num_preemptions > 0
    assert any(tokens > 1 and tokens < BUDGET for step in steps for tokens, _, _ in step)  # a partial prefill
    # Drafted and plain rows in one step.
    assert any(any(d for _, d, _ in step) and any(not d for _, d, _ in step) for step in steps)
    stats = engine.speculation
    if drafts == name:  # the target as its own draft: every draft is accepted
        assert stats.drafted > 0 and stats.accepted == stats.drafted
    elif drafts == "ngram":
        assert stats.accepted > 0
    else:  # two random models agree on nothing: every draft is rejected, and the tokens are still the target's
        assert stats.drafted > 0
    assert engine.residue_check() == []


def test_greedy_speculation_emits_what_plain_decoding_does_with_fewer_steps():
    prompts = random_prompts(6, 4, 24, seed=21)
    params = [greedy(n) for n in (40, 33, 25, 40, 12, 40)]
    plain = tiny_engine(num_blocks=64, block_size=4)
    speculative = tiny_engine(num_blocks=64, block_size=4, **SPECULATIVE)
    expected = output_tokens(plain, prompts, params)
    assert output_tokens(speculative, prompts, params) == expected
    assert speculative.runner.bridge.steps < plain.runner.bridge.steps
    stats = speculative.speculation
    assert 0 < stats.accepted < stats.drafted and stats.emitted == stats.accepted + stats.rows


def test_plain_rows_beside_drafted_ones_pick_what_they_pick_without_speculation():
    """Penalties and grammars are never drafted for: their tokens are the plain engine's, in a mixed batch."""
    prompts = random_prompts(6, 4, 20, seed=23)
    params = [
        greedy(30),
        greedy(20, logprobs=2),
        SamplingParams(max_tokens=20, temperature=0.8, seed=4, ignore_eos=True, presence_penalty=0.5),
        SamplingParams(max_tokens=20, temperature=0.8, seed=5, ignore_eos=True, logit_bias=((5, 2.0),)),
        SamplingParams(max_tokens=20, temperature=0.7, n=3, seed=6, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0.9, seed=7, structured=StructuredOutput("regex", "(ab|cd){2,6}x")),
    ]
    plain = tiny_engine(num_blocks=96, block_size=4).generate(prompts, params)
    speculative_engine = tiny_engine(num_blocks=96, block_size=4, **SPECULATIVE)
    speculative = speculative_engine.generate(prompts, params)
    for index in (0, 1, 2, 3, 5):
        assert speculative[index].outputs[0].token_ids == plain[index].outputs[0].token_ids
    assert re.fullmatch("(ab|cd){2,6}x", speculative[5].outputs[0].text)
    assert [lp.logprob for lp in speculative[1].outputs[0].logprobs] == pytest.approx(
        [lp.logprob for lp in plain[1].outputs[0].logprobs], abs=1e-4)
    assert [len(o.token_ids) for o in speculative[4].outputs] == [20, 20, 20]
    assert speculative_engine.speculation.drafted > 0


# A ban, a boost, and one token biased twice (the entries add up, in order, as the sampler adds them).
BIAS = ((7, -100.0), (11, 3.5), (20, 1.25), (20, -0.5))


@pytest.mark.parametrize("draft", ["ngram", "target-as-draft", "other-draft"])
def test_biased_samples_are_drafted_for_and_emit_what_plain_decoding_does(draft, other_draft):
    prompts = random_prompts(3, 4, 20, seed=27)
    params = [greedy(36, logit_bias=BIAS, logprobs=2),
              SamplingParams(max_tokens=36, temperature=0.8, seed=3, ignore_eos=True, logit_bias=BIAS),
              SamplingParams(max_tokens=36, temperature=0.9, top_p=0.9, seed=4, ignore_eos=True,
                             logit_bias=((5, 4.0),))]
    config = {"num_blocks": 96, "block_size": 4}
    if draft == "ngram":
        kind, engine = "inverse", tiny_engine(**config, **SPECULATIVE)
    else:
        kind = "race"
        engine = draft_engine(tiny_model_dir() if draft == "target-as-draft" else other_draft, **config)
    plain = tiny_engine(**config, sampling_draw=kind).generate(prompts, params)
    speculative = engine.generate(prompts, params)
    for got, want in zip(speculative, plain):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert 7 not in [t for r in speculative[:2] for t in r.outputs[0].token_ids]  # the ban held at every position
    # Logprobs stay the model's own, before the bias.
    assert [lp.logprob for lp in speculative[0].outputs[0].logprobs] == pytest.approx(
        [lp.logprob for lp in plain[0].outputs[0].logprobs], abs=1e-4)
    stats = engine.speculation  # every sample is biased: they were drafted for, and drafts held
    # The target as its own draft drafts under the same bias, so it is always accepted.
    assert stats.accepted == stats.drafted > 0 if draft == "target-as-draft" else stats.accepted > 0


@pytest.mark.parametrize("alternatives", [0, 3])
def test_logprobs_of_accepted_tokens_are_the_targets_own(alternatives):
    prompts = random_prompts(3, 4, 20, seed=26)
    params = [greedy(30, logprobs=alternatives),
              SamplingParams(max_tokens=30, temperature=0.8, seed=3, ignore_eos=True, logprobs=alternatives)]
    plain = tiny_engine(num_blocks=64, block_size=4).generate(prompts[:2], params)
    engine = tiny_engine(num_blocks=64, block_size=4, **SPECULATIVE)
    speculative = engine.generate(prompts[:2], params)
    assert engine.speculation.accepted > 0
    for got, want in zip(speculative, plain):
        got, want = got.outputs[0], want.outputs[0]
        assert got.token_ids == want.token_ids
        assert [lp.token_id for lp in got.logprobs] == got.token_ids
        assert [lp.logprob for lp in got.logprobs] == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-4)
        assert [[i for i, _ in lp.top] for lp in got.logprobs] == [[i for i, _ in lp.top] for lp in want.logprobs]
        assert all(len(lp.top) == alternatives for lp in got.logprobs)


def test_a_seeded_speculative_sample_gives_the_same_tokens_in_any_batch_mix():
    prompts = random_prompts(4, 4, 20, seed=25)
    seeded = SamplingParams(max_tokens=24, temperature=0.6, top_k=30, seed=42, ignore_eos=True)
    alone_engine = tiny_engine(num_blocks=64, block_size=4, **SPECULATIVE)
    alone = alone_engine.generate([prompts[0]], seeded)[0].outputs[0].token_ids
    assert alone_engine.speculation.drafted > 0
    crowded = tiny_engine(num_blocks=14, block_size=4, max_num_batched_tokens=8, **SPECULATIVE)
    others = [SamplingParams(max_tokens=14, temperature=0.9, seed=s, ignore_eos=True) for s in (1, 2)]
    outputs = crowded.generate([prompts[1], prompts[0], prompts[2], prompts[3]],
                               [others[0], seeded, greedy(12), others[1]])
    assert crowded.scheduler.num_preemptions > 0
    assert outputs[1].outputs[0].token_ids == alone
    # Drafts only decide how many tokens a step emits: the tokens are those plain sampling draws.
    assert tiny_engine(num_blocks=64, block_size=4).generate([prompts[0]], seeded)[0].outputs[0].token_ids == alone


def test_stop_tokens_and_max_tokens_cut_accepted_drafts():
    prompt = random_prompts(1, 6, 6, seed=27)[0]
    full = output_tokens(tiny_engine(num_blocks=64, block_size=4), [prompt], greedy(40))[0]
    speculative = tiny_engine(num_blocks=64, block_size=4, **SPECULATIVE)
    for length in (1, 2, 7, 19):
        assert output_tokens(speculative, [prompt], greedy(length))[0] == full[:length]
    k = next(k for k in range(10, len(full)) if full[k] not in full[:k] and full[k] in full[k + 1 :] or k == 39)
    stopped = speculative.generate([prompt], greedy(40, stop_token_ids=(full[k],)))[0].outputs[0]
    assert stopped.token_ids == full[:k]


def test_a_stop_string_cuts_the_text_where_plain_decoding_does():
    """The target as its own draft drafts at every step, so the stop string falls among accepted drafts."""
    plain = tiny_engine(num_blocks=64, block_size=4)
    prompt, _, stop, before = stop_string_case(plain)
    engine = draft_engine(tiny_model_dir(), num_blocks=64, block_size=4)
    engine.add_request(prompt, greedy(24, stop=(stop,)))
    streamed, reasons = "", []
    for delta in engine.stream():
        streamed += delta.text
        reasons.append(delta.finish_reason)
        assert stop not in streamed
    assert streamed == before and reasons[-1] is FinishReason.STOP
    assert engine.speculation.drafted > 0


def test_blocks_of_rejected_drafts_are_freed_and_zeroed_every_step():
    engine = tiny_engine(num_blocks=64, block_size=2, **SPECULATIVE)
    for prompt, n in zip(random_prompts(4, 3, 10, seed=29), (30, 25, 20, 35)):
        engine.add_request(prompt, greedy(n))
    trimmed = 0
    while engine.has_unfinished():
        engine.step()
        for seq in engine.scheduler.running:
            # Whatever drafts it rejected, a sequence holds the blocks of its computed tokens only.
            assert len(seq.block_table) == engine.block_manager.blocks_for(seq.num_computed_tokens)
        assert engine.residue_check() == []
        trimmed += engine.block_manager.blocks_scrubbed
    assert engine.speculation.drafted > engine.speculation.accepted > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_nothing_of_a_requests_drafts_is_reachable_after_it_ends():
    engine = tiny_engine(num_blocks=64, block_size=4, **SPECULATIVE)
    engine.add_request(random_prompts(1, 8, 8, seed=31)[0], greedy(30))
    kinds = (ScheduledChunk, VerifyRequest, SpeculativeBatch, SpeculativePicks, VerifyPlan)
    while engine.has_unfinished():
        engine.step()
        # Not even the step outlives itself: the next one drafts afresh from the sample's tokens.
        gc.collect()
        assert not [o for o in gc.get_objects() if type(o) in kinds]
    assert engine.speculation.steps > 0


def test_speculation_settings_are_checked_by_name():
    with pytest.raises(EngineError, match="speculative"):
        EngineConfig(speculative="database")
    with pytest.raises(EngineError, match="num_speculative_tokens"):
        EngineConfig(speculative="ngram", num_speculative_tokens=0)


# ----- draft-model speculation --------------------------------------------------------------


def draft_engine(draft: Path, **config) -> LLMEngine:
    return LLMEngine(tiny_model_dir(), EngineConfig(speculative=f"draft:{draft}", num_speculative_tokens=3, **config))


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The target with noise on its output head: a draft of the same tokenizer that agrees with it only
    now and then (two independent random models never agree)."""
    folder = tmp_path_factory.mktemp("draft") / "perturbed"
    shutil.copytree(tiny_model_dir(), folder)
    weights = load_file(folder / "model.safetensors")
    head = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"
    noise = torch.randn(weights[head].shape, generator=torch.Generator().manual_seed(5))
    weights[head] = weights[head] + noise * weights[head].std() * 1.5
    save_file(weights, folder / "model.safetensors")
    return folder


@pytest.mark.parametrize("kind", ["race", "inverse"])
@pytest.mark.parametrize("own", [True, False], ids=["target-as-draft", "other-draft"])
def test_sampled_draft_speculation_emits_what_plain_sampling_draws(own, kind, other_draft):
    """Under either kind of draw (a draft-model engine races unless told otherwise)."""
    prompts = random_prompts(4, 4, 20, seed=35)
    params = [SamplingParams(max_tokens=24, temperature=0.8, top_k=40, seed=s, ignore_eos=True) for s in (1, 2)] + [
        greedy(20), SamplingParams(max_tokens=16, temperature=1.1, top_p=0.9, n=3, seed=4, ignore_eos=True)]
    plain = tiny_engine(num_blocks=96, block_size=4, sampling_draw=kind).generate(prompts, params)
    chosen = {} if kind == "race" else {"sampling_draw": kind}
    engine = draft_engine(tiny_model_dir() if own else other_draft, num_blocks=16, block_size=4,
                          max_num_batched_tokens=12, **chosen)
    assert engine.sampler.draw_kind == kind
    speculative = engine.generate(prompts, params)
    assert engine.scheduler.num_preemptions > 0
    for got, want in zip(speculative, plain):
        assert [o.token_ids for o in got.outputs] == [o.token_ids for o in want.outputs]
    stats = engine.speculation
    assert stats.accepted == stats.drafted > 0 if own else 0 < stats.accepted < stats.drafted


def test_a_draft_model_engine_races_because_racing_drafts_agree_more_often(other_draft):
    """The race couples the draft's draw with the target's; inverse transform, through cumulative sums in
    token order, much less: the same sampled requests accept more drafts racing."""
    prompts = random_prompts(8, 4, 20, seed=36)
    params = [SamplingParams(max_tokens=32, temperature=0.8, seed=s, ignore_eos=True) for s in range(8)]
    rates = {}
    for kind in ("race", "inverse"):
        engine = draft_engine(other_draft, sampling_draw=kind)
        engine.generate(prompts, params)
        rates[kind] = engine.speculation.accepted / engine.speculation.drafted
    assert rates["race"] > 2 * rates["inverse"], rates
    assert EngineConfig(speculative="draft:/models/small").draw_kind == "race"
    assert EngineConfig(speculative="ngram").draw_kind == EngineConfig().draw_kind == "inverse"


def test_the_drafts_kv_lives_in_the_targets_blocks_and_is_zeroed_with_them(other_draft):
    engine = draft_engine(other_draft, num_blocks=48, block_size=2)
    draft_cache = engine.runner.draft.kv_cache
    assert draft_cache.shape[1] == engine.runner.kv_cache.shape[1]  # the same blocks
    for prompt, n in zip(random_prompts(4, 3, 10, seed=37), (24, 18, 12, 30)):
        engine.add_request(prompt, greedy(n))
    written = False
    while engine.has_unfinished():
        engine.step()
        held = sorted({b for seq in engine.scheduler.running for b in seq.block_table})
        written |= bool(held) and bool(draft_cache[:, held].abs().sum() > 0)
        for seq in engine.scheduler.running:
            assert len(seq.block_table) == engine.block_manager.blocks_for(seq.num_computed_tokens)
        assert engine.residue_check() == []  # both tensors: every free block is zero in each
    assert written and engine.speculation.drafted > 0
    assert float(draft_cache.abs().sum()) == 0.0 and float(engine.runner.kv_cache.abs().sum()) == 0.0


def test_nothing_of_a_draft_models_work_is_reachable_after_a_step(other_draft):
    engine = draft_engine(other_draft, num_blocks=64, block_size=4)
    engine.add_request(random_prompts(1, 8, 8, seed=39)[0], SamplingParams(max_tokens=20, temperature=0.9, seed=3))
    kinds = (ScheduledChunk, VerifyRequest, SpeculativeBatch, SpeculativePicks, VerifyPlan, DraftRequest,
             DraftedSample, DraftPlan)
    while engine.has_unfinished():
        engine.step()
        gc.collect()
        assert not [o for o in gc.get_objects() if type(o) in kinds]
    assert engine.speculation.steps > 0


def test_a_draft_of_another_tokenizer_is_refused(tmp_path):
    with pytest.raises(EngineError, match="vocabulary"):
        draft_engine(small_vocab_model_dir(), num_blocks=16)
    other = tmp_path / "other-tokenizer"
    shutil.copytree(tiny_model_dir(), other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    tokenizer["added_tokens"] = tokenizer["added_tokens"][:-1]
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(EngineError, match="tokenizer"):
        draft_engine(other, num_blocks=16)
    with pytest.raises(EngineError, match="speculative"):
        EngineConfig(speculative="draft:")
    short = tmp_path / "short-context"
    shutil.copytree(tiny_model_dir(), short)
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 64}))
    with pytest.raises(EngineError, match="context"):
        draft_engine(short, num_blocks=16)
    assert draft_engine(short, num_blocks=16, max_model_len=64).runner.draft is not None
