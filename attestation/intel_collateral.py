"""Intel's TDX collateral, stapled by the node and verified offline: TCB Info v3 and TD_QE Identity v2.

Intel PCS serves each as JSON `{"tcbInfo": {...}, "signature": "<r ‖ s hex>"}` (or `enclaveIdentity`),
signed with ECDSA P-256 / SHA-256 over the exact bytes of the inner object by the Intel SGX TCB
Signing certificate, which the Intel SGX Root CA issues (and revokes in its CRL, which the node
already staples). The verifier never fetches; it checks, in order: the issuer chain to a pinned root
and not revoked, each signature over the bytes as served, the layout, `id` and `version`, the
validity window (`issueDate` ≤ now ≤ `nextUpdate`, and no older than the policy allows), and
`tcbEvaluationDataNumber` against the policy's minimum (the TCB recovery it requires).
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, utils

from attestation import encoding as enc
from attestation.bundle import TdxCollateral
from attestation.certs import load_der_chain, verify_chain
from attestation.errors import (
    ChainError,
    CollateralChainError,
    CollateralExpiredError,
    CollateralSignatureError,
    CollateralVersionError,
    EvidenceFormatError,
    TcbEvaluationNumberError,
    TdxCollateralFormatError,
)
from attestation.revocation import CrlAgeLimits, check_chain_not_revoked

TCB_INFO = ("tcbInfo", "TDX", 3)  # (outer key, id, version) Veil verifies
QE_IDENTITY = ("enclaveIdentity", "TD_QE", 2)
_SIGNED = re.compile(rb'\A\{"(tcbInfo|enclaveIdentity)":(\{.*\}),"signature":"([0-9a-fA-F]{128})"\}\s*\Z', re.DOTALL)
_ADVISORY = re.compile(r"INTEL-SA-\d{5}")


@dataclass(frozen=True, slots=True)
class CollateralLimits:
    """What the policy asks of collateral."""

    max_age_s: int
    min_evaluation_number: int
    crl_ages: CrlAgeLimits  # the root CA's CRL, which must not list the TCB Signing certificate, takes the root's


@dataclass(frozen=True, slots=True)
class TcbLevel:
    """One TCB Info level: the SVNs a platform must reach for `status` to be its own."""

    sgx_svns: tuple[int, ...]
    pce_svn: int
    tdx_svns: tuple[int, ...]
    status: str
    advisories: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class EnclaveLevel:
    """A QE Identity or TDX module identity level: an ISVSVN floor and its status."""

    isvsvn: int
    status: str
    advisories: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ModuleIdentity:
    """The TDX module Intel vouches for: its signer and attributes (and, for a versioned module, levels)."""

    id: str
    mrsigner: bytes
    attributes: bytes
    attributes_mask: bytes
    levels: tuple[EnclaveLevel, ...] = ()


@dataclass(frozen=True, slots=True)
class TcbInfo:
    """TDX TCB Info v3 for one platform model (FMSPC)."""

    fmspc: bytes
    pce_id: bytes
    evaluation_number: int
    module: ModuleIdentity
    module_identities: tuple[ModuleIdentity, ...]
    levels: tuple[TcbLevel, ...]


@dataclass(frozen=True, slots=True)
class QeIdentity:
    """TD_QE Identity v2: what Intel's TD quoting enclave looks like, and its TCB levels."""

    evaluation_number: int
    miscselect: bytes
    miscselect_mask: bytes
    attributes: bytes
    attributes_mask: bytes
    mrsigner: bytes
    isvprodid: int
    levels: tuple[EnclaveLevel, ...]


@dataclass(frozen=True, slots=True)
class VerifiedCollateral:
    tcb_info: TcbInfo
    qe_identity: QeIdentity


def verify_collateral(
    collateral: TdxCollateral | None, pinned_roots: Collection[str], crls: Sequence[bytes], at_time: dt.datetime,
    limits: CollateralLimits,
) -> VerifiedCollateral:
    """Verify the stapled TCB Info and QE Identity; return their contents or raise a TdxPlatformError."""
    if collateral is None:
        raise TdxCollateralFormatError(
            "the TDX evidence carries no Intel collateral: the node must staple the TCB Info for its FMSPC and the "
            "TD_QE Identity, fetched from Intel PCS (see attestation/backends/collateral.py)"
        )
    signer = _verify_issuer_chain(collateral.issuer_chain, pinned_roots, crls, at_time, limits.crl_ages)
    tcb_info = _verified_document(collateral.tcb_info, TCB_INFO, signer, at_time, limits)
    qe_identity = _verified_document(collateral.qe_identity, QE_IDENTITY, signer, at_time, limits)
    return VerifiedCollateral(_read_tcb_info(tcb_info), _read_qe_identity(qe_identity))


def _verify_issuer_chain(
    chain: Sequence[bytes], pinned_roots: Collection[str], crls: Sequence[bytes], at_time: dt.datetime,
    crl_ages: CrlAgeLimits,
) -> x509.Certificate:
    try:
        certificates = load_der_chain(chain, "Intel TCB signing")
        if len(certificates) != 2:
            raise ChainError("the Intel TCB signing chain must hold the TCB Signing certificate and the root")
        signer = verify_chain(certificates, pinned_roots, what="Intel TCB signing", at_time=at_time)
        check_chain_not_revoked(certificates, crls, issuers=(1,), at_time=at_time, limits=crl_ages,
                                what="Intel TCB signing chain")
    except ChainError as error:  # CrlError included: the collateral is refused by its own check
        raise CollateralChainError(f"TDX collateral: {error}") from None
    return signer


def _verified_document(
    body: bytes, kind: tuple[str, str, int], signer: x509.Certificate, at_time: dt.datetime, limits: CollateralLimits,
) -> dict[str, Any]:
    outer, expected_id, expected_version = kind
    match = _SIGNED.match(body)
    if match is None or match.group(1).decode() != outer:
        raise TdxCollateralFormatError(f"the stapled {outer} is not Intel PCS's signed JSON ({{\"{outer}\": ..., \"signature\": ...}})")
    _verify_signature(signer, match.group(2), bytes.fromhex(match.group(3).decode()), outer)
    document = _object(match.group(2), outer)
    if document.get("id") != expected_id or document.get("version") != expected_version:
        raise CollateralVersionError(
            f"the stapled {outer} is not {expected_id} version {expected_version} (Veil verifies TDX TCB Info v3 "
            "and TD_QE Identity v2); fetch it from Intel PCS's /tdx/certification/v4 API"
        )
    _check_window(document, outer, at_time, limits.max_age_s)
    number = _int(document, "tcbEvaluationDataNumber", outer)
    if number < limits.min_evaluation_number:
        raise TcbEvaluationNumberError(
            f"the stapled {outer} has tcbEvaluationDataNumber {number}; the policy requires at least "
            f"{limits.min_evaluation_number} (a TCB recovery it predates): fetch current collateral"
        )
    return document


def _verify_signature(signer: x509.Certificate, signed: bytes, signature: bytes, outer: str) -> None:
    key = signer.public_key()
    if not isinstance(key, ec.EllipticCurvePublicKey):
        raise CollateralSignatureError("the Intel TCB Signing certificate does not hold an ECDSA key")
    der = utils.encode_dss_signature(int.from_bytes(signature[:32], "big"), int.from_bytes(signature[32:], "big"))
    try:
        key.verify(der, signed, ec.ECDSA(hashes.SHA256()))
    except InvalidSignature:
        raise CollateralSignatureError(
            f"the stapled {outer} signature does not verify under the Intel TCB Signing certificate"
        ) from None


def _check_window(document: dict[str, Any], outer: str, at_time: dt.datetime, max_age_s: int) -> None:
    issued, next_update = _date(document, "issueDate", outer), _date(document, "nextUpdate", outer)
    if issued > at_time:
        raise CollateralExpiredError(f"the stapled {outer} is issued in the future ({issued:%Y-%m-%d}); check the node's clock")
    if next_update < at_time:
        raise CollateralExpiredError(
            f"the stapled {outer} expired at its nextUpdate {next_update:%Y-%m-%d %H:%M} UTC; the node must fetch a new one"
        )
    age = (at_time - issued).total_seconds()
    if age > max_age_s:
        raise CollateralExpiredError(
            f"the stapled {outer} is {age:.0f} s old; the policy allows {max_age_s} s. The node must fetch a new one"
        )


def _read_tcb_info(document: dict[str, Any]) -> TcbInfo:
    where = "tcbInfo"
    if _int(document, "tcbType", where) != 0:
        raise CollateralVersionError("the stapled tcbInfo has a tcbType other than 0, the only one Intel defines")
    identities = _list(document.get("tdxModuleIdentities", []), f"{where}.tdxModuleIdentities")
    return TcbInfo(
        fmspc=_hex(document, "fmspc", where, 6),
        pce_id=_hex(document, "pceId", where, 2),
        evaluation_number=_int(document, "tcbEvaluationDataNumber", where),
        module=_module(_object_value(document.get("tdxModule"), f"{where}.tdxModule"), f"{where}.tdxModule", levels=False),
        module_identities=tuple(_module(_object_value(item, f"{where}.tdxModuleIdentities"), f"{where}.tdxModuleIdentities",
                                        levels=True) for item in identities),
        levels=tuple(_tcb_level(item) for item in _list(document.get("tcbLevels"), f"{where}.tcbLevels")),
    )


def _read_qe_identity(document: dict[str, Any]) -> QeIdentity:
    where = "enclaveIdentity"
    return QeIdentity(
        evaluation_number=_int(document, "tcbEvaluationDataNumber", where),
        miscselect=_hex(document, "miscselect", where, 4), miscselect_mask=_hex(document, "miscselectMask", where, 4),
        attributes=_hex(document, "attributes", where, 16), attributes_mask=_hex(document, "attributesMask", where, 16),
        mrsigner=_hex(document, "mrsigner", where, 32), isvprodid=_int(document, "isvprodid", where),
        levels=_enclave_levels(document, where),
    )


def _module(value: dict[str, Any], where: str, *, levels: bool) -> ModuleIdentity:
    return ModuleIdentity(
        id=str(value.get("id", "")), mrsigner=_hex(value, "mrsigner", where, 48),
        attributes=_hex(value, "attributes", where, 8), attributes_mask=_hex(value, "attributesMask", where, 8),
        levels=_enclave_levels(value, where) if levels else (),
    )


def _tcb_level(value: Any) -> TcbLevel:
    where = "tcbInfo.tcbLevels"
    level = _object_value(value, where)
    tcb = _object_value(level.get("tcb"), f"{where}.tcb")
    return TcbLevel(
        sgx_svns=_components(tcb.get("sgxtcbcomponents"), f"{where}.tcb.sgxtcbcomponents"),
        pce_svn=_int(tcb, "pcesvn", f"{where}.tcb"),
        tdx_svns=_components(tcb.get("tdxtcbcomponents"), f"{where}.tcb.tdxtcbcomponents"),
        status=_status(level, where), advisories=_advisories(level, where),
    )


def _enclave_levels(value: dict[str, Any], where: str) -> tuple[EnclaveLevel, ...]:
    levels = []
    for item in _list(value.get("tcbLevels"), f"{where}.tcbLevels"):
        level = _object_value(item, f"{where}.tcbLevels")
        tcb = _object_value(level.get("tcb"), f"{where}.tcbLevels.tcb")
        levels.append(EnclaveLevel(_int(tcb, "isvsvn", f"{where}.tcbLevels.tcb"), _status(level, where),
                                   _advisories(level, where)))
    return tuple(levels)


def _components(value: Any, where: str) -> tuple[int, ...]:
    items = _list(value, where)
    if len(items) != 16:
        raise TdxCollateralFormatError(f"{where} must list 16 components")
    return tuple(_int(_object_value(item, where), "svn", where) for item in items)


def _status(level: dict[str, Any], where: str) -> str:
    status = level.get("tcbStatus")
    if not isinstance(status, str) or not status.isalpha():
        raise TdxCollateralFormatError(f"{where} holds a level without a tcbStatus")
    return status


def _advisories(level: dict[str, Any], where: str) -> tuple[str, ...]:
    advisories = _list(level.get("advisoryIDs", []), f"{where}.advisoryIDs")
    if not all(isinstance(item, str) and _ADVISORY.fullmatch(item) for item in advisories):
        raise TdxCollateralFormatError(f"{where}.advisoryIDs must be Intel advisory ids (INTEL-SA-NNNNN)")
    return tuple(advisories)


def _object(text: bytes, where: str) -> dict[str, Any]:
    try:
        return _object_value(enc.loads_strict(text), where)
    except EvidenceFormatError:
        raise TdxCollateralFormatError(f"the stapled {where} is not valid JSON (or repeats a field)") from None


def _object_value(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TdxCollateralFormatError(f"{where} must be a JSON object")
    return value


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise TdxCollateralFormatError(f"{where} must be a JSON list")
    return value


def _int(document: dict[str, Any], key: str, where: str) -> int:
    value = document.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 16:
        raise TdxCollateralFormatError(f"{where}.{key} must be an integer from 0 to 65535")
    return value


def _hex(document: dict[str, Any], key: str, where: str, size: int) -> bytes:
    value = document.get(key)
    if not isinstance(value, str) or not re.fullmatch(f"[0-9a-fA-F]{{{2 * size}}}", value):
        raise TdxCollateralFormatError(f"{where}.{key} must be {size} bytes of hexadecimal")
    return bytes.fromhex(value)


def _date(document: dict[str, Any], key: str, where: str) -> dt.datetime:
    value = document.get(key)
    if not isinstance(value, str) or not re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", value):
        raise TdxCollateralFormatError(f"{where}.{key} must be an ISO 8601 UTC time (YYYY-MM-DDThh:mm:ssZ)")
    try:
        return dt.datetime.strptime(value, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.timezone.utc)
    except ValueError:
        raise TdxCollateralFormatError(f"{where}.{key} is not a calendar time") from None
