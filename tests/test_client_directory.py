"""The directory as the client reads it, and capacity-weighted sampling of candidates."""

from __future__ import annotations

import base64
import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from client.directory import (DirectoryEntry, capped, listed_models, model_pool, parse_directory, request_task,
                              sample_candidates, serving)
from client.errors import ModelNotFoundError, ModelTaskError

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


def test_a_listing_says_which_models_each_node_serves() -> None:
    [entry] = parse_directory(_listing(models=["alpha", "beta"]), fetched_at=0.0).entries
    assert entry.models == ("alpha", "beta")
    [unstated] = parse_directory(_listing(), fetched_at=0.0).entries
    assert unstated.models is None


@pytest.mark.parametrize("models", ["alpha", [1], {"alpha": 1}, [None]])
def test_malformed_model_lists_are_refused(models: object) -> None:
    with pytest.raises(ValueError):
        parse_directory(_listing(models=models), fetched_at=0.0)


def test_a_uniform_pick_lands_on_each_node_with_its_share_of_its_models_pool_and_never_elsewhere() -> None:
    # Per model pool, the bound of the test above: C_i / sum C over the nodes serving the model.
    pools = {"alpha": [1, 2, 3, 3, 4], "beta": [5, 5]}  # no alpha node above 1/k of its pool
    entries = [DirectoryEntry(f"{model}-{i}", b"cfg", "{}", c, (model,))
               for model, capacities in pools.items() for i, c in enumerate(capacities)]
    assert listed_models(entries) == ["alpha", "beta"]
    draws, rng = 24_000, random.Random(11)
    served = Counter(rng.choice(sample_candidates(serving(entries, "alpha"), 3, rng)).node_id for _ in range(draws))
    assert not any(node.startswith("beta") for node in served)
    for index, capacity in enumerate(pools["alpha"]):
        p = capacity / sum(pools["alpha"])
        assert abs(served[f"alpha-{index}"] - draws * p) < _binomial_bound(draws, p)


def test_nodes_that_state_no_models_may_serve_any_and_an_unlisted_model_has_no_pool() -> None:
    stated, unstated = DirectoryEntry("a", b"cfg", "{}", 1, ("alpha",)), DirectoryEntry("u", b"cfg", "{}", 1)
    assert serving([stated, unstated], "alpha") == [stated, unstated]
    assert serving([stated, unstated], "beta") == [unstated]
    assert serving([stated], "beta") == []
    assert serving([stated], None) == [stated]


def test_a_listing_states_each_nodes_task_and_one_without_generates() -> None:
    [embedding] = parse_directory(_listing(models=["alpha"], task="embed"), fetched_at=0.0).entries
    [unstated] = parse_directory(_listing(models=["alpha"]), fetched_at=0.0).entries
    assert (embedding.task, unstated.task) == ("embed", "generate")
    with pytest.raises(ValueError):
        parse_directory(_listing(task=["embed"]), fetched_at=0.0)


def test_a_request_is_drawn_among_the_nodes_whose_model_does_its_task() -> None:
    generating = DirectoryEntry("g", b"cfg", "{}", 1, ("alpha",))
    embedding = DirectoryEntry("e", b"cfg", "{}", 1, ("alpha", "beta"), task="embed")
    unstated = DirectoryEntry("u", b"cfg", "{}", 1)
    entries = [generating, embedding, unstated]
    assert request_task("POST", "/v1/embeddings") == "embed" and request_task("POST", "/v1/responses") == "generate"
    assert request_task("GET", "/v1/models") is None
    assert model_pool(entries, "alpha", "embed") == [embedding, unstated]
    assert model_pool(entries, "alpha", "generate") == [generating, unstated]
    assert model_pool(entries, "alpha", None) == entries
    with pytest.raises(ModelTaskError) as refused:  # beta embeds only: a chat request for it is sent nowhere
        model_pool([generating, embedding], "beta", "generate")
    assert (refused.value.code, refused.value.param) == ("model_not_generation", "model")
    with pytest.raises(ModelTaskError) as refused:
        model_pool([generating], "alpha", "embed")
    assert refused.value.code == "model_not_embedding"
    with pytest.raises(ModelNotFoundError):
        model_pool([generating, embedding], "gamma", "embed")


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


def _binomial_bound(draws: int, p: float) -> float:
    # five standard deviations of a binomial count: fails only if the probabilities are wrong
    return 5 * (draws * p * (1 - p)) ** 0.5


def test_each_node_is_included_with_k_times_its_capacity_share() -> None:
    capacities = [1, 2, 3, 4, 6]
    k, draws, total = 2, 24_000, sum(capacities)
    rng = random.Random(1234)
    included = Counter(e.node_id for _ in range(draws) for e in sample_candidates(_entries(capacities), k, rng))
    for index, capacity in enumerate(capacities):
        p = k * capacity / total
        assert abs(included[f"node-{index}"] - draws * p) < _binomial_bound(draws, p)


def test_a_uniform_pick_among_candidates_lands_on_each_node_with_its_capacity_share() -> None:
    # The non-targetability bound: the gateway picks uniformly among the client's candidates,
    # so the route must reach node i with probability C_i / sum C, small nodes included.
    capacities = [1, 1, 2, 3, 5, 8, 9]  # no node above 1/k of the total
    draws, total = 30_000, sum(capacities)
    rng = random.Random(7)
    served = Counter(rng.choice(sample_candidates(_entries(capacities), 3, rng)).node_id for _ in range(draws))
    for index, capacity in enumerate(capacities):
        p = capacity / total
        assert abs(served[f"node-{index}"] - draws * p) < _binomial_bound(draws, p)


def test_a_node_above_one_kth_of_capacity_is_always_a_candidate() -> None:
    rng = random.Random(3)
    for _ in range(500):
        chosen = sample_candidates(_entries([10, 1, 1, 1, 1]), 3, rng)
        assert "node-0" in {e.node_id for e in chosen} and len(chosen) == 3


def test_an_inflated_capacity_counts_for_no_more_than_the_policys_maximum() -> None:
    # Eight honest nodes of 16 and one the gateway claims has a million: uncapped, it is in every
    # candidate set; capped at the policy's 16, it is in k * 16 / 144 of them, like the others.
    entries = _entries([1_000_000] + [16] * 8)
    k, draws = 3, 12_000
    rng = random.Random(5)
    uncapped = sum("node-0" in {e.node_id for e in sample_candidates(entries, k, rng)} for _ in range(draws))
    assert uncapped == draws
    fair = capped(entries, 16)
    assert [e.capacity for e in fair] == [16] * 9 and [e.node_id for e in fair] == [e.node_id for e in entries]
    included = sum("node-0" in {e.node_id for e in sample_candidates(fair, k, rng)} for _ in range(draws))
    p = k * 16 / (16 * 9)
    assert abs(included - draws * p) < _binomial_bound(draws, p)


def test_capacities_within_the_maximum_are_left_as_they_are() -> None:
    entries = _entries([0, 1, 7, 64])
    assert capped(entries, 64) == entries


def test_zero_capacity_is_never_drawn_and_k_must_be_positive() -> None:
    rng = random.Random(0)
    assert all(sample_candidates(_entries([0, 5, 0]), 3, rng)[0].node_id == "node-1" for _ in range(50))
    assert sample_candidates(_entries([0, 0]), 2, rng) == []
    with pytest.raises(ValueError):
        sample_candidates(_entries([1]), 0, rng)


def test_the_default_randomness_is_the_systems() -> None:
    chosen = {sample_candidates(_entries([1] * 8), 1)[0].node_id for _ in range(200)}
    assert len(chosen) > 4
