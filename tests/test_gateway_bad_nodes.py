"""One bad node gets only itself refused: evidence that breaks the verifier, and a node that is not serving.

Real gRPC nodes on loopback and the real gateway application on a real server. A node's evidence,
whatever its bytes, must never stop the gateway, keep a node listed, or turn a registration into a
500; a node that reports itself not serving (its engine core died) stays out until it serves again.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from audit.events import EvictionReason, NodeAdmitted
from gateway import pool as gateway_pool
from tests.test_gateway_support import (  # noqa: F401  (sim_root is a fixture)
    GrpcNode,
    LiveGateway,
    RecordingNode,
    SimEvidence,
    client,
    gateway_settings,
    sim_root,
    with_broken_certificate,
)
from tests.test_gateway_keeper import evictions

CANARY = "CANARY-5d1e-EVIDENCE-BYTES"


@pytest.fixture
def honest(sim_root: Path) -> Iterator[GrpcNode]:
    started = GrpcNode(RecordingNode(SimEvidence()))
    yield started
    started.stop()


@pytest.fixture
def broken(sim_root: Path) -> Iterator[GrpcNode]:
    """A node whose every Attest answer carries a leaf certificate of an X.509 version that does not exist."""
    evidence = SimEvidence()
    started = GrpcNode(RecordingNode(evidence, evidence_for=lambda nonce: with_broken_certificate(evidence.evidence(nonce))))
    yield started
    started.stop()


def listed(gateway: LiveGateway) -> list[str]:
    return [entry.node_id for entry in gateway.runtime.pool.entries()]


def admissions(gateway: LiveGateway, node_id: str) -> int:
    return sum(isinstance(event, NodeAdmitted) and event.node_id == node_id for event in gateway.audit.events)


# ----- evidence that breaks the verifier ----------------------------------------------------------


def test_the_gateway_starts_beside_a_node_whose_evidence_breaks_the_verifier(honest, broken, caplog) -> None:
    caplog.set_level(logging.INFO, logger="veil.gateway")
    with LiveGateway(gateway_settings([broken.address, honest.address])) as gateway, client(gateway.url) as http:
        assert http.get("/v1/health").json() == {"status": "ok", "nodes": 1}
        assert [entry["node_id"] for entry in http.get("/v1/nodes").json()["nodes"]] == [honest.node_id]
        gateway.run_round()  # and every later round refuses it the same way, without failing
        assert listed(gateway) == [honest.node_id]
    refusals = [record.getMessage() for record in caplog.records if broken.address in record.getMessage()]
    assert refusals and all("not admitted" in message for message in refusals)


def test_an_admitted_node_whose_reattestation_breaks_the_verifier_is_evicted(honest) -> None:
    evidence = honest.servicer.evidence
    with LiveGateway(gateway_settings([honest.address], reattest_s=0.001)) as gateway:
        assert listed(gateway) == [honest.node_id]
        honest.servicer.evidence_for = lambda nonce: with_broken_certificate(evidence.evidence(nonce), "gpu")
        gateway.run_round()
        assert listed(gateway) == []
        assert evictions(gateway, honest.node_id) == [EvictionReason.ATTESTATION_FAILED]
        honest.servicer.evidence_for = evidence.evidence
        gateway.run_round()  # fresh, valid evidence brings it back
        assert listed(gateway) == [honest.node_id]


def test_registering_a_node_whose_evidence_breaks_the_verifier_is_refused_not_a_500(honest, broken) -> None:
    with LiveGateway(gateway_settings([], allow_registration=True)) as gateway, client(gateway.url) as http:
        refused = http.post("/v1/nodes/register", json={"address": broken.address})
        joined = http.post("/v1/nodes/register", json={"address": honest.address})
        assert [entry["node_id"] for entry in http.get("/v1/nodes").json()["nodes"]] == [honest.node_id]
    assert refused.status_code == 422 and refused.json()["error"]["code"] == "registration_failed"
    assert joined.status_code == 200 and joined.json() == {"node_id": honest.node_id}


def test_whatever_the_verifier_raises_only_that_node_is_refused_and_nothing_of_it_is_told(
        honest, broken, monkeypatch, caplog) -> None:
    # The verifier is meant to end every parse in an AttestationError; the gateway must not rely on
    # it. Only a verifier that raises something else, carrying the bytes it choked on, shows that.
    real_verify = gateway_pool.verify
    bad_key = broken.servicer.evidence.keys.config.encode()

    def choking(bundle, policy, **kwargs):
        if bundle.key_config == bad_key:
            raise RuntimeError(f"unexpected bytes {CANARY}")
        return real_verify(bundle, policy, **kwargs)

    monkeypatch.setattr(gateway_pool, "verify", choking)
    caplog.set_level(logging.INFO, logger="veil")
    settings = gateway_settings([broken.address, honest.address], allow_registration=True)
    with LiveGateway(settings) as live, client(live.url) as http:
        assert listed(live) == [honest.node_id]
        registered = http.post("/v1/nodes/register", json={"address": broken.address})
        live.run_round()
        assert listed(live) == [honest.node_id]
    assert registered.status_code == 422 and CANARY not in registered.text
    assert CANARY not in caplog.text and "RuntimeError" in caplog.text
    assert all(CANARY not in str(event) for event in live.audit.events)


# ----- a node that is not serving ----------------------------------------------------------------


def test_a_node_that_is_not_serving_stays_out_until_it_serves(honest) -> None:
    with LiveGateway(gateway_settings([honest.address])) as gateway:
        assert listed(gateway) == [honest.node_id]
        honest.servicer.serving = False  # what a node says once its engine core has died
        gateway.run_round()
        attested = len(honest.servicer.nonces)
        for _ in range(3):
            gateway.run_round()
        assert listed(gateway) == [] and evictions(gateway, honest.node_id) == [EvictionReason.DRAINED]
        assert len(honest.servicer.nonces) == attested  # not even asked to attest while it does not serve
        assert admissions(gateway, honest.node_id) == 1
        honest.servicer.serving = True
        gateway.run_round()
        assert listed(gateway) == [honest.node_id]


def test_a_node_that_is_not_serving_is_neither_admitted_at_start_nor_registered(honest) -> None:
    honest.servicer.serving = False
    settings = gateway_settings([honest.address], allow_registration=True)
    with LiveGateway(settings) as gateway, client(gateway.url) as http:
        assert listed(gateway) == []
        refused = http.post("/v1/nodes/register", json={"address": honest.address})
        assert refused.status_code == 422 and refused.json()["error"]["code"] == "registration_failed"
        assert listed(gateway) == [] and honest.servicer.nonces == []
        honest.servicer.serving = True
        gateway.run_round()
        assert listed(gateway) == [honest.node_id]
