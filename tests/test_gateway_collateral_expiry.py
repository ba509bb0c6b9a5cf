"""A node whose stapled collateral expires stops verifying at its next re-attestation: the real gateway
(uvicorn, gRPC to a real node servicer) evicts it, audits the eviction, and readmits it only once its
evidence passes again. The gateway's clock is injected; the node's evidence is SEV-SNP evidence made at
that clock's time, stapling an ARK CRL whose nextUpdate the clock then passes."""

from __future__ import annotations

import datetime as dt
import time
from dataclasses import dataclass, field
from pathlib import Path

from attestation.bundle import EvidenceBundle
from attestation.errors import CrlError
from attestation.verifier import node_id_for, verify_with_report
from audit.events import EvictionReason, NodeAdmitted, NodeEvicted
from policy import parse_policy
from tests.cpu_tee_support import amd_hierarchy, cpu_policy_text, snp_evidence
from tests.test_attestation_support import key_config
from tests.test_gateway_support import GrpcNode, LiveGateway, RecordingNode, gateway_settings

CRL_LIFETIME_S = 100  # the stapled CRL's nextUpdate, after the gateway first admits the node


@dataclass
class Clock:
    now: float

    def __call__(self) -> float:
        return self.now


@dataclass
class SnpNodeEvidence:
    """What RecordingNode asks of a node's evidence: its id, and evidence over a nonce, made at `clock`'s time."""

    policy: object
    clock: Clock
    crls: tuple[bytes, ...]
    config: bytes = field(default_factory=key_config)  # one key throughout: the node keeps its id
    served: list[str] = field(default_factory=list)

    @property
    def node_id(self) -> str:
        bundle = snp_evidence(self.policy, config=self.config)
        return node_id_for(bundle.key_config, bundle.measurement)

    def evidence(self, nonce: bytes) -> str:
        made = snp_evidence(self.policy, nonce=nonce, timestamp=int(self.clock()), crls=self.crls,
                            config=self.config).to_json()
        self.served.append(made)
        return made


def crls_until(moment: float) -> tuple[bytes, ...]:
    return amd_hierarchy().crls(next_update=dt.datetime.fromtimestamp(moment, dt.timezone.utc))


def test_a_node_whose_stapled_crl_expires_is_evicted_at_reattestation_and_audited(tmp_path: Path) -> None:
    text = cpu_policy_text()
    (tmp_path / "policy.toml").write_text(text)
    policy = parse_policy(text)
    start = time.time()
    clock = Clock(start)
    evidence = SnpNodeEvidence(policy, clock, crls_until(start + CRL_LIFETIME_S))
    node = GrpcNode(RecordingNode(evidence))  # type: ignore[arg-type]  (duck-typed: node_id and evidence)
    settings = gateway_settings([node.address], policy=str(tmp_path / "policy.toml"), reattest_s=0.001)
    try:
        with LiveGateway(settings, clock=clock) as gateway:
            pool = gateway.runtime.pool
            assert pool.lookup(evidence.node_id) is not None  # admitted at start, its CRL current
            clock.now = start + CRL_LIFETIME_S / 2
            gateway.run_round()
            assert pool.lookup(evidence.node_id) is not None and len(evidence.served) == 2  # re-attested, passes

            clock.now = start + 2 * CRL_LIFETIME_S  # past the CRL's nextUpdate, within the evidence's lifetime
            gateway.run_round()
            assert pool.lookup(evidence.node_id) is None
            evicted = [event.reason for event in gateway.audit.events if isinstance(event, NodeEvicted)]
            assert evicted == [EvictionReason.ATTESTATION_FAILED]
            # The refusal is the collateral's: the evidence the node served is fresh, its CRL stale.
            refusal = verify_with_report(EvidenceBundle.from_json(evidence.served[-1]), policy, now=clock.now).error
            assert isinstance(refusal, CrlError) and "stale" in str(refusal)

            evidence.crls = crls_until(clock.now + 7 * 86_400)  # the operator staples a current CRL
            gateway.run_round()
            assert pool.lookup(evidence.node_id) is not None
            admitted = [event for event in gateway.audit.events if isinstance(event, NodeAdmitted)]
            assert len(admitted) == 2  # at start, and again only once its evidence passed
    finally:
        node.stop()
