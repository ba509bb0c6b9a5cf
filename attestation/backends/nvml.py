"""The NVIDIA H100/H200 path through nvidia-ml-py (NVML).

Reads the confidential-computing settings (environment PROD, ccFeature on,
devToolsMode off), asks the GPU for an SPDM attestation report over the
32-byte nonce SHA-256(report_data), and reads the device certificate chain.
When configfs-tsm is present, the CPU TEE quote over the same report_data is
added, with its vendor's certificates and CRLs. The RIMs and OCSP responses the operator keeps in the
collateral folder (attestation.backends.gpu_collateral) are stapled to the GPU evidence. Collection refuses, with a
message saying what to change, when NVML is
missing or the GPU is not in production CC mode.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from attestation.backends.base import bind, check_nonce, now_seconds
from attestation.backends.gpu_collateral import collateral_dir, read_collateral
from attestation.backends.tsm import TSM_REPORT_ROOT, tsm_available, tsm_evidence
from attestation.binding import gpu_nonce
from attestation.bundle import EvidenceBundle, GpuEvidence, GpuState
from attestation.certs import pem_chain_to_der
from attestation.errors import BackendError, BackendUnavailableError, GpuConfidentialModeOffError, NvmlMissingError
from attestation.measurement import Measurement
from attestation.roots import NVIDIA_DEVICE_IDENTITY_CA_PEM

_ENVIRONMENTS = {0: "UNAVAILABLE", 1: "SIM", 2: "PROD"}
_LIBRARY_MISSING = (9, 12)  # NVML_ERROR_DRIVER_NOT_LOADED, NVML_ERROR_LIBRARY_NOT_FOUND


@dataclass(frozen=True, slots=True)
class NvmlStatus:
    """What NVML says about this machine's GPU, for diagnostics."""

    device_count: int
    device_name: str
    state: GpuState

    @property
    def production_ready(self) -> bool:
        return self.state.environment == "PROD" and self.state.cc_feature and not self.state.devtools_mode

    def describe(self) -> str:
        state = self.state
        return (
            f"{self.device_count} GPU(s), first: {self.device_name}; confidential computing: "
            f"environment {state.environment}, ccFeature {'on' if state.cc_feature else 'off'}, "
            f"devToolsMode {'on' if state.devtools_mode else 'off'}"
        )


def load_nvml() -> ModuleType:
    """Import pynvml and initialize NVML; NvmlMissingError when the driver library is absent."""
    try:
        import pynvml
    except ImportError:
        raise NvmlMissingError("NVML is missing: the nvidia-ml-py package is not installed") from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as error:
        if getattr(error, "value", None) in _LIBRARY_MISSING:
            raise NvmlMissingError(
                "NVML is missing: the NVIDIA driver library (libnvidia-ml.so.1) could not be loaded. "
                "Install the NVIDIA driver on a confidential-computing GPU host, or use --attestation sim for development"
            ) from None
        raise BackendUnavailableError(f"NVML could not start: {error}") from None
    return pynvml


def nvml_status(pynvml: ModuleType) -> NvmlStatus:
    """Device count, first device's name and the system CC settings."""
    count = pynvml.nvmlDeviceGetCount()
    if count == 0:
        raise BackendUnavailableError("NVML found no NVIDIA GPU on this machine")
    name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
    return NvmlStatus(count, name.decode() if isinstance(name, bytes) else str(name), read_cc_state(pynvml))


def read_cc_state(pynvml: ModuleType) -> GpuState:
    """The system CC settings; CC off when the driver or GPU does not support confidential computing."""
    settings = pynvml.c_nvmlSystemConfComputeSettings_v1_t()
    try:
        result = pynvml.nvmlSystemGetConfComputeSettings(ctypes.byref(settings))
    except pynvml.NVMLError:
        result = -1
    if result == pynvml.NVML_SUCCESS:
        return _state(settings.environment, settings.ccFeature, settings.devToolsMode)
    try:
        legacy = pynvml.nvmlSystemGetConfComputeState()
    except pynvml.NVMLError:  # NOT_SUPPORTED / FUNCTION_NOT_FOUND: no CC on this GPU or driver
        return GpuState("UNAVAILABLE", cc_feature=False, devtools_mode=False)
    return _state(legacy.environment, legacy.ccFeature, legacy.devToolsMode)


def _state(environment: int, cc_feature: int, devtools_mode: int) -> GpuState:
    return GpuState(_ENVIRONMENTS.get(environment, "UNAVAILABLE"), cc_feature == 1, devtools_mode == 1)


def require_production_cc(status: NvmlStatus) -> None:
    """Refuse to attest a GPU that is not in production confidential-computing mode."""
    if not status.production_ready:
        raise GpuConfidentialModeOffError(
            f"GPU confidential computing is not in production mode ({status.describe()}). "
            "Enable CC mode (environment PROD, ccFeature on, devToolsMode off) with NVIDIA's "
            "gpu-admin-tools and boot the GPU inside a CPU TEE; no evidence was collected"
        )


class NvmlBackend:
    """Evidence from an H100/H200 in confidential-computing mode."""

    name = "nvml"

    def __init__(self, device_index: int = 0, *, tsm_root=TSM_REPORT_ROOT, collateral: Path | None = None) -> None:
        self._nvml = load_nvml()
        self._status = nvml_status(self._nvml)
        self._device_index = device_index
        self._tsm_root = tsm_root
        self._collateral = collateral if collateral is not None else collateral_dir()

    @property
    def status(self) -> NvmlStatus:
        return self._status

    def collect(self, key_config: bytes, measurement: Measurement, nonce: bytes, receipt_key: bytes) -> EvidenceBundle:
        check_nonce(nonce)
        state = read_cc_state(self._nvml)
        require_production_cc(NvmlStatus(self._status.device_count, self._status.device_name, state))
        timestamp = now_seconds()
        bound = bind(key_config, receipt_key, measurement, nonce, timestamp, state.encode())
        report, chain = self._gpu_report(gpu_nonce(bound))
        ocsp, rims = read_collateral(self._collateral)
        cpu = None
        if tsm_available(self._tsm_root):
            cpu = tsm_evidence(bound, self._tsm_root)
        return EvidenceBundle(
            backend=self.name, key_config=bytes(key_config), receipt_key=bytes(receipt_key), measurement=measurement,
            nonce=bytes(nonce), timestamp=timestamp, report_data=bound, cpu=cpu,
            gpu=GpuEvidence("nvidia-hopper", report, chain, state, ocsp=ocsp, rims=rims),
        )

    def _gpu_report(self, request_nonce: bytes) -> tuple[bytes, tuple[bytes, ...]]:
        pynvml = self._nvml
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(self._device_index)
            raw = pynvml.nvmlDeviceGetConfComputeGpuAttestationReport(handle, request_nonce)
            certificates = pynvml.nvmlDeviceGetConfComputeGpuCertificate(handle)
        except pynvml.NVMLError as error:
            raise BackendError(f"NVML could not produce the GPU attestation report: {error}") from None
        report = bytes(raw.attestationReport[: raw.attestationReportSize])
        pem = bytes(certificates.attestationCertChain[: certificates.attestationCertChainSize])
        chain = pem_chain_to_der(pem)
        root = pem_chain_to_der(NVIDIA_DEVICE_IDENTITY_CA_PEM)[0]
        if not chain or chain[-1] != root:
            chain = chain + (root,)  # NVML's chain stops below the root the verifier pins
        return report, chain
