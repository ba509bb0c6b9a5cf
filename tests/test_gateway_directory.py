"""The published directory of a large pool: a uniformly random sample, the same for every caller per epoch."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from dataclasses import dataclass, field

import pytest

from gateway.directory import DirectoryCache, sample
from gateway.errors import GatewaySettingsError
from gateway.models import Directory
from gateway.pool import PoolEntry
from gateway.settings import GatewaySettings
from policy import shipped_policy


def entry(index: int) -> PoolEntry:
    return PoolEntry(node_id=f"{index:032x}", address=f"10.0.0.{index % 250}:{7000 + index}", key_config=b"\x01",
                     evidence="{}", capacity=8, attested_at=0.0, expires_at=1e12, attestation_result="jwt")


@dataclass
class FakePool:
    """What DirectoryCache reads of a pool: its entries, their version and the policy."""

    members: list[PoolEntry]
    version: int = 0
    policy: object = field(default_factory=lambda: shipped_policy("dev"))

    def entries(self) -> tuple[PoolEntry, ...]:
        return tuple(sorted(self.members, key=lambda e: e.node_id))


class Clock:
    def __init__(self) -> None:
        self.now = 60.0 * 20_000  # the start of an epoch

    def __call__(self) -> float:
        return self.now


def listed(cache: DirectoryCache) -> list[str]:
    return [node["node_id"] for node in json.loads(cache.render())["nodes"]]


def test_a_pool_within_the_size_is_listed_whole() -> None:
    pool = FakePool([entry(i) for i in range(5)])
    assert listed(DirectoryCache(pool, size=5, epoch_s=60, clock=Clock())) == [e.node_id for e in pool.entries()]


def test_each_node_is_published_with_its_task() -> None:
    generating, embedding = entry(1), dataclasses.replace(entry(2), models=("alpha",), task="embed")
    nodes = json.loads(DirectoryCache(FakePool([generating, embedding]), size=5, epoch_s=60, clock=Clock()).render())
    assert [(node["models"], node["task"]) for node in nodes["nodes"]] == [([], "generate"), (["alpha"], "embed")]
    Directory.model_validate(nodes)  # the REST schema documents the field


def test_a_larger_pool_is_sampled_to_the_size_without_duplicates_in_pool_order() -> None:
    pool = FakePool([entry(i) for i in range(300)])
    ids = listed(DirectoryCache(pool, size=256, epoch_s=60, clock=Clock()))
    assert len(ids) == len(set(ids)) == 256
    assert set(ids) <= {e.node_id for e in pool.members} and ids == sorted(ids)


def test_within_an_epoch_every_caller_gets_the_same_bytes_and_churn_keeps_listed_nodes_listed() -> None:
    pool, clock = FakePool([entry(i) for i in range(40)]), Clock()
    cache = DirectoryCache(pool, size=10, epoch_s=60, clock=clock)
    first = cache.render()
    clock.now += 59
    assert cache.render() == first
    kept = set(listed(cache))
    outside = next(e for e in pool.members if e.node_id not in kept)
    pool.members.remove(outside)  # a node the sample did not list leaves the pool
    pool.version += 1
    assert set(listed(cache)) == kept


def test_each_epoch_draws_a_new_sample() -> None:
    pool, clock = FakePool([entry(i) for i in range(40)]), Clock()
    cache = DirectoryCache(pool, size=10, epoch_s=60, clock=clock)
    samples = set()
    for _ in range(5):
        samples.add(tuple(listed(cache)))
        clock.now += 60
    assert len(samples) == 5  # 40 choose 10 = 847,660,528 samples; a repeat would be a broken draw


def test_every_node_is_listed_in_size_over_n_of_the_epochs() -> None:
    n, size, epochs = 30, 10, 3000
    pool, clock = FakePool([entry(i) for i in range(n)]), Clock()
    cache = DirectoryCache(pool, size=size, epoch_s=60, clock=clock)
    counts: Counter[str] = Counter()
    for _ in range(epochs):
        counts.update(listed(cache))
        clock.now += 60
    p = size / n
    bound = 5 * (epochs * p * (1 - p)) ** 0.5  # five standard deviations of a binomial count
    assert all(abs(counts[e.node_id] - epochs * p) < bound for e in pool.members)


def test_the_sample_depends_only_on_the_seed_and_the_members() -> None:
    members = [entry(i) for i in range(20)]
    assert sample(members, 5, b"s" * 32) == sample(list(members), 5, b"s" * 32)
    assert sample(members, 5, b"s" * 32) != sample(members, 5, b"t" * 32)
    assert sample(members, 20, b"s" * 32) == members


@pytest.mark.parametrize("size", [0, 4097])
def test_a_directory_size_clients_would_refuse_is_a_settings_error(size: int) -> None:
    with pytest.raises(GatewaySettingsError, match="directory_size"):
        GatewaySettings(directory_size=size)
