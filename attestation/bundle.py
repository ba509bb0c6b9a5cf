"""The evidence bundle: what a node sends to prove what it is (JSON, base64 fields, versioned).

    {
      "version": "veil-evidence-v2",
      "backend": "sim" | "nvml" | "tsm",
      "key_config": b64,                       # the node's OHTTP key configuration (RFC 9458)
      "receipt_key": b64,                      # the node's receipt-signing Ed25519 public key (32 bytes)
      "measurement": {"code": b64, "policy": b64, "model": b64},
      "freshness": {"nonce": b64, "timestamp": int},   # 32-byte nonce, Unix seconds
      "report_data": b64,                      # 64 bytes, see attestation.binding
      "cpu": null | {"kind": "sim" | "tdx" | "sev-snp", "report": b64, "cert_chain": [b64 DER, ...],
                     "crls": [b64 DER, ...],       # optional, default []
                     "tdx_collateral": {"tcb_info": b64, "qe_identity": b64,
                                        "issuer_chain": [b64 DER, ...]}},   # optional: TDX only
      "gpu": null | {"kind": "sim" | "nvidia-hopper", "report": b64, "cert_chain": [b64 DER, ...],
                     "state": {"environment": "PROD" | "SIM" | ..., "cc_feature": bool, "devtools_mode": bool},
                     "ocsp": [b64 DER, ...],              # optional: OCSP responses for cert_chain[1:-1]
                     "rims": {"driver": RIM, "vbios": RIM}}   # optional: the firmware's reference values
    }
    RIM = {"xml": b64 SWID tag, "ocsp": [b64 DER, ...]}   # OCSP responses for the RIM's signing chain below its root

`ocsp` and `rims` are what the node's operator fetched from NVIDIA (OCSP
responder, RIM service) and the node staples; they are optional in the format
so that bundles without them still parse and are refused by the verifier with
a message naming what is missing. Absent fields are omitted when encoding.

Certificate chains are leaf first, ending at the root. An SEV-SNP report
comes with its VCEK, ASK and ARK; a TDX quote embeds its PCK chain, so its
`cert_chain` is empty. `crls` are the CPU vendor's revocation lists the node
fetched and staples (AMD KDS: the ARK's; Intel PCS: the PCK CA's and the root
CA's). `tdx_collateral` is what the node's operator fetched from Intel PCS for
a TDX quote: the TCB Info for its FMSPC and the TD_QE Identity, each the
exact JSON body PCS served (the signature covers the inner object's bytes),
and their issuer chain (Intel SGX TCB Signing, then the root), DER, leaf
first. Parsing is strict:
unknown versions, unknown or duplicated fields, wrong types and truncated
base64 are EvidenceFormatError.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from attestation import encoding as enc
from attestation.binding import NONCE_SIZE, RECEIPT_KEY_SIZE, REPORT_DATA_SIZE, freshness_bytes
from attestation.errors import EvidenceFormatError
from attestation.measurement import Measurement

BUNDLE_VERSION = "veil-evidence-v2"  # v2: the receipt key is bound
BACKENDS: tuple[str, ...] = ("sim", "nvml", "tsm")
CPU_KINDS: tuple[str, ...] = ("sim", "tdx", "sev-snp")
GPU_KINDS: tuple[str, ...] = ("sim", "nvidia-hopper")
GPU_ENVIRONMENTS: tuple[str, ...] = ("UNAVAILABLE", "SIM", "PROD")
_MAX_CHAIN = 8
_MAX_RIM_SIZE = 1 << 20
_MAX_COLLATERAL_SIZE = 1 << 20  # Intel's TCB Info runs to a few KiB
_MAX_TIMESTAMP = 1 << 40


@dataclass(frozen=True, slots=True)
class GpuState:
    """The GPU confidential-computing settings observed while collecting (NVML's names)."""

    environment: str
    cc_feature: bool
    devtools_mode: bool

    def encode(self) -> bytes:
        """Canonical bytes bound into the freshness component."""
        return (
            f"environment={self.environment};cc_feature={int(self.cc_feature)};"
            f"devtools_mode={int(self.devtools_mode)}"
        ).encode("ascii")


@dataclass(frozen=True, slots=True)
class TdxCollateral:
    """Intel PCS's signed TCB Info and QE Identity for a TDX quote, as served, and their issuer chain (DER)."""

    tcb_info: bytes
    qe_identity: bytes
    issuer_chain: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class CpuEvidence:
    """A CPU TEE report (simulated, Intel TDX quote or AMD SEV-SNP report), its chain and stapled CRLs."""

    kind: str
    report: bytes
    cert_chain: tuple[bytes, ...]
    crls: tuple[bytes, ...] = ()
    tdx_collateral: TdxCollateral | None = None


@dataclass(frozen=True, slots=True)
class StapledRim:
    """A reference integrity manifest (SWID tag XML) and OCSP responses for its signing chain below the root."""

    xml: bytes
    ocsp: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class GpuRims:
    """The RIMs of the driver and the VBIOS the GPU runs."""

    driver: StapledRim
    vbios: StapledRim


@dataclass(frozen=True, slots=True)
class GpuEvidence:
    """An SPDM GET_MEASUREMENTS attestation report, its chain, the observed CC state, and what the node staples."""

    kind: str
    report: bytes
    cert_chain: tuple[bytes, ...]
    state: GpuState
    ocsp: tuple[bytes, ...] = ()  # OCSP responses for cert_chain[1:-1], in chain order
    rims: GpuRims | None = None


@dataclass(frozen=True, slots=True)
class EvidenceBundle:
    """Everything a verifier needs to decide whether to trust one node."""

    backend: str
    key_config: bytes
    measurement: Measurement
    nonce: bytes
    timestamp: int
    report_data: bytes
    cpu: CpuEvidence | None
    gpu: GpuEvidence | None
    receipt_key: bytes  # the node's receipt-signing Ed25519 public key, bound as the key configuration is
    version: str = BUNDLE_VERSION

    def freshness(self) -> bytes:
        """The freshness component of the binding."""
        state = self.gpu.state.encode() if self.gpu is not None else b""
        return freshness_bytes(self.nonce, self.timestamp, state)

    def to_json(self) -> str:
        """The bundle as JSON text."""
        return json.dumps(_bundle_to_dict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> EvidenceBundle:
        """Parse a bundle strictly; raise EvidenceFormatError on any deviation from the format."""
        return _bundle_from_dict(enc.loads_strict(text))


def _bundle_to_dict(bundle: EvidenceBundle) -> dict[str, Any]:
    return {
        "version": bundle.version,
        "backend": bundle.backend,
        "key_config": enc.b64encode(bundle.key_config),
        "receipt_key": enc.b64encode(bundle.receipt_key),
        "measurement": {
            "code": enc.b64encode(bundle.measurement.code_digest),
            "policy": enc.b64encode(bundle.measurement.policy_digest),
            "model": enc.b64encode(bundle.measurement.model_digest),
        },
        "freshness": {"nonce": enc.b64encode(bundle.nonce), "timestamp": bundle.timestamp},
        "report_data": enc.b64encode(bundle.report_data),
        "cpu": None if bundle.cpu is None else _cpu_to_dict(bundle.cpu),
        "gpu": None if bundle.gpu is None else _gpu_to_dict(bundle.gpu),
    }


def _cpu_to_dict(cpu: CpuEvidence) -> dict[str, Any]:
    encoded: dict[str, Any] = {
        "kind": cpu.kind,
        "report": enc.b64encode(cpu.report),
        "cert_chain": [enc.b64encode(c) for c in cpu.cert_chain],
        "crls": [enc.b64encode(crl) for crl in cpu.crls],
    }
    if cpu.tdx_collateral is not None:
        collateral = cpu.tdx_collateral
        encoded["tdx_collateral"] = {
            "tcb_info": enc.b64encode(collateral.tcb_info), "qe_identity": enc.b64encode(collateral.qe_identity),
            "issuer_chain": [enc.b64encode(cert) for cert in collateral.issuer_chain],
        }
    return encoded


def _gpu_to_dict(gpu: GpuEvidence) -> dict[str, Any]:
    state = {"environment": gpu.state.environment, "cc_feature": gpu.state.cc_feature, "devtools_mode": gpu.state.devtools_mode}
    encoded: dict[str, Any] = {
        "kind": gpu.kind,
        "report": enc.b64encode(gpu.report),
        "cert_chain": [enc.b64encode(c) for c in gpu.cert_chain],
        "state": state,
    }
    if gpu.ocsp:
        encoded["ocsp"] = [enc.b64encode(response) for response in gpu.ocsp]
    if gpu.rims is not None:
        encoded["rims"] = {"driver": _rim_to_dict(gpu.rims.driver), "vbios": _rim_to_dict(gpu.rims.vbios)}
    return encoded


def _rim_to_dict(rim: StapledRim) -> dict[str, Any]:
    return {"xml": enc.b64encode(rim.xml), "ocsp": [enc.b64encode(response) for response in rim.ocsp]}


_TOP_KEYS = {"version", "backend", "key_config", "receipt_key", "measurement", "freshness", "report_data", "cpu",
             "gpu"}


def _bundle_from_dict(value: Any) -> EvidenceBundle:
    if isinstance(value, dict) and "version" in value and value["version"] != BUNDLE_VERSION:
        raise EvidenceFormatError(f"unknown evidence version; this verifier reads {BUNDLE_VERSION!r} only")
    top = enc.expect_object(value, "evidence", _TOP_KEYS)
    measured = enc.expect_object(top["measurement"], "measurement", {"code", "policy", "model"})
    fresh = enc.expect_object(top["freshness"], "freshness", {"nonce", "timestamp"})
    return EvidenceBundle(
        backend=enc.expect_choice(top["backend"], "backend", BACKENDS),
        key_config=enc.b64decode(top["key_config"], "key_config"),
        receipt_key=enc.b64decode(top["receipt_key"], "receipt_key", length=RECEIPT_KEY_SIZE),
        measurement=Measurement(
            code_digest=enc.b64decode(measured["code"], "measurement.code", length=32),
            policy_digest=enc.b64decode(measured["policy"], "measurement.policy", length=32),
            model_digest=enc.b64decode(measured["model"], "measurement.model", length=32),
        ),
        nonce=enc.b64decode(fresh["nonce"], "freshness.nonce", length=NONCE_SIZE),
        timestamp=enc.expect_int(fresh["timestamp"], "freshness.timestamp", 0, _MAX_TIMESTAMP),
        report_data=enc.b64decode(top["report_data"], "report_data", length=REPORT_DATA_SIZE),
        cpu=None if top["cpu"] is None else _cpu_from_dict(top["cpu"]),
        gpu=None if top["gpu"] is None else _gpu_from_dict(top["gpu"]),
    )


def _chain_from_list(value: Any, where: str, what: str = "certificates") -> tuple[bytes, ...]:
    if not isinstance(value, list) or len(value) > _MAX_CHAIN:
        raise EvidenceFormatError(f"{where} must be a list of at most {_MAX_CHAIN} {what}")
    return tuple(enc.b64decode(item, f"{where}[{index}]") for index, item in enumerate(value))


def _cpu_from_dict(value: Any) -> CpuEvidence:
    cpu = enc.expect_object(value, "cpu", {"kind", "report", "cert_chain"}, optional={"crls", "tdx_collateral"})
    return CpuEvidence(
        kind=enc.expect_choice(cpu["kind"], "cpu.kind", CPU_KINDS),
        report=enc.b64decode(cpu["report"], "cpu.report"),
        cert_chain=_chain_from_list(cpu["cert_chain"], "cpu.cert_chain"),
        crls=_chain_from_list(cpu.get("crls", []), "cpu.crls", "CRLs"),
        tdx_collateral=_tdx_collateral_from_dict(cpu["tdx_collateral"]) if "tdx_collateral" in cpu else None,
    )


def _tdx_collateral_from_dict(value: Any) -> TdxCollateral:
    collateral = enc.expect_object(value, "cpu.tdx_collateral", {"tcb_info", "qe_identity", "issuer_chain"})
    documents = {name: enc.b64decode(collateral[name], f"cpu.tdx_collateral.{name}") for name in ("tcb_info", "qe_identity")}
    if any(len(document) > _MAX_COLLATERAL_SIZE for document in documents.values()):
        raise EvidenceFormatError(f"cpu.tdx_collateral documents must be at most {_MAX_COLLATERAL_SIZE} bytes")
    return TdxCollateral(**documents,
                         issuer_chain=_chain_from_list(collateral["issuer_chain"], "cpu.tdx_collateral.issuer_chain"))


def _gpu_from_dict(value: Any) -> GpuEvidence:
    gpu = enc.expect_object(value, "gpu", {"kind", "report", "cert_chain", "state"}, {"ocsp", "rims"})
    state = enc.expect_object(gpu["state"], "gpu.state", {"environment", "cc_feature", "devtools_mode"})
    for flag in ("cc_feature", "devtools_mode"):
        if not isinstance(state[flag], bool):
            raise EvidenceFormatError(f"gpu.state.{flag} must be true or false")
    return GpuEvidence(
        kind=enc.expect_choice(gpu["kind"], "gpu.kind", GPU_KINDS),
        report=enc.b64decode(gpu["report"], "gpu.report"),
        cert_chain=_chain_from_list(gpu["cert_chain"], "gpu.cert_chain"),
        state=GpuState(
            environment=enc.expect_choice(state["environment"], "gpu.state.environment", GPU_ENVIRONMENTS),
            cc_feature=state["cc_feature"],
            devtools_mode=state["devtools_mode"],
        ),
        ocsp=_chain_from_list(gpu["ocsp"], "gpu.ocsp") if "ocsp" in gpu else (),
        rims=_rims_from_dict(gpu["rims"]) if "rims" in gpu else None,
    )


def _rims_from_dict(value: Any) -> GpuRims:
    rims = enc.expect_object(value, "gpu.rims", {"driver", "vbios"})
    return GpuRims(driver=_rim_from_dict(rims["driver"], "gpu.rims.driver"),
                   vbios=_rim_from_dict(rims["vbios"], "gpu.rims.vbios"))


def _rim_from_dict(value: Any, where: str) -> StapledRim:
    rim = enc.expect_object(value, where, {"xml", "ocsp"})
    xml = enc.b64decode(rim["xml"], f"{where}.xml")
    if len(xml) > _MAX_RIM_SIZE:
        raise EvidenceFormatError(f"{where}.xml is larger than {_MAX_RIM_SIZE} bytes")
    return StapledRim(xml=xml, ocsp=_chain_from_list(rim["ocsp"], f"{where}.ocsp"))
