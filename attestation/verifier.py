"""The verifier: one fixed sequence of checks; a verified node record, or an exception.

Order: simulated (is simulated evidence acceptable under this policy?),
chain, signature, reference measurements (the GPU's against NVIDIA's signed
RIMs), binding (of the key configuration and the receipt key), freshness, revocation (stapled OCSP for the GPU's and the
RIMs' certificates; the SEV-SNP TCB against the policy's minimum), confidential mode, debug, tdx platform (Intel's
stapled TCB Info and QE Identity rate the TDX platform, module and QE; the policy's TDX pins), measurement (also the
SEV-SNP HOST_DATA and ID block pins), key configuration. Each failing check raises its own subclass of
AttestationError; there is no boolean result to forget to check.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

from attestation import checks, gpu_checks, snp_platform, tdx_checks
from attestation.bundle import EvidenceBundle
from attestation.errors import AttestationError
from attestation.measurement import Measurement
from policy import Policy

Check = Callable[[checks.Context], str]


def _in_turn(*parts: Check) -> Check:
    """One step made of `parts`, run in order; their details joined (a part with nothing to say returns "")."""

    def run(ctx: checks.Context) -> str:
        return "; ".join(detail for detail in (part(ctx) for part in parts) if detail)

    return run


CHECKS: tuple[tuple[str, Check], ...] = (
    ("simulated", checks.check_simulated),
    ("chain", checks.check_chain),
    ("signature", checks.check_signature),
    ("reference measurements", gpu_checks.check_reference_measurements),
    ("binding", checks.check_binding),
    ("freshness", checks.check_freshness),
    ("revocation", _in_turn(gpu_checks.check_revocation, snp_platform.check_platform_tcb)),
    ("confidential mode", checks.check_confidential_mode),
    ("debug", checks.check_debug),
    ("tdx platform", tdx_checks.check_tdx_platform),
    ("measurement", _in_turn(checks.check_measurement, snp_platform.check_platform_pins)),
    ("key configuration", checks.check_key_config),
)
CHECK_NAMES: tuple[str, ...] = tuple(name for name, _ in CHECKS)


@dataclass(frozen=True, slots=True)
class CheckResult:
    """One check's outcome: passed True/False, or None when an earlier check failed."""

    name: str
    passed: bool | None
    detail: str


@dataclass(frozen=True, slots=True)
class VerifiedNode:
    """A node whose evidence passed every check under `policy_digest`.

    `hardware_id` names the chip it attests from (`attestation.hardware`): one chip is one node,
    however many keys, and so node ids, it presents.
    """

    node_id: str
    hardware_id: str
    key_config: bytes
    receipt_key: bytes  # the Ed25519 public key the evidence binds; it signs the node's receipts
    measurement: Measurement
    policy_digest: bytes
    expires_at: float
    backend: str
    simulated: bool
    checks: tuple[CheckResult, ...]
    # The CPU's identity from its verified report, so that one chip counts once:
    # "sev-snp:<CHIP_ID hex>" or "tdx-pck:<SHA-256 of the PCK public key>"; None without a hardware CPU report.
    cpu_chip_id: str | None = None


@dataclass(frozen=True, slots=True)
class VerificationReport:
    """Every check's result; `node` when all passed, else `error` (the first failure)."""

    checks: tuple[CheckResult, ...]
    node: VerifiedNode | None
    error: AttestationError | None

    def raise_for_failure(self) -> VerifiedNode:
        if self.node is None:
            assert self.error is not None
            raise self.error
        return self.node


def node_id_for(key_config: bytes, measurement: Measurement) -> str:
    """The node's identifier, the same for every party: hash of its key configuration and measurement."""
    material = b"veil-node-v1" + struct.pack(">H", len(key_config)) + key_config + measurement.digest()
    return hashlib.sha256(material).hexdigest()[:32]


def verify(
    bundle: EvidenceBundle,
    policy: Policy,
    *,
    expected_nonce: bytes | None = None,
    now: float | None = None,
    chain_time: dt.datetime | None = None,
) -> VerifiedNode:
    """Verify `bundle` under `policy`; return the node record or raise the failing check's error."""
    report = verify_with_report(bundle, policy, expected_nonce=expected_nonce, now=now, chain_time=chain_time)
    return report.raise_for_failure()


def verify_with_report(
    bundle: EvidenceBundle,
    policy: Policy,
    *,
    expected_nonce: bytes | None = None,
    now: float | None = None,
    chain_time: dt.datetime | None = None,
) -> VerificationReport:
    """Run every check in order, recording each result (for command lines and audit)."""
    moment = time.time() if now is None else now
    when = chain_time or dt.datetime.fromtimestamp(moment, dt.timezone.utc)
    ctx = checks.Context(bundle, policy, moment, expected_nonce, when)
    results: list[CheckResult] = []
    for name, check in CHECKS:
        try:
            results.append(CheckResult(name, True, check(ctx)))
        except AttestationError as error:
            results.append(CheckResult(name, False, str(error)))
            skipped = [CheckResult(rest, None, "not run") for rest in CHECK_NAMES[len(results):]]
            return VerificationReport(tuple(results + skipped), None, error)
    node = VerifiedNode(
        node_id=node_id_for(bundle.key_config, bundle.measurement),
        hardware_id=ctx.hardware_id,
        key_config=bundle.key_config,
        receipt_key=bundle.receipt_key,
        measurement=bundle.measurement,
        policy_digest=bundle.measurement.policy_digest,
        expires_at=float(bundle.timestamp + policy.attestation.max_evidence_age_s),
        backend=bundle.backend,
        simulated=ctx.simulated,
        checks=tuple(results),
        cpu_chip_id=ctx.cpu_report.chip_id if ctx.cpu_report is not None else None,
    )
    return VerificationReport(tuple(results), node, None)
