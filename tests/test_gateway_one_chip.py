"""One chip is one node in the gateway's pool: a second address attesting from an admitted chip is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from audit.events import EvictionReason
from gateway.errors import AdmissionError
from gateway.pool import NodePool
from gateway.results import ResultSigner
from policy import shipped_policy
from tests.test_gateway_support import (  # noqa: F401  (sim_root is a fixture)
    GrpcNode,
    LiveGateway,
    RecordingNode,
    SimEvidence,
    client,
    gateway_settings,
    sim_root,
)

FIRST, SECOND = "127.0.0.1:7001", "127.0.0.1:7002"


def same_chip(node: SimEvidence) -> SimEvidence:
    """Another node, with keys of its own, attesting from `node`'s simulated GPU."""
    twin = SimEvidence()
    twin.backend = node.backend
    return twin


@pytest.fixture
def pool(sim_root: Path) -> NodePool:
    return NodePool(shipped_policy("dev"), ResultSigner(), key_grace_s=60.0)


def admit(pool: NodePool, node: SimEvidence, address: str):
    return pool.admit(address, node.evidence(pool.challenge(address)), 4)


def test_a_second_address_attesting_from_an_admitted_chip_is_refused(pool: NodePool) -> None:
    node = SimEvidence()
    twin = same_chip(node)
    assert twin.node_id != node.node_id
    admit(pool, node, FIRST)
    with pytest.raises(AdmissionError, match="same hardware identity") as refusal:
        admit(pool, twin, SECOND)
    assert refusal.value.check == "identity"
    assert [entry.node_id for entry in pool.entries()] == [node.node_id]
    admit(pool, SimEvidence(), SECOND)  # another chip at that address is welcome
    assert len(pool) == 2


def test_a_rotated_key_at_the_same_address_keeps_its_chip_and_alias(pool: NodePool) -> None:
    node = SimEvidence()
    old_id = node.node_id
    admit(pool, node, FIRST)
    node.rotate()
    admission = admit(pool, node, FIRST)
    assert admission.previous_id == old_id and pool.lookup(old_id) == admission.entry
    with pytest.raises(AdmissionError, match="same hardware identity"):
        admit(pool, same_chip(node), SECOND)


def test_an_evicted_chip_may_join_again_from_another_address(pool: NodePool) -> None:
    node = SimEvidence()
    admit(pool, node, FIRST)
    pool.evict(FIRST, EvictionReason.UNREACHABLE)
    twin = same_chip(node)
    assert admit(pool, twin, SECOND).entry.node_id == twin.node_id
    with pytest.raises(AdmissionError, match="same hardware identity"):
        admit(pool, node, FIRST)


def test_the_keeper_lists_one_chip_once_and_refuses_its_registration_elsewhere(sim_root: Path) -> None:
    node = SimEvidence()
    first, second = GrpcNode(RecordingNode(node)), GrpcNode(RecordingNode(same_chip(node)))
    try:
        settings = gateway_settings([first.address], allow_registration=True)
        with LiveGateway(settings) as gateway, client(gateway.url) as http:
            refused = http.post("/v1/nodes/register", json={"address": second.address})
            gateway.run_round()
            listed = [entry["node_id"] for entry in http.get("/v1/nodes").json()["nodes"]]
        assert refused.status_code == 422 and refused.json()["error"]["code"] == "registration_failed"
        assert listed == [first.node_id] and second.servicer.nonces  # it was attested, and refused
    finally:
        first.stop()
        second.stop()
