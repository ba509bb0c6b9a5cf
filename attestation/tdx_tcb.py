"""Whether Intel still trusts a TDX platform, and whether it is the one a policy pins.

TCB evaluation follows Intel's TDX TCB Info algorithm (Intel PCS API v4, TDX TCB Info; as Intel's
Quote Verification Library and go-tdx-guest apply it):

1. The TDX module: MRSIGNERSEAM equals TCB Info's `tdxModule.mrsigner`, and SEAMATTRIBUTES under
   `attributesMask` equals `attributes`.
2. The platform: the first of TCB Info's levels (sorted, newest first) whose SGX component SVNs and
   PCESVN the PCK certificate reaches, and whose TDX components TEE_TCB_SVN reaches (from index 2 when
   TEE_TCB_SVN[1], the module's major version, is not 0), gives the status. None reached: not supported.
3. A versioned module (TEE_TCB_SVN[1] > 0): the identity `TDX_<version, 2 hex digits>` in
   `tdxModuleIdentities` gives a second status from its first level whose ISVSVN TEE_TCB_SVN[0] reaches.
4. The quoting enclave: its report's MRSIGNER, ISVPRODID, MISCSELECT and ATTRIBUTES (masked) match
   the QE Identity, and its first level whose ISVSVN the report reaches gives a third status.

Every status must be one the policy accepts; a status other than UpToDate passes only when each
advisory its level names is one the policy lists. Refusals name the status and the advisories.
"""

from __future__ import annotations

import hmac
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from attestation.errors import (
    CollateralPlatformError,
    FmspcError,
    MrConfigIdError,
    MrOwnerConfigError,
    MrOwnerError,
    MrSeamError,
    QeIdentityError,
    QeVendorIdError,
    TcbStatusError,
    TdxModuleIdentityError,
    TeeTcbSvnError,
)
from attestation.intel_collateral import EnclaveLevel, QeIdentity, TcbInfo, TcbLevel, VerifiedCollateral
from attestation.sgx_extensions import PckPlatform
from attestation.tdx import TdxQuote
from policy.model import AttestationPolicy

UP_TO_DATE = "UpToDate"


@dataclass(frozen=True, slots=True)
class TcbVerdict:
    """A status Intel's collateral gives one part of the platform (TDX platform, TDX module, QE)."""

    part: str
    status: str
    advisories: tuple[str, ...]

    def describe(self) -> str:
        advisories = f" (advisories {', '.join(self.advisories)})" if self.advisories else ""
        return f"{self.part} {self.status}{advisories}"


def check_pins(quote: TdxQuote, platform: PckPlatform, policy: AttestationPolicy) -> str:
    """Each pin the policy sets must match the evidence; refusals name the field, never its bytes."""
    _check_listed(platform.fmspc, policy.tdx_fmspcs, FmspcError, "the PCK certificate's FMSPC (platform model)")
    _check_listed(quote.mrseam, policy.tdx_mr_seams, MrSeamError, "the TDX module's MRSEAM")
    _check_pinned(quote.mr_config_id, policy.tdx_mr_config_id, MrConfigIdError, "MRCONFIGID")
    _check_pinned(quote.mr_owner, policy.tdx_mr_owner, MrOwnerError, "MROWNER")
    _check_pinned(quote.mr_owner_config, policy.tdx_mr_owner_config, MrOwnerConfigError, "MROWNERCONFIG")
    _check_pinned(quote.qe_vendor_id, policy.tdx_qe_vendor_id, QeVendorIdError, "QE vendor id")
    minimum = bytes.fromhex(policy.tdx_min_tee_tcb_svn)
    below = [index for index, floor in enumerate(minimum) if quote.tee_tcb_svn[index] < floor]
    if below:
        raise TeeTcbSvnError(
            f"the TDX quote's TEE_TCB_SVN is below the policy's minimum in component(s) {below}: "
            "update the TDX module and microcode"
        )
    pinned = sum(bool(pin) for pin in (policy.tdx_fmspcs, policy.tdx_mr_seams, policy.tdx_mr_config_id,
                                       policy.tdx_mr_owner, policy.tdx_mr_owner_config, policy.tdx_qe_vendor_id,
                                       policy.tdx_min_tee_tcb_svn))
    return f"{pinned} TDX pin(s) match"


def evaluate_tcb(quote: TdxQuote, platform: PckPlatform, collateral: VerifiedCollateral) -> tuple[TcbVerdict, ...]:
    """The statuses Intel's collateral gives this platform, its TDX module and its QE."""
    tcb_info = collateral.tcb_info
    if tcb_info.fmspc != platform.fmspc or tcb_info.pce_id != platform.pce_id:
        raise CollateralPlatformError(
            "the stapled TCB Info is for another platform (FMSPC or PCE id) than the PCK certificate names: "
            "the node must staple the TCB Info for its own FMSPC"
        )
    _check_module(quote, tcb_info)
    verdicts = [_platform_verdict(quote, platform, tcb_info.levels)]
    if quote.tee_tcb_svn[1] > 0:
        verdicts.append(_module_verdict(quote, tcb_info))
    verdicts.append(qe_verdict(quote.qe_report, collateral.qe_identity))
    return tuple(verdicts)


def check_statuses(verdicts: Sequence[TcbVerdict], policy: AttestationPolicy) -> str:
    """Refuse any status the policy does not accept, naming it and its advisories."""
    for verdict in verdicts:
        unaccepted = [advisory for advisory in verdict.advisories if advisory not in policy.tdx_accepted_advisories]
        if verdict.status not in policy.tdx_accepted_tcb_statuses or (verdict.status != UP_TO_DATE and unaccepted):
            raise TcbStatusError(
                f"Intel's collateral rates the {verdict.describe()}; the policy accepts "
                f"{', '.join(policy.tdx_accepted_tcb_statuses)}"
                + (f" with advisories {', '.join(policy.tdx_accepted_advisories)} only" if verdict.status != UP_TO_DATE
                   and verdict.status in policy.tdx_accepted_tcb_statuses else "")
                + ": the platform needs a firmware or microcode update (TCB recovery)"
            )
    return "; ".join(verdict.describe() for verdict in verdicts)


def _check_listed(value: bytes, allowed: tuple[str, ...], error: type[Exception], what: str) -> None:
    if allowed and value.hex() not in allowed:
        raise error(f"{what} is not in the policy's allowlist")


def _check_pinned(value: bytes, pin: str, error: type[Exception], what: str) -> None:
    if pin and not hmac.compare_digest(value.hex(), pin):
        raise error(f"the TDX quote's {what} differs from the policy's pin")


def _check_module(quote: TdxQuote, tcb_info: TcbInfo) -> None:
    module = tcb_info.module
    attributes = struct.pack("<Q", quote.seam_attributes)
    masked = bytes(a & m for a, m in zip(attributes, module.attributes_mask))
    if quote.mrsigner_seam != module.mrsigner or masked != module.attributes:
        raise TdxModuleIdentityError(
            "the TDX module's signer (MRSIGNERSEAM) or attributes are not those Intel's TCB Info lists"
        )


def _platform_verdict(quote: TdxQuote, platform: PckPlatform, levels: Sequence[TcbLevel]) -> TcbVerdict:
    start = 2 if quote.tee_tcb_svn[1] > 0 else 0  # a versioned module is rated by its own identity (step 3)
    for level in levels:
        if (all(have >= need for have, need in zip(platform.cpu_svns, level.sgx_svns))
                and platform.pce_svn >= level.pce_svn
                and all(quote.tee_tcb_svn[i] >= level.tdx_svns[i] for i in range(start, 16))):
            return TcbVerdict("TDX platform TCB", level.status, level.advisories)
    raise TcbStatusError(
        "the TDX platform's TCB is below every level in Intel's TCB Info for its FMSPC (TCB not supported): "
        "the platform needs a BIOS, microcode or TDX module update"
    )


def _module_verdict(quote: TdxQuote, tcb_info: TcbInfo) -> TcbVerdict:
    identity_id = f"TDX_{quote.tee_tcb_svn[1]:02X}"
    for identity in tcb_info.module_identities:
        if identity.id.upper() == identity_id:
            attributes = struct.pack("<Q", quote.seam_attributes)
            masked = bytes(a & m for a, m in zip(attributes, identity.attributes_mask))
            if quote.mrsigner_seam != identity.mrsigner or masked != identity.attributes:
                raise TdxModuleIdentityError(f"the TDX module does not match Intel's identity {identity_id}")
            return _enclave_verdict(f"TDX module {identity_id}", identity.levels, quote.tee_tcb_svn[0])
    raise TcbStatusError(f"Intel's TCB Info lists no TDX module identity {identity_id}: the module version is not supported")


def qe_verdict(qe_report: bytes, identity: QeIdentity) -> TcbVerdict:
    miscselect = bytes(a & m for a, m in zip(qe_report[16:20], identity.miscselect_mask))
    attributes = bytes(a & m for a, m in zip(qe_report[48:64], identity.attributes_mask))
    isvprodid, isvsvn = struct.unpack_from("<HH", qe_report, 256)
    if (qe_report[128:160] != identity.mrsigner or isvprodid != identity.isvprodid
            or miscselect != identity.miscselect or attributes != identity.attributes):
        raise QeIdentityError(
            "the TDX quoting enclave does not match Intel's TD_QE Identity (MRSIGNER, ISVPRODID, MISCSELECT or ATTRIBUTES)"
        )
    return _enclave_verdict("TD quoting enclave", identity.levels, isvsvn)


def _enclave_verdict(part: str, levels: Sequence[EnclaveLevel], isvsvn: int) -> TcbVerdict:
    for level in levels:
        if isvsvn >= level.isvsvn:
            return TcbVerdict(part, level.status, level.advisories)
    raise TcbStatusError(f"the {part}'s ISVSVN is below every level Intel lists for it (TCB not supported)")
