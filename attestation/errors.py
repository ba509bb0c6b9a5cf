"""The attestation package's errors: one type per verification check, one per collection fault.

Every error that the verifier raises carries `check`, the name of the check
that failed, so that a command line or an audit event can report it without
parsing messages. Messages name what was wrong and what to do; they never
quote evidence bytes or keys.
"""

from __future__ import annotations


class AttestationError(Exception):
    """Base of every attestation error."""

    check: str = "attestation"


class EvidenceFormatError(AttestationError):
    """An evidence bundle or report is malformed: bad JSON, unknown version, duplicated or missing fields, truncated data."""

    check = "format"


class CpuReportFormatError(EvidenceFormatError):
    """A CPU TEE report does not have its format's layout (wrong version, truncated, unknown kind)."""


class SimulatedEvidenceError(AttestationError):
    """Simulated evidence offered to a policy that refuses it, or simulated reports disguised as hardware."""

    check = "simulated"


class ChainError(AttestationError):
    """A certificate chain does not lead to a pinned root, is broken, or is not valid at the time of use."""

    check = "chain"


class CrlError(ChainError):
    """A stapled CRL is missing, not signed by its issuer, stale, or lists a certificate of the chain."""


class SignatureError(AttestationError):
    """A report's signature does not verify under its certificate chain's leaf key."""

    check = "signature"


class CertifiedTcbError(SignatureError):
    """An SEV-SNP report's REPORTED_TCB differs from the TCB its VCEK certifies."""


class ChipIdError(SignatureError):
    """An SEV-SNP report's CHIP_ID differs from the hwID its VCEK certifies."""


class QuotingEnclaveError(SignatureError):
    """A TDX quote's attestation key is not certified by Intel's quoting enclave under the PCK."""


class BindingError(AttestationError):
    """The reports are not bound to this key configuration, measurement and freshness."""

    check = "binding"


class FreshnessError(AttestationError):
    """Evidence is too old, from the future, or answers another nonce."""

    check = "freshness"


class ConfidentialModeError(AttestationError):
    """A required TEE is absent or the GPU is not in production confidential-computing mode."""

    check = "confidential mode"


class PrivilegeLevelError(ConfidentialModeError):
    """An SEV-SNP report was requested from a less privileged VM level than VMPL0."""


class DebugModeError(AttestationError):
    """CPU TEE debugging or GPU developer tools are on."""

    check = "debug"


class MigrationAgentError(DebugModeError):
    """The CPU TEE allows a migration agent to export the guest's memory (SEV-SNP MIGRATE_MA, TDX MIGRATABLE)."""


class MeasurementNotAllowedError(AttestationError):
    """The code or model measurement is not in the policy's allowlist."""

    check = "measurement"


class PolicyMismatchError(MeasurementNotAllowedError):
    """The node attests to a different policy than the one the verifier holds."""


class LaunchMeasurementError(MeasurementNotAllowedError):
    """The CPU TEE's launch measurement is not one the policy names for the attested code digest."""


class KeyConfigError(AttestationError):
    """The bound OHTTP key configuration is malformed or uses an unsupported suite."""

    check = "key configuration"


class BackendError(AttestationError):
    """Evidence could not be collected."""

    check = "collect"


class BackendUnavailableError(BackendError):
    """The requested backend cannot run on this machine."""


class NvmlMissingError(BackendUnavailableError):
    """NVIDIA's management library (NVML) is not installed or not loadable."""


class GpuConfidentialModeOffError(BackendError):
    """The GPU is present but not in production confidential-computing mode."""


class TsmUnavailableError(BackendUnavailableError):
    """Linux configfs-tsm is not available (no CPU TEE guest, or configfs not mounted)."""


class ResultTokenError(AttestationError):
    """A signed attestation result (JWT) failed verification."""

    check = "result token"


class ReferenceMeasurementError(AttestationError):
    """The GPU's measurements or firmware versions differ from NVIDIA's signed reference values (RIMs), or a RIM is missing."""

    check = "reference measurements"


class RimFormatError(ReferenceMeasurementError):
    """A reference integrity manifest is not a well-formed, safely parseable NVIDIA SWID tag."""


class RimSignatureError(ReferenceMeasurementError):
    """A RIM's XML signature (digest or ECDSA signature value) does not verify."""


class RimChainError(ReferenceMeasurementError):
    """A RIM's signing certificate chain does not lead to a pinned RIM root."""


class MeasurementMismatchError(ReferenceMeasurementError):
    """Measurement blocks of the GPU report differ from the RIMs' golden values; `indexes` lists the RIM indexes."""

    def __init__(self, message: str, indexes: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.indexes = indexes


class FirmwareVersionError(ReferenceMeasurementError):
    """The driver or VBIOS version in the GPU report is not the version a RIM describes."""


class RevocationError(AttestationError):
    """A certificate's revocation status (stapled OCSP response) is missing, invalid, stale or not good."""

    check = "revocation"


class OcspFormatError(RevocationError):
    """An OCSP response is malformed or not a successful basic response."""


class OcspSignatureError(RevocationError):
    """An OCSP response is not signed by the certificate's issuer or a responder the issuer delegated to."""


class OcspCertIdError(RevocationError):
    """An OCSP response answers for another certificate (its CertID does not match)."""


class OcspStaleError(RevocationError):
    """An OCSP response is older than the policy allows, dated in the future, or past its nextUpdate."""


class OcspNonceError(RevocationError):
    """An OCSP response carries a nonce other than this evidence's GPU nonce."""


class CertificateRevokedError(RevocationError):
    """An OCSP responder says a certificate is revoked, or does not know it."""
