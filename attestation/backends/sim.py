"""The simulated software TEE, for development and CI. It protects nothing.

It produces evidence in the same shapes as hardware: an SPDM GET_MEASUREMENTS
report for the GPU (parsed and signature-checked by the same code as a real
H100 report) and a signed CPU report, each with a three-certificate chain
(attestation key, device identity, the simulated root of
attestation.sim_root). Beside the GPU report it staples a driver RIM and a
VBIOS RIM describing its measurements, signed under the simulated root, and
OCSP responses for its certificates answering this evidence's GPU nonce
(attestation.backends.sim_gpu), so the verifier's reference-measurement and
revocation checks run on simulated evidence too. Every signed part says
SIMULATED: the GPU report's opaque `simulated` field, the CPU report's
simulated attribute, and the certificate subjects.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from attestation import spdm
from attestation.backends.base import bind, check_nonce, now_seconds, sign_raw_p384
from attestation.backends.sim_gpu import build_ocsp_response, build_rim
from attestation.binding import gpu_nonce
from attestation.bundle import CpuEvidence, EvidenceBundle, GpuEvidence, GpuRims, GpuState, StapledRim
from attestation.cpu_reports import build_sim_report
from attestation.measurement import Measurement
from attestation.reference import OPAQUE_VBIOS_VERSION, encode_vbios_version
from attestation.sim_root import SimRoot, issue, load_or_create_sim_root

SIM_GPU_STATE = GpuState(environment="SIM", cc_feature=True, devtools_mode=False)
_SIM_GPU_MEASUREMENTS = 8
SIM_DRIVER_VERSION = "veil-sim"
SIM_VBIOS_VERSION = "00.00.00.00.01"
_VBIOS_INDEXES = range(0, 6)  # RIM indexes the VBIOS RIM describes; the driver RIM has the rest


@dataclass(frozen=True)
class _SimDevice:
    """One simulated device: its attestation key and leaf-first DER chain."""

    attestation_key: ec.EllipticCurvePrivateKey
    chain: tuple[bytes, ...]
    certificates: tuple[x509.Certificate, ...]


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
        self._rim_signer = _make_rim_signer(self._root)
        self._rims = _sim_rims(self._rim_signer)

    def collect(self, key_config: bytes, measurement: Measurement, nonce: bytes, receipt_key: bytes) -> EvidenceBundle:
        """Simulated evidence for `key_config`, `receipt_key` and `measurement`, answering `nonce`."""
        check_nonce(nonce)
        timestamp = int(self._clock())
        bound = bind(key_config, receipt_key, measurement, nonce, timestamp, self._gpu_state.encode())
        return EvidenceBundle(
            backend=self.name,
            key_config=bytes(key_config),
            receipt_key=bytes(receipt_key),
            measurement=measurement,
            nonce=bytes(nonce),
            timestamp=timestamp,
            report_data=bound,
            cpu=CpuEvidence("sim", self._cpu_report(bound), self._cpu.chain),
            gpu=self._gpu_evidence(gpu_nonce(bound), timestamp),
        )

    def _gpu_evidence(self, request_nonce: bytes, timestamp: int) -> GpuEvidence:
        when = dt.datetime.fromtimestamp(timestamp, dt.timezone.utc)
        rim_ocsp = self._ocsp(self._rim_signer.certificates, 0, request_nonce, when)
        rims = GpuRims(StapledRim(self._rims[0], rim_ocsp), StapledRim(self._rims[1], rim_ocsp))
        return GpuEvidence(
            "sim", self._gpu_report(request_nonce), self._gpu.chain, self._gpu_state,
            ocsp=self._ocsp(self._gpu.certificates, 1, request_nonce, when), rims=rims,
        )

    def _ocsp(self, chain: tuple[x509.Certificate, ...], first: int, nonce: bytes, when: dt.datetime) -> tuple[bytes, ...]:
        # Every certificate below the root is issued by the root here, so the root's key answers for each.
        return tuple(
            build_ocsp_response(certificate, issuer, self._root.private_key, this_update=when, nonce=nonce)
            for certificate, issuer in zip(chain[first:-1], chain[first + 1:])
        )

    def _cpu_report(self, bound: bytes) -> bytes:
        return build_sim_report(bound, debug=self._debug, sign=lambda body: sign_raw_p384(self._cpu.attestation_key, body))

    def _gpu_report(self, request_nonce: bytes) -> bytes:
        opaque = [
            spdm.OpaqueField(spdm.OPAQUE_DRIVER_VERSION, SIM_DRIVER_VERSION.encode() + b"\x00"),
            spdm.OpaqueField(OPAQUE_VBIOS_VERSION, encode_vbios_version(SIM_VBIOS_VERSION)),
            spdm.OpaqueField(spdm.OPAQUE_SIMULATED, spdm.SIMULATED_MARKER),
        ]
        return spdm.build_report(
            request_nonce, sim_gpu_measurements(), secrets.token_bytes(32), opaque,
            lambda signed: sign_raw_p384(self._gpu.attestation_key, signed),
        )


def _make_device(root: SimRoot, part: str) -> _SimDevice:
    identity_key = ec.generate_private_key(ec.SECP384R1())
    identity = issue(root, f"Veil SIMULATED {part} Identity", identity_key.public_key(), is_ca=True)
    attestation_key = ec.generate_private_key(ec.SECP384R1())
    leaf = issue(SimRoot(identity, identity_key), f"Veil SIMULATED {part} Attestation Key",
                 attestation_key.public_key(), is_ca=False, days=30)
    certificates = (leaf, identity, root.certificate)
    chain = tuple(cert.public_bytes(serialization.Encoding.DER) for cert in certificates)
    return _SimDevice(attestation_key, chain, certificates)


def _make_rim_signer(root: SimRoot) -> _SimDevice:
    key = ec.generate_private_key(ec.SECP384R1())
    signer = issue(root, "Veil SIMULATED RIM Signer", key.public_key(), is_ca=False, days=30)
    certificates = (signer, root.certificate)
    return _SimDevice(key, tuple(cert.public_bytes(serialization.Encoding.DER) for cert in certificates), certificates)


def sim_gpu_measurements() -> list[bytes]:
    """The simulated GPU's measurement blocks 1..8 (RIM indexes 0..7)."""
    return [hashlib.sha384(b"veil-sim-gpu-firmware-%d" % index).digest() for index in range(_SIM_GPU_MEASUREMENTS)]


def _sim_rims(signer: _SimDevice) -> tuple[bytes, bytes]:
    """(driver RIM, VBIOS RIM) describing the simulated GPU's firmware."""
    measurements = sim_gpu_measurements()
    parts = {}
    for part, version, indexes in (
        ("driver", SIM_DRIVER_VERSION, [i for i in range(_SIM_GPU_MEASUREMENTS) if i not in _VBIOS_INDEXES]),
        ("vbios", SIM_VBIOS_VERSION, list(_VBIOS_INDEXES)),
    ):
        parts[part] = build_rim(
            tag_id=f"veil-simulated-{part}", version=version, golden={i: [measurements[i]] for i in indexes},
            count=_SIM_GPU_MEASUREMENTS, signer_key=signer.attestation_key, chain=signer.certificates,
        )
    return parts["driver"], parts["vbios"]
