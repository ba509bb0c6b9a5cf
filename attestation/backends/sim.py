"""The simulated software TEE, for development and CI. It protects nothing.

It produces evidence in the same shapes as hardware: an SPDM GET_MEASUREMENTS
report for the GPU (parsed and signature-checked by the same code as a real
H100 report) and a signed CPU report, each with a three-certificate chain
(attestation key, device identity, the simulated root of
attestation.sim_root). Every signed part says SIMULATED: the GPU report's
opaque `simulated` field, the CPU report's simulated attribute, and the
certificate subjects.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from attestation import spdm
from attestation.backends.base import bind, check_nonce, now_seconds, sign_raw_p384
from attestation.binding import gpu_nonce
from attestation.bundle import CpuEvidence, EvidenceBundle, GpuEvidence, GpuState
from attestation.cpu_reports import build_sim_report
from attestation.measurement import Measurement
from attestation.sim_root import SimRoot, issue, load_or_create_sim_root

SIM_GPU_STATE = GpuState(environment="SIM", cc_feature=True, devtools_mode=False)
_SIM_GPU_MEASUREMENTS = 8


@dataclass(frozen=True)
class _SimDevice:
    """One simulated device: its attestation key and leaf-first DER chain."""

    attestation_key: ec.EllipticCurvePrivateKey
    chain: tuple[bytes, ...]


class SimBackend:
    """Simulated CPU TEE and GPU. `debug` and `gpu_state` model misconfigured nodes for tests."""

    name = "sim"

    def __init__(
        self,
        root_dir: Path | None = None,
        *,
        debug: bool = False,
        gpu_state: GpuState = SIM_GPU_STATE,
        clock: Callable[[], int] = now_seconds,
    ) -> None:
        self._root = load_or_create_sim_root(root_dir)
        self._debug = debug
        self._gpu_state = gpu_state
        self._clock = clock
        self._gpu = _make_device(self._root, "GPU")
        self._cpu = _make_device(self._root, "CPU TEE")

    def collect(self, key_config: bytes, measurement: Measurement, nonce: bytes) -> EvidenceBundle:
        """Simulated evidence for `key_config` and `measurement`, answering `nonce`."""
        check_nonce(nonce)
        timestamp = int(self._clock())
        bound = bind(key_config, measurement, nonce, timestamp, self._gpu_state.encode())
        return EvidenceBundle(
            backend=self.name,
            key_config=bytes(key_config),
            measurement=measurement,
            nonce=bytes(nonce),
            timestamp=timestamp,
            report_data=bound,
            cpu=CpuEvidence("sim", self._cpu_report(bound), self._cpu.chain),
            gpu=GpuEvidence("sim", self._gpu_report(gpu_nonce(bound)), self._gpu.chain, self._gpu_state),
        )

    def _cpu_report(self, bound: bytes) -> bytes:
        return build_sim_report(bound, debug=self._debug, sign=lambda body: sign_raw_p384(self._cpu.attestation_key, body))

    def _gpu_report(self, request_nonce: bytes) -> bytes:
        measurements = [hashlib.sha384(b"veil-sim-gpu-firmware-%d" % index).digest() for index in range(_SIM_GPU_MEASUREMENTS)]
        opaque = [
            spdm.OpaqueField(spdm.OPAQUE_DRIVER_VERSION, b"veil-sim\x00"),
            spdm.OpaqueField(spdm.OPAQUE_SIMULATED, spdm.SIMULATED_MARKER),
        ]
        return spdm.build_report(
            request_nonce, measurements, secrets.token_bytes(32), opaque,
            lambda signed: sign_raw_p384(self._gpu.attestation_key, signed),
        )


def _make_device(root: SimRoot, part: str) -> _SimDevice:
    identity_key = ec.generate_private_key(ec.SECP384R1())
    identity = issue(root, f"Veil SIMULATED {part} Identity", identity_key.public_key(), is_ca=True)
    attestation_key = ec.generate_private_key(ec.SECP384R1())
    leaf = issue(SimRoot(identity, identity_key), f"Veil SIMULATED {part} Attestation Key",
                 attestation_key.public_key(), is_ca=False, days=30)
    chain = tuple(cert.public_bytes(serialization.Encoding.DER) for cert in (leaf, identity, root.certificate))
    return _SimDevice(attestation_key, chain)
