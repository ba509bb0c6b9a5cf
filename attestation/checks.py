"""The verifier's checks, in order. Each takes the shared context, returns a one-line
detail on success and raises its own AttestationError subclass on failure."""

from __future__ import annotations

import datetime as dt
import hmac
from dataclasses import dataclass, field

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, utils

from attestation import spdm
from attestation.binding import gpu_nonce, report_data
from attestation.bundle import EvidenceBundle
from attestation.certs import fingerprint, load_der_chain, verify_chain
from attestation.cpu_evidence import VerifiedCpuChain, check_cpu_revocation, verify_cpu_chain, verify_cpu_report
from attestation.cpu_reports import CpuReport, LaunchMeasurement, parse_cpu_report
from attestation.errors import (
    BindingError,
    ChainError,
    ConfidentialModeError,
    DebugModeError,
    FreshnessError,
    KeyConfigError,
    LaunchMeasurementError,
    MeasurementNotAllowedError,
    MigrationAgentError,
    PolicyMismatchError,
    PrivilegeLevelError,
    SignatureError,
    SimulatedEvidenceError,
)
from attestation.hardware import hardware_id, is_bound
from attestation.revocation import CrlAgeLimits
from attestation.sim_root import local_sim_root_certificate
from policy import Policy
from policy.model import LaunchReference


@dataclass
class Context:
    """What the checks share: inputs, and what earlier checks established."""

    bundle: EvidenceBundle
    policy: Policy
    now: float
    expected_nonce: bytes | None
    chain_time: dt.datetime
    leaves: dict[str, x509.Certificate] = field(default_factory=dict)
    gpu_chain: tuple[x509.Certificate, ...] = ()
    rim_chains: dict[str, tuple[x509.Certificate, ...]] = field(default_factory=dict)
    gpu_report: spdm.SpdmReport | None = None
    cpu_report: CpuReport | None = None
    hardware_id: str = ""
    cpu_chain: VerifiedCpuChain | None = None

    @property
    def simulated(self) -> bool:
        return self.bundle.backend == "sim"


def check_simulated(ctx: Context) -> str:
    if not ctx.simulated:
        return f"hardware evidence ({ctx.bundle.backend})"
    if not ctx.policy.attestation.allow_simulated:
        raise SimulatedEvidenceError(
            f"simulated evidence is refused by policy {ctx.policy.name!r}: no hardware protects this node. "
            "Only a development policy (dev) accepts it"
        )
    return f"SIMULATED evidence accepted by development policy {ctx.policy.name!r}: nothing protects this node"


def check_chain(ctx: Context) -> str:
    pinned = pinned_roots(ctx, ctx.policy.attestation.pinned_roots)
    notes = []
    gpu = ctx.bundle.gpu
    if gpu is not None:
        chain = load_der_chain(gpu.cert_chain, "GPU")
        ctx.leaves["gpu"] = verify_chain(chain, pinned, what="GPU", at_time=ctx.chain_time)
        ctx.gpu_chain = chain
        notes.append(f"GPU chain of {len(chain)} to pinned root {fingerprint(chain[-1])[:16]}…")
    cpu = ctx.bundle.cpu
    if cpu is not None and cpu.kind == "sim":
        chain = load_der_chain(cpu.cert_chain, "CPU")
        ctx.leaves["cpu"] = verify_chain(chain, pinned, what="CPU", at_time=ctx.chain_time)
        notes.append(f"CPU chain of {len(chain)} to pinned root {fingerprint(chain[-1])[:16]}…")
    elif cpu is not None:
        ctx.cpu_chain = verify_cpu_chain(cpu, pinned, ctx.chain_time)
        revocation = check_cpu_revocation(cpu, ctx.cpu_chain, ctx.chain_time, CrlAgeLimits.of(ctx.policy.attestation))
        notes.append(f"{cpu.kind} chain {ctx.cpu_chain.detail}, {revocation}")
    if not notes:
        raise ChainError("the evidence holds neither a CPU nor a GPU report")
    # Read from the chains just verified, so the identity is the pinned root's word, not the node's.
    ctx.hardware_id = hardware_id(ctx.bundle)
    if is_bound(ctx.bundle):
        notes.append(f"device identity {ctx.hardware_id[:16]}…")
    return "; ".join(notes)


def check_signature(ctx: Context) -> str:
    notes = []
    if ctx.bundle.gpu is not None:
        ctx.gpu_report = spdm.parse_report(ctx.bundle.gpu.report)
        spdm.verify_report_signature(ctx.gpu_report, ctx.leaves["gpu"])
        _check_label(ctx, "GPU", ctx.gpu_report.is_simulated, ctx.bundle.gpu.kind == "sim")
        notes.append("GPU report signature valid (ECDSA P-384)")
    if ctx.bundle.cpu is not None:
        if ctx.cpu_chain is None:
            ctx.cpu_report = parse_cpu_report(ctx.bundle.cpu.kind, ctx.bundle.cpu.report)
            _verify_raw_p384(ctx.leaves["cpu"], ctx.cpu_report.signed_part, ctx.cpu_report.signature)
            notes.append("CPU report signature valid (ECDSA P-384)")
        else:
            ctx.cpu_report = verify_cpu_report(ctx.bundle.cpu, ctx.cpu_chain)
            notes.append(f"{ctx.cpu_report.kind} report signature valid; its certificate certifies this CPU's fields")
        _check_label(ctx, "CPU", ctx.cpu_report.simulated, ctx.cpu_report.kind == "sim")
    return "; ".join(notes)


def check_binding(ctx: Context) -> str:
    bundle = ctx.bundle
    expected = report_data(bundle.key_config, bundle.receipt_key, bundle.measurement, bundle.freshness())
    if not hmac.compare_digest(expected, bundle.report_data):
        raise BindingError("report_data does not match the key configuration, receipt key, measurement and freshness "
                           "in the bundle")
    if ctx.cpu_report is not None and not hmac.compare_digest(ctx.cpu_report.report_data, expected):
        raise BindingError("the CPU report carries different report_data than the bundle binds")
    if ctx.gpu_report is not None and not hmac.compare_digest(ctx.gpu_report.request_nonce, gpu_nonce(expected)):
        raise BindingError("the GPU report was requested with a nonce other than SHA-256(report_data)")
    return "key configuration, receipt key, measurement and freshness bound into " + " and ".join(_parts(ctx))


def check_freshness(ctx: Context) -> str:
    attestation = ctx.policy.attestation
    age = ctx.now - ctx.bundle.timestamp
    if age > attestation.max_evidence_age_s:
        raise FreshnessError(f"evidence is {age:.0f} s old; policy allows {attestation.max_evidence_age_s} s. Ask for fresh evidence")
    if -age > attestation.max_clock_skew_s:
        raise FreshnessError(f"evidence is dated {-age:.0f} s in the future; policy allows {attestation.max_clock_skew_s} s of clock skew")
    if ctx.expected_nonce is not None and not hmac.compare_digest(ctx.expected_nonce, ctx.bundle.nonce):
        raise FreshnessError("evidence answers a different nonce than the one this verifier asked for")
    nonce_note = "nonce matches" if ctx.expected_nonce is not None else "no nonce requested"
    return f"{max(age, 0):.0f} s old (max {attestation.max_evidence_age_s} s); {nonce_note}"


def check_confidential_mode(ctx: Context) -> str:
    present = {"cpu": ctx.bundle.cpu is not None, "gpu": ctx.bundle.gpu is not None}
    for part in ctx.policy.attestation.required_confidential_mode:
        if not present[part]:
            raise ConfidentialModeError(f"policy requires {part.upper()} confidential-computing evidence and the bundle has none")
    notes = [f"CPU TEE {ctx.bundle.cpu.kind}"] if ctx.bundle.cpu is not None else []
    if ctx.cpu_report is not None and not ctx.cpu_report.vendor_module:
        raise ConfidentialModeError(
            "the TDX module that made the TD report is not Intel's (MRSIGNERSEAM is not zero): the TD's "
            "protections are only as good as a module Intel did not sign"
        )
    if ctx.cpu_report is not None and ctx.cpu_report.vmpl != 0:
        raise PrivilegeLevelError(
            f"the SEV-SNP report was requested at VMPL{ctx.cpu_report.vmpl}, not VMPL0: a less privileged "
            "part of the VM asked for it; request reports from the guest kernel at VMPL0"
        )
    gpu = ctx.bundle.gpu
    if gpu is not None:
        allowed = ("PROD", "SIM") if ctx.simulated else ("PROD",)
        if not gpu.state.cc_feature or gpu.state.environment not in allowed:
            raise ConfidentialModeError(
                f"GPU confidential computing is off (environment {gpu.state.environment}, "
                f"ccFeature {'on' if gpu.state.cc_feature else 'off'}); the node must run in CC mode"
            )
        notes.append(f"GPU CC on (environment {gpu.state.environment})")
    return "; ".join(notes)


# A migration agent moves the whole guest, every request in it, to a machine its host chooses: a node
# that may be migrated is refused as one that may be debugged is.
_MIGRATION_AGENT = {
    "sev-snp": "the SEV-SNP guest policy allows a migration agent (MIGRATE_MA), which can export the guest's memory",
    "tdx": "the TD is migratable (TDATTRIBUTES.MIGRATABLE): a migration TD can export its memory",
}


def check_debug(ctx: Context) -> str:
    if ctx.cpu_report is not None and ctx.cpu_report.debug:
        raise DebugModeError(f"the {ctx.cpu_report.kind} CPU TEE allows debugging; its memory is readable by the host")
    if ctx.cpu_report is not None and ctx.cpu_report.migration_agent:
        raise MigrationAgentError(_MIGRATION_AGENT[ctx.cpu_report.kind])
    gpu = ctx.bundle.gpu
    if gpu is not None and gpu.state.devtools_mode:
        raise DebugModeError("GPU developer tools mode is on; GPU memory is readable by tools")
    return "debug off: " + " and ".join(_parts(ctx))


def check_measurement(ctx: Context) -> str:
    measurement = ctx.bundle.measurement
    if not hmac.compare_digest(measurement.policy_digest, ctx.policy.digest):
        raise PolicyMismatchError(
            f"the node runs under a different policy than {ctx.policy.name!r} (policy digest differs); "
            "verify it against the policy it publishes, or do not use it"
        )
    code = _allowed(measurement.code_digest, ctx.policy.attestation.allowed_code_digests,
                    ctx.policy.attestation.accept_unlisted_code, "code")
    if not ctx.simulated:
        code += f" with {_check_launch(ctx)}"
    model = _allowed(measurement.model_digest, ctx.policy.engine.allowed_model_digests,
                     ctx.policy.engine.accept_unlisted_models, "model")
    return f"policy {ctx.policy.name!r} ({ctx.policy.digest.hex()[:16]}…); {code}; {model}"


def _check_launch(ctx: Context) -> str:
    """The code digest counts only with a CPU launch measurement the policy names for it."""
    attestation = ctx.policy.attestation
    launch = ctx.cpu_report.launch if ctx.cpu_report is not None else None
    if launch is None:
        if attestation.accept_unlisted_code:
            return "no CPU launch measurement, accepted by development policy"
        raise LaunchMeasurementError(
            "the evidence holds no CPU TEE report, so the code digest is not tied to a launch measurement; "
            "the node must attest its CPU TEE"
        )
    named = [ref for ref in attestation.launch_measurements if _launch_matches(ref, launch)]
    code = ctx.bundle.measurement.code_digest.hex()
    label = f"{launch.tee} launch measurement {launch.measurement.hex()[:16]}…"
    if any(ref.code_digest == code for ref in named):
        return f"{label} listed for it"
    if attestation.accept_unlisted_code:
        return f"{label} UNLISTED, accepted by development policy"
    if named:
        raise LaunchMeasurementError(
            f"the {launch.tee} launch measurement is listed for other code than the attested code digest; "
            "the node's image and its claimed code disagree"
        )
    raise LaunchMeasurementError(
        f"the {launch.tee} launch measurement is not one the policy names; the VM runs an unreviewed image"
    )


def _launch_matches(reference: LaunchReference, launch: LaunchMeasurement) -> bool:
    if reference.tee != launch.tee or reference.measurement != launch.measurement.hex():
        return False
    return all(expected is None or expected == actual.hex() for expected, actual in zip(reference.rtmrs, launch.rtmrs))


def check_key_config(ctx: Context) -> str:
    from ohttp.errors import OHTTPError
    from ohttp.keys import KeyConfig

    try:
        config = KeyConfig.decode(ctx.bundle.key_config)
    except (OHTTPError, ValueError) as error:
        raise KeyConfigError(f"the bound OHTTP key configuration is unusable: {error}") from None
    return f"OHTTP key configuration {config.key_id}, KEM 0x{config.kem_id:04x}, {len(config.supported_suites())} usable suite(s)"


def pinned_roots(ctx: Context, fingerprints: tuple[str, ...]) -> set[str]:
    """The policy's pinned `fingerprints`, plus this machine's simulated root when the policy trusts it."""
    pinned = set(fingerprints)
    if ctx.policy.attestation.trust_local_simulated_root:
        local = local_sim_root_certificate()
        if local is not None:
            pinned.add(fingerprint(local))
    return pinned


def _check_label(ctx: Context, part: str, signed_simulated: bool, kind_simulated: bool) -> None:
    if signed_simulated != ctx.simulated or kind_simulated != ctx.simulated:
        raise SimulatedEvidenceError(
            f"the {part} report's signed simulated marker does not match the bundle's backend "
            f"({ctx.bundle.backend}): simulated evidence must never pass as hardware"
        )


def _verify_raw_p384(leaf: x509.Certificate, signed: bytes, signature: bytes) -> None:
    public_key = leaf.public_key()
    if not isinstance(public_key, ec.EllipticCurvePublicKey):
        raise SignatureError("the CPU report's leaf certificate does not hold an ECDSA key")
    der = utils.encode_dss_signature(int.from_bytes(signature[:48], "big"), int.from_bytes(signature[48:], "big"))
    try:
        public_key.verify(der, signed, ec.ECDSA(hashes.SHA384()))
    except InvalidSignature:
        raise SignatureError("the CPU report's signature does not verify under its leaf certificate") from None


def _allowed(digest: bytes, allowlist: tuple[str, ...], accept_unlisted: bool, what: str) -> str:
    if digest.hex() in allowlist:
        return f"{what} {digest.hex()[:16]}… listed"
    if accept_unlisted:
        return f"{what} {digest.hex()[:16]}… UNLISTED, accepted by development policy"
    raise MeasurementNotAllowedError(f"the {what} measurement is not in the policy's allowlist; the node runs unreviewed {what}")


def _parts(ctx: Context) -> list[str]:
    return [name for name, present in (("CPU report", ctx.bundle.cpu), ("GPU report", ctx.bundle.gpu)) if present]
