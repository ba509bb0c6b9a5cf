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


class SnpProductError(ChainError):
    """An SEV-SNP report's version or CPUID family and model do not fit the product line its VCEK names."""


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


class HostDataError(MeasurementNotAllowedError):
    """An SEV-SNP report's HOST_DATA is not one the policy pins (attestation.sev_snp_host_data)."""


class IdKeyDigestError(MeasurementNotAllowedError):
    """An SEV-SNP report's ID_KEY_DIGEST is not one the policy pins (attestation.sev_snp_id_key_digests)."""


class AuthorKeyDigestError(MeasurementNotAllowedError):
    """An SEV-SNP report's AUTHOR_KEY_DIGEST is not one the policy pins (attestation.sev_snp_author_key_digests)."""


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


class TcbBelowMinimumError(RevocationError):
    """An SEV-SNP platform's security patch level for one TCB component is below the policy's minimum:
    AMD has published flaws in the firmware or microcode it runs (a TCB recovery event)."""


class TcbMinimumMissingError(RevocationError):
    """The policy sets SEV-SNP minimums, none of them for the product line the VCEK names."""


class TdxPlatformError(AttestationError):
    """A TDX platform Intel's collateral does not vouch for, or that a policy pin refuses."""

    check = "tdx platform"


class TdxCollateralFormatError(TdxPlatformError):
    """Stapled TCB Info or QE Identity is missing, or is not the JSON Intel PCS serves."""


class CollateralChainError(TdxPlatformError):
    """The collateral's signing chain does not end at a pinned root, is broken, expired or revoked."""


class CollateralSignatureError(TdxPlatformError):
    """A TCB Info or QE Identity signature does not verify under the Intel TCB Signing certificate."""


class CollateralVersionError(TdxPlatformError):
    """A TCB Info or QE Identity has an id or version other than TDX TCB Info v3 / TD_QE Identity v2."""


class CollateralExpiredError(TdxPlatformError):
    """A TCB Info or QE Identity is past its nextUpdate, not yet issued, or older than the policy allows."""


class TcbEvaluationNumberError(TdxPlatformError):
    """A TCB Info or QE Identity predates the TCB recovery the policy requires (tcbEvaluationDataNumber)."""


class CollateralPlatformError(TdxPlatformError):
    """The TCB Info is for another platform (FMSPC or PCE id) than the PCK certificate names."""


class TdxModuleIdentityError(TdxPlatformError):
    """The TDX module's signer or attributes are not those Intel's TCB Info lists."""


class QeIdentityError(TdxPlatformError):
    """The quoting enclave's report does not match Intel's QE Identity."""


class TcbStatusError(TdxPlatformError):
    """The platform's or QE's TCB status under Intel's collateral is one the policy does not accept."""


class MrSeamError(TdxPlatformError):
    """The TDX module's measurement (MRSEAM) is not in the policy's allowlist."""


class MrConfigIdError(TdxPlatformError):
    """The TD's MRCONFIGID differs from the policy's pin."""


class MrOwnerError(TdxPlatformError):
    """The TD's MROWNER differs from the policy's pin."""


class MrOwnerConfigError(TdxPlatformError):
    """The TD's MROWNERCONFIG differs from the policy's pin."""


class FmspcError(TdxPlatformError):
    """The PCK certificate's FMSPC (platform model) is not in the policy's allowlist."""


class TeeTcbSvnError(TdxPlatformError):
    """The quote's TEE_TCB_SVN is below the policy's minimum in some component."""


class QeVendorIdError(TdxPlatformError):
    """The quote's QE vendor id differs from the policy's pin."""
