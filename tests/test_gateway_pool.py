"""The attested node pool as pure logic: admission, nonces, forgery, rotation aliases, expiry, health."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest

from attestation.results import verify_result
from attestation.verifier import verify
from audit.events import EvictionReason
from gateway.errors import AdmissionError
from gateway.pool import HealthReport, HealthVerdict, NodePool, eviction_reason
from gateway.results import ResultSigner
from ohttp.keys import generate_key_pair
from policy import shipped_policy
from tests.policy_support import filled_strict
from tests.test_gateway_support import SimEvidence, sim_root  # noqa: F401  (fixture)

ADDRESS = "127.0.0.1:7001"


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def signer() -> ResultSigner:
    return ResultSigner()


@pytest.fixture
def pool(sim_root: Path, signer: ResultSigner, clock: Clock) -> NodePool:
    return NodePool(shipped_policy("dev"), signer, key_grace_s=60.0, clock=clock)


@pytest.fixture(scope="module")
def node(sim_root: Path) -> SimEvidence:
    return SimEvidence()


def admit(pool: NodePool, node: SimEvidence, address: str = ADDRESS, capacity: int = 4):
    return pool.admit(address, node.evidence(pool.challenge(address)), capacity)


def test_admits_evidence_answering_its_fresh_nonce(pool: NodePool, node: SimEvidence) -> None:
    admission = admit(pool, node)
    assert admission.entry.node_id == node.node_id
    assert admission.entry.key_config == node.keys.config.encode()
    assert admission.previous_id is None
    assert pool.lookup(node.node_id) == admission.entry
    assert [entry.node_id for entry in pool.entries()] == [node.node_id]


def test_each_challenge_draws_a_new_32_byte_nonce(pool: NodePool) -> None:
    nonces = {pool.challenge(ADDRESS) for _ in range(20)}
    assert len(nonces) == 20 and all(len(nonce) == 32 for nonce in nonces)


def test_evidence_for_another_nonce_is_refused(pool: NodePool, node: SimEvidence) -> None:
    pool.challenge(ADDRESS)
    with pytest.raises(AdmissionError) as caught:
        pool.admit(ADDRESS, node.evidence(b"\x07" * 32), 4)
    assert caught.value.check == "freshness"
    assert len(pool) == 0


def test_a_nonce_serves_once_so_evidence_cannot_be_replayed(pool: NodePool, node: SimEvidence) -> None:
    nonce = pool.challenge(ADDRESS)
    evidence = node.evidence(nonce)
    pool.admit(ADDRESS, evidence, 4)
    with pytest.raises(AdmissionError) as caught:
        pool.admit(ADDRESS, evidence, 4)
    assert caught.value.check == "freshness"


def test_evidence_from_another_root_is_refused(pool: NodePool, tmp_path: Path) -> None:
    forged = SimEvidence(tmp_path / "other-root")
    with pytest.raises(AdmissionError) as caught:
        admit(pool, forged)
    assert caught.value.check == "chain"
    assert pool.lookup(forged.node_id) is None and len(pool) == 0


def test_a_bundle_with_a_swapped_key_configuration_is_refused(pool: NodePool, node: SimEvidence) -> None:
    nonce = pool.challenge(ADDRESS)
    swapped = dataclasses.replace(node.bundle(nonce), key_config=generate_key_pair(9).config.encode())
    with pytest.raises(AdmissionError) as caught:
        pool.admit(ADDRESS, swapped.to_json(), 4)
    assert caught.value.check == "binding"
    assert len(pool) == 0


def test_debug_mode_and_malformed_evidence_are_refused(pool: NodePool, sim_root: Path) -> None:
    with pytest.raises(AdmissionError) as caught:
        admit(pool, SimEvidence(debug=True))
    assert caught.value.check == "debug"
    pool.challenge(ADDRESS)
    with pytest.raises(AdmissionError) as caught:
        pool.admit(ADDRESS, '{"version": "veil-evidence-v1"', 4)
    assert caught.value.check == "format"


def test_strict_policy_refuses_simulated_nodes(signer: ResultSigner, node: SimEvidence, clock: Clock) -> None:
    strict = NodePool(filled_strict(), signer, key_grace_s=60.0, clock=clock)
    with pytest.raises(AdmissionError) as caught:
        admit(strict, node)
    assert caught.value.check == "simulated"


def test_a_node_under_another_policy_is_refused_as_a_policy_mismatch(pool: NodePool, sim_root: Path) -> None:
    with pytest.raises(AdmissionError) as caught:
        admit(pool, SimEvidence(policy=filled_strict()))
    assert eviction_reason(caught.value) is EvictionReason.POLICY_MISMATCH


@pytest.mark.parametrize("capacity", [0, 65, 1_000_001])  # the dev policy's max_node_capacity is 64
def test_capacity_must_be_in_range(pool: NodePool, node: SimEvidence, capacity: int) -> None:
    with pytest.raises(AdmissionError):
        admit(pool, node, capacity=capacity)


def test_one_node_id_is_admitted_at_one_address_only(pool: NodePool, node: SimEvidence) -> None:
    admit(pool, node, "127.0.0.1:7001")
    with pytest.raises(AdmissionError):
        admit(pool, node, "127.0.0.1:7002")
    assert [entry.address for entry in pool.entries()] == ["127.0.0.1:7001"]


def test_rotated_key_keeps_the_old_id_routable_for_the_grace_period(pool: NodePool, clock: Clock, sim_root: Path) -> None:
    rotating = SimEvidence()
    old_id = rotating.node_id
    admit(pool, rotating)
    rotating.rotate()
    admission = admit(pool, rotating)
    assert admission.previous_id == old_id and admission.entry.node_id == rotating.node_id != old_id
    assert [entry.node_id for entry in pool.entries()] == [rotating.node_id]  # the directory shows the new key
    assert pool.lookup(old_id) == admission.entry
    clock.now += 61
    assert pool.lookup(old_id) is None
    assert pool.lookup(rotating.node_id) == admission.entry


def test_eviction_removes_the_node_and_its_aliases(pool: NodePool, sim_root: Path) -> None:
    rotating = SimEvidence()
    old_id = rotating.node_id
    admit(pool, rotating)
    rotating.rotate()
    admit(pool, rotating)
    eviction = pool.evict(ADDRESS, EvictionReason.UNREACHABLE)
    assert eviction is not None and eviction.node_id == rotating.node_id
    assert pool.lookup(old_id) is None and pool.lookup(rotating.node_id) is None
    assert pool.evict(ADDRESS, EvictionReason.UNREACHABLE) is None


def test_expired_evidence_is_evicted(pool: NodePool, node: SimEvidence, clock: Clock) -> None:
    entry = admit(pool, node).entry
    assert pool.expire() == []
    clock.now = entry.expires_at + 1
    [eviction] = pool.expire()
    assert eviction.reason is EvictionReason.EVIDENCE_EXPIRED and len(pool) == 0


def test_reattestation_comes_due_on_the_timer_and_before_expiry(pool: NodePool, node: SimEvidence, clock: Clock) -> None:
    entry = admit(pool, node).entry
    assert pool.reattestation_due(reattest_s=30, margin_s=5) == []
    clock.now += 30
    assert pool.reattestation_due(reattest_s=30, margin_s=5) == [ADDRESS]
    clock.now = entry.expires_at - 4
    assert pool.reattestation_due(reattest_s=10_000, margin_s=5) == [ADDRESS]


def test_health_verdicts(pool: NodePool, node: SimEvidence) -> None:
    admit(pool, node)
    assert pool.judge_health(ADDRESS, None) is HealthVerdict.UNREACHABLE
    assert pool.judge_health(ADDRESS, HealthReport(False, 0, 4, node.node_id)) is HealthVerdict.DRAINED
    assert pool.judge_health(ADDRESS, HealthReport(True, 0, 4, "ab" * 16)) is HealthVerdict.KEY_ROTATED
    assert pool.judge_health(ADDRESS, HealthReport(True, 1, 4, node.node_id)) is HealthVerdict.HEALTHY


def test_directory_version_changes_with_the_pool(pool: NodePool, node: SimEvidence) -> None:
    before = pool.version
    admit(pool, node)
    admitted = pool.version
    pool.evict(ADDRESS, EvictionReason.DRAINED)
    assert before != admitted != pool.version


def test_the_signed_result_records_what_the_gateway_verified(pool: NodePool, node: SimEvidence, signer: ResultSigner) -> None:
    entry = admit(pool, node).entry
    result = verify_result(entry.attestation_result, {signer.gateway_id: signer.public_key}, issuer=signer.issuer)
    assert result.node_id == node.node_id
    assert result.key_config == node.keys.config.encode()
    assert result.simulated is True
    assert result.policy_digest == shipped_policy("dev").digest
    independently = verify(node.bundle(pool.challenge(ADDRESS)), shipped_policy("dev"))
    assert [name for name, _ in result.checks] == [check.name for check in independently.checks]


def test_a_node_is_published_with_the_models_it_states(pool: NodePool, node: SimEvidence) -> None:
    admission = pool.admit(ADDRESS, node.evidence(pool.challenge(ADDRESS)), 4, ("alpha", "beta"))
    assert admission.entry.models == ("alpha", "beta")
    assert [entry.models for entry in pool.entries()] == [("alpha", "beta")]


@pytest.mark.parametrize(("stated", "published"), [("", "generate"), ("generate", "generate"), ("embed", "embed")])
def test_a_node_is_published_with_its_task_and_one_stating_none_generates(pool: NodePool, node: SimEvidence,
                                                                          stated: str, published: str) -> None:
    pool.admit(ADDRESS, node.evidence(pool.challenge(ADDRESS)), 4, ("alpha",), task=stated)
    assert [entry.task for entry in pool.entries()] == [published]


@pytest.mark.parametrize("task", ["rerank", "EMBED", "embed\n"])
def test_a_node_stating_a_task_no_client_knows_is_refused(pool: NodePool, node: SimEvidence, task: str) -> None:
    with pytest.raises(AdmissionError) as refused:
        pool.admit(ADDRESS, node.evidence(pool.challenge(ADDRESS)), 4, ("alpha",), task=task)
    assert refused.value.check == "task" and not pool.entries()


@pytest.mark.parametrize("models", [("alpha", "alpha"), ("",), ("x" * 257,), ("line\nbreak",),
                                    tuple(f"m{index}" for index in range(17))])
def test_a_node_stating_models_the_directory_cannot_publish_is_refused(pool: NodePool, node: SimEvidence,
                                                                        models: tuple[str, ...]) -> None:
    with pytest.raises(AdmissionError) as refused:
        pool.admit(ADDRESS, node.evidence(pool.challenge(ADDRESS)), 4, models)
    assert refused.value.check == "models" and not pool.entries()
