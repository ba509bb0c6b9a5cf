"""A node whose stapled collateral expires stops verifying at its next re-attestation: the real gateway
(uvicorn, gRPC to a real node servicer) evicts it, audits the eviction, and readmits it only once its
evidence passes again. The gateway's clock is injected; the node's evidence is made at that clock's time,
stapling collateral that the clock then outlives: an AMD ARK CRL past its nextUpdate (SEV-SNP), or Intel's
TCB Info or QE Identity past its nextUpdate or the policy's maximum age (TDX, synthetic collateral signed
under the test Intel root, as tests/test_attestation_tdx_collateral.py builds it)."""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from attestation.bundle import EvidenceBundle
from attestation.errors import CollateralExpiredError, CrlError
from attestation.verifier import node_id_for, verify_with_report
from audit.events import EvictionReason, NodeAdmitted, NodeEvicted
from policy import parse_policy
from tests.cpu_tee_support import (
    amd_hierarchy,
    cpu_policy_text,
    pcs_time,
    qe_identity_document,
    snp_evidence,
    tcb_info_document,
    tdx_collateral,
    tdx_evidence,
)
from tests.test_attestation_support import key_config
from tests.test_gateway_support import GrpcNode, LiveGateway, RecordingNode, gateway_settings

LIFETIME_S = 100  # the stapled collateral lapses this long after the gateway first admits the node
TDX_MAX_COLLATERAL_AGE_S = 2_592_000  # strict's tdx_max_collateral_age_s, which cpu_policy_text keeps


@dataclass
class Clock:
    now: float

    def __call__(self) -> float:
        return self.now


@dataclass
class NodeEvidence:
    """What RecordingNode asks of a node's evidence: its id, and evidence over a nonce made at `clock`'s time by
    `make` (snp_evidence or tdx_evidence) with the collateral its operator last stapled (`stapled`, keywords)."""

    make: Callable[..., EvidenceBundle]
    policy: object
    clock: Clock
    stapled: dict[str, object]
    config: bytes = field(default_factory=key_config)  # one key throughout: the node keeps its id
    served: list[str] = field(default_factory=list)

    @property
    def node_id(self) -> str:
        bundle = self.make(self.policy, config=self.config)
        return node_id_for(bundle.key_config, bundle.measurement)

    def evidence(self, nonce: bytes) -> str:
        made = self.make(self.policy, nonce=nonce, timestamp=int(self.clock()), config=self.config, **self.stapled)
        self.served.append(made.to_json())
        return made.to_json()


def _utc(moment: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(moment, dt.timezone.utc)


def crls_until(moment: float) -> dict[str, object]:
    return {"crls": amd_hierarchy().crls(next_update=_utc(moment))}


def tcb_info_until(moment: float) -> dict[str, object]:
    return {"collateral": tdx_collateral(tcb_info_document(nextUpdate=pcs_time(_utc(moment))))}


def qe_identity_until(moment: float) -> dict[str, object]:
    return {"collateral": tdx_collateral(qe_identity=qe_identity_document(nextUpdate=pcs_time(_utc(moment))))}


def tcb_info_aging_out_at(moment: float) -> dict[str, object]:
    """TCB Info whose nextUpdate is a month on, but which is older than the policy allows from `moment`."""
    issued = pcs_time(_utc(moment - TDX_MAX_COLLATERAL_AGE_S))
    next_update = pcs_time(_utc(moment + 30 * 86_400))
    return {"collateral": tdx_collateral(tcb_info_document(issueDate=issued, nextUpdate=next_update))}


@dataclass(frozen=True)
class Lapse:
    """How one node's stapled collateral lapses, and how the verifier then refuses it."""

    make: Callable[..., EvidenceBundle]
    stapled_until: Callable[[float], dict[str, object]]  # collateral that passes until the given time
    refusal: type[Exception]
    says: str


LAPSES = {
    "sev-snp-ark-crl": Lapse(snp_evidence, crls_until, CrlError, "stale"),
    "tdx-tcb-info-next-update": Lapse(tdx_evidence, tcb_info_until, CollateralExpiredError,
                                      "tcbInfo expired at its nextUpdate"),
    "tdx-qe-identity-next-update": Lapse(tdx_evidence, qe_identity_until, CollateralExpiredError,
                                         "enclaveIdentity expired at its nextUpdate"),
    "tdx-tcb-info-max-age": Lapse(tdx_evidence, tcb_info_aging_out_at, CollateralExpiredError,
                                  f"the policy allows {TDX_MAX_COLLATERAL_AGE_S} s"),
}


@pytest.mark.parametrize("lapse", LAPSES.values(), ids=LAPSES.keys())
def test_a_node_whose_stapled_collateral_expires_is_evicted_at_reattestation_and_audited(
    tmp_path: Path, lapse: Lapse,
) -> None:
    text = cpu_policy_text()
    (tmp_path / "policy.toml").write_text(text)
    policy = parse_policy(text)
    start = time.time()
    clock = Clock(start)
    evidence = NodeEvidence(lapse.make, policy, clock, lapse.stapled_until(start + LIFETIME_S))
    node = GrpcNode(RecordingNode(evidence))  # type: ignore[arg-type]  (duck-typed: node_id and evidence)
    settings = gateway_settings([node.address], policy=str(tmp_path / "policy.toml"), reattest_s=0.001)
    try:
        with LiveGateway(settings, clock=clock) as gateway:
            pool = gateway.runtime.pool
            assert pool.lookup(evidence.node_id) is not None  # admitted at start, its collateral current
            clock.now = start + LIFETIME_S / 2
            gateway.run_round()
            assert pool.lookup(evidence.node_id) is not None and len(evidence.served) == 2  # re-attested, passes

            clock.now = start + 2 * LIFETIME_S  # past the collateral's lapse, within the evidence's lifetime
            gateway.run_round()
            assert pool.lookup(evidence.node_id) is None
            evicted = [(event.node_id, event.reason) for event in gateway.audit.events
                       if isinstance(event, NodeEvicted)]
            assert evicted == [(evidence.node_id, EvictionReason.ATTESTATION_FAILED)]
            # The refusal is the collateral's: the evidence the node served is fresh, its collateral lapsed.
            refusal = verify_with_report(EvidenceBundle.from_json(evidence.served[-1]), policy, now=clock.now).error
            assert isinstance(refusal, lapse.refusal) and lapse.says in str(refusal), refusal
            attempts = len(evidence.served)
            gateway.run_round()
            assert len(evidence.served) > attempts and pool.lookup(evidence.node_id) is None  # tried, still lapsed

            evidence.stapled = lapse.stapled_until(clock.now + 7 * 86_400)  # the operator staples current collateral
            gateway.run_round()
            assert pool.lookup(evidence.node_id) is not None
            admitted = [event for event in gateway.audit.events if isinstance(event, NodeAdmitted)]
            assert len(admitted) == 2  # at start, and again only once its evidence passed
    finally:
        node.stop()
