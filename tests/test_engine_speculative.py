"""Speculative decoding: request-scoped n-gram drafts, and verification by rejection sampling whose emitted
tokens follow the target's distribution (chi-square, as the sampler's draws are tested)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.errors import EngineError
from engine.ngram_draft import NgramDrafter
from engine.spec_rejection import verify_greedy, verify_sampled

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
    positions = torch.arange(rows) % 17
    return verify_sampled(probs, drafts, torch.full((rows,), k), seeds(rows, salt), positions, draft_probs), drafts


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
