"""Pool upkeep over real gRPC: re-attestation with fresh nonces, health eviction, re-admission, registration."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from audit.events import EvictionReason, NodeEvicted
from ohttp.keys import generate_key_pair
from tests.test_gateway_support import (  # noqa: F401  (sim_root is a fixture)
    GrpcNode,
    LiveGateway,
    RecordingNode,
    SimEvidence,
    client,
    gateway_settings,
    sim_root,
)


@pytest.fixture
def node(sim_root: Path):
    started = GrpcNode(RecordingNode(SimEvidence()))
    yield started
    started.stop()


def evictions(gateway: LiveGateway, node_id: str) -> list[EvictionReason]:
    return [event.reason for event in gateway.audit.events if isinstance(event, NodeEvicted) and event.node_id == node_id]


def test_reattestation_uses_a_fresh_nonce_each_time(node) -> None:
    with LiveGateway(gateway_settings([node.address], reattest_s=0.001)) as gateway:
        gateway.run_round()
        gateway.run_round()
        assert gateway.runtime.pool.lookup(node.node_id) is not None
    assert len(node.servicer.nonces) >= 3
    assert len(set(node.servicer.nonces)) == len(node.servicer.nonces)
    assert all(len(nonce) == 32 for nonce in node.servicer.nonces)


def test_a_node_whose_evidence_turns_bad_is_evicted_at_reattestation(node) -> None:
    honest = node.servicer.evidence_for
    with LiveGateway(gateway_settings([node.address], reattest_s=0.001)) as gateway:
        assert gateway.runtime.pool.lookup(node.node_id) is not None
        swapped_key = generate_key_pair(3).config.encode()
        node.servicer.evidence_for = lambda nonce: dataclasses.replace(
            node.servicer.evidence.bundle(nonce), key_config=swapped_key).to_json()
        gateway.run_round()
        assert gateway.runtime.pool.lookup(node.node_id) is None
        assert evictions(gateway, node.node_id) == [EvictionReason.ATTESTATION_FAILED]
        node.servicer.evidence_for = honest
        gateway.run_round()  # only a fresh, valid attestation brings it back
        assert gateway.runtime.pool.lookup(node.node_id) is not None


def test_draining_and_silent_nodes_are_evicted_and_readmitted_when_back(node, sim_root: Path) -> None:
    with LiveGateway(gateway_settings([node.address])) as gateway:
        node.servicer.serving = False
        gateway.run_round()
        assert gateway.runtime.pool.lookup(node.node_id) is None
        assert evictions(gateway, node.node_id) == [EvictionReason.DRAINED]
        node.servicer.serving = True
        gateway.run_round()
        assert gateway.runtime.pool.lookup(node.node_id) is not None
        node.stop()
        gateway.run_round()
        assert gateway.runtime.pool.lookup(node.node_id) is None
        assert evictions(gateway, node.node_id)[-1] is EvictionReason.UNREACHABLE


def test_nodes_register_themselves_only_when_allowed_and_only_if_they_verify(node, tmp_path: Path) -> None:
    forged = GrpcNode(RecordingNode(SimEvidence(tmp_path / "forged-root")))
    try:
        with LiveGateway(gateway_settings([], allow_registration=True)) as gateway, client(gateway.url) as http:
            assert http.get("/v1/health").json()["nodes"] == 0
            joined = http.post("/v1/nodes/register", json={"address": node.address})
            refused = http.post("/v1/nodes/register", json={"address": forged.address})
            malformed = http.post("/v1/nodes/register", json={"address": "no port here"})
            listed = [entry["node_id"] for entry in http.get("/v1/nodes").json()["nodes"]]
        assert joined.status_code == 200 and joined.json() == {"node_id": node.node_id}
        assert refused.status_code == 422 and refused.json()["error"]["code"] == "registration_failed"
        assert malformed.status_code == 400
        assert listed == [node.node_id]
    finally:
        forged.stop()
