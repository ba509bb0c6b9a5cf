"""When clients stop accepting the proofs a node staples, and how close that is.

A client accepts a stapled checkpoint while a quorum of the policy's witnesses cosigned it within the
policy's max_checkpoint_age_s (`attestation.transparency.client_check`). If the log is down, the node's
proofs keep their last cosignatures, and every node's age out together. So a node watches its own:

- fresh: younger than half the allowed age;
- aging: past half of it. Refreshes have been failing for a while: the node says so in a `proofs_refreshed`
  audit event, the `veil_node_proof_refreshes` metric's `proofs` label, and a warning log line;
- expiring: in the last tenth of it. The node reads not ready (grpc.health.v1, service veil.node.v1.Node):
  gateways and load balancers stop sending it clients that are about to refuse it;
- expired: clients refuse it.
"""

from __future__ import annotations

from attestation.transparency.checkpoint import open_checkpoint
from attestation.transparency.client_check import ProofBundle, StapledEntry, TransparencyRequirement
from attestation.transparency.proof import parse_proof
from audit.events import ProofFreshness

AGING_FRACTION = 0.5  # past this fraction of the allowed age, the proofs are aging
EXPIRING_FRACTION = 0.9  # past this one, they are expiring and the node reads not ready


def proofs_expire_at(bundle: ProofBundle, requirement: TransparencyRequirement) -> float | None:
    """The time (seconds since the epoch) after which a client refuses these proofs for their age; None
    where the policy asks for no witness, so that no age applies."""
    times = [_expire_at(stapled, requirement) for stapled in (bundle.release, bundle.node_key) if stapled is not None]
    known = [time for time in times if time is not None]
    return min(known) if known else None


def _expire_at(stapled: StapledEntry, requirement: TransparencyRequirement) -> float | None:
    policy = requirement.policy
    if policy.quorum is None:
        return None
    note = open_checkpoint(parse_proof(stapled.proof).checkpoint, policy.log).note
    cosigned = sorted(((when, name) for name, verifier in policy.witnesses.items()
                       if (when := verifier.timestamp(note)) is not None), reverse=True)
    # The newest cosignatures first: the quorum they reach first is the one that stays fresh the longest.
    names: set[str] = set()
    for when, name in cosigned:
        names.add(name)
        if policy.satisfied_by(names):
            return float(when + requirement.max_age_s)
    return 0.0  # no quorum at all: refused already


def freshness(expire_at: float | None, now: float, max_age_s: int) -> ProofFreshness:
    """How fresh proofs that clients refuse after `expire_at` are at `now` (None: no age applies)."""
    if expire_at is None:
        return ProofFreshness.NONE
    left = expire_at - now
    if left < 0:
        return ProofFreshness.EXPIRED
    if left < max_age_s * (1 - EXPIRING_FRACTION):
        return ProofFreshness.EXPIRING
    if left < max_age_s * (1 - AGING_FRACTION):
        return ProofFreshness.AGING
    return ProofFreshness.FRESH
