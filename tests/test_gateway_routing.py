"""Uniform random choice among healthy candidates, and the bounded in-flight limiter."""

from __future__ import annotations

import random
import secrets
from collections import Counter

import pytest
from scipy.stats import chisquare

from gateway import routing
from gateway.routing import failover_order
from serving.backpressure import InFlightLimiter
from serving.errors import OverloadedError

IDS = ("a" * 32, "b" * 32, "c" * 32, "d" * 32)


def test_the_default_randomness_is_the_operating_systems() -> None:
    assert isinstance(routing._SYSTEM_RANDOM, secrets.SystemRandom)


def test_order_is_a_permutation_of_the_healthy_candidates_only() -> None:
    healthy = {IDS[0], IDS[2], IDS[3]}
    for seed in range(50):
        order = failover_order(IDS, healthy.__contains__, random.Random(seed))
        assert sorted(order) == [0, 2, 3]


def test_no_healthy_candidate_gives_an_empty_order() -> None:
    assert failover_order(IDS, lambda _: False) == []


def test_first_choice_is_uniform_among_healthy_candidates() -> None:
    healthy = set(IDS[:3])
    rng = random.Random(20261121)
    draws = 30_000
    counts = Counter(IDS[failover_order(IDS, healthy.__contains__, rng)[0]] for _ in range(draws))
    assert set(counts) == healthy
    assert chisquare([counts[node] for node in IDS[:3]]).pvalue > 0.001


def test_candidate_order_in_the_request_does_not_bias_the_choice() -> None:
    rng = random.Random(7)
    first_positions = Counter(failover_order(IDS, lambda _: True, rng)[0] for _ in range(20_000))
    assert chisquare([first_positions[index] for index in range(len(IDS))]).pvalue > 0.001


def test_failover_order_is_uniform_too() -> None:
    rng = random.Random(11)
    orders = Counter(tuple(failover_order(IDS[:3], lambda _: True, rng)) for _ in range(12_000))
    assert len(orders) == 6
    assert chisquare(list(orders.values())).pvalue > 0.001


def test_limiter_bounds_requests_overall() -> None:
    limiter = InFlightLimiter(max_total=2, max_per_node=5, retry_after_s=3)
    first, second = limiter.admit_request(), limiter.admit_request()
    with pytest.raises(OverloadedError) as caught:
        limiter.admit_request()
    assert caught.value.retry_after_s == 3 and caught.value.status == 503
    first.release()
    first.release()  # releasing twice frees one slot only
    third = limiter.admit_request()
    with pytest.raises(OverloadedError):
        limiter.admit_request()
    second.release()
    third.release()
    assert limiter.in_flight == 0


def test_limiter_bounds_requests_per_node() -> None:
    limiter = InFlightLimiter(max_total=10, max_per_node=1, retry_after_s=1)
    with limiter.admit_to_node("127.0.0.1:1"):
        with pytest.raises(OverloadedError):
            limiter.admit_to_node("127.0.0.1:1")
        with limiter.admit_to_node("127.0.0.1:2"):
            assert limiter.node_in_flight("127.0.0.1:2") == 1
    assert limiter.node_in_flight("127.0.0.1:1") == 0
    limiter.admit_to_node("127.0.0.1:1").release()
