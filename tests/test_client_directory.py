"""The directory as the client reads it, and capacity-weighted sampling of candidates."""

from __future__ import annotations

import base64
import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from client.directory import DirectoryEntry, parse_directory, sample_candidates

SETTINGS = settings(max_examples=50, deadline=None)


def _entries(capacities: list[int]) -> list[DirectoryEntry]:
    return [DirectoryEntry(f"node-{i}", b"cfg", "{}", c) for i, c in enumerate(capacities)]


def _listing(**override) -> dict:
    node = {"node_id": "abc", "key_config": base64.b64encode(b"\x01\x00\x20").decode(), "evidence": "{}",
            "capacity": 4, "attestation_result": "jwt"}
    node.update(override)
    return {"version": 1, "nodes": [node], "policy_digest": "00" * 32}


def test_a_listing_parses_into_entries() -> None:
    directory = parse_directory(_listing(), fetched_at=1.0)
    assert directory.entries == (DirectoryEntry("abc", b"\x01\x00\x20", "{}", 4),)
    assert directory.policy_digest == "00" * 32 and directory.fetched_at == 1.0


@pytest.mark.parametrize("override", [
    {"capacity": -1}, {"capacity": True}, {"capacity": "4"}, {"node_id": 5}, {"key_config": "***"}, {"evidence": None},
])
def test_malformed_entries_are_refused(override: dict) -> None:
    with pytest.raises(ValueError):
        parse_directory(_listing(**override), fetched_at=0.0)


def test_an_unknown_version_is_refused() -> None:
    with pytest.raises(ValueError):
        parse_directory({**_listing(), "version": 2}, fetched_at=0.0)


@SETTINGS
@given(st.lists(st.integers(0, 9), max_size=12), st.integers(1, 8), st.integers(0, 2**32))
def test_candidates_are_distinct_have_capacity_and_fill_k(capacities: list[int], k: int, seed: int) -> None:
    entries = _entries(capacities)
    chosen = sample_candidates(entries, k, random.Random(seed))
    ids = [entry.node_id for entry in chosen]
    assert len(ids) == len(set(ids))
    assert all(entry.capacity > 0 for entry in chosen)
    assert len(chosen) == min(k, sum(1 for c in capacities if c > 0))


def test_first_draws_follow_capacity_shares() -> None:
    capacities = [1, 2, 3, 6]
    rng = random.Random(1234)
    draws = 24_000
    first = Counter(sample_candidates(_entries(capacities), 2, rng)[0].node_id for _ in range(draws))
    total = sum(capacities)
    for index, capacity in enumerate(capacities):
        expected = draws * capacity / total
        # five standard deviations of a binomial count: fails only if the weighting is wrong
        sigma = (draws * capacity / total * (1 - capacity / total)) ** 0.5
        assert abs(first[f"node-{index}"] - expected) < 5 * sigma


def test_second_draws_are_weighted_among_the_rest() -> None:
    # With capacities 1 and 3 besides a node taking the first draw, the second draw's share
    # must follow the remaining capacity: P(second = node-2 | first = node-0) = 3 / 4.
    rng = random.Random(99)
    seconds = Counter()
    for _ in range(20_000):
        first, second = sample_candidates(_entries([4, 1, 3]), 2, rng)
        if first.node_id == "node-0":
            seconds[second.node_id] += 1
    share = seconds["node-2"] / sum(seconds.values())
    assert abs(share - 0.75) < 0.02


def test_zero_capacity_is_never_drawn_and_k_must_be_positive() -> None:
    rng = random.Random(0)
    assert all(sample_candidates(_entries([0, 5, 0]), 3, rng)[0].node_id == "node-1" for _ in range(50))
    assert sample_candidates(_entries([0, 0]), 2, rng) == []
    with pytest.raises(ValueError):
        sample_candidates(_entries([1]), 0, rng)


def test_the_default_randomness_is_the_systems() -> None:
    chosen = {sample_candidates(_entries([1] * 8), 1)[0].node_id for _ in range(200)}
    assert len(chosen) > 4
