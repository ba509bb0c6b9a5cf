"""Which chip evidence comes from: one GPU is one node, however many keys or node ids it presents.

A node's HPKE key, and with it its node id, is whatever the node generates; the chip it attests
from is not. NVIDIA provisions every Hopper GPU with a device identity certificate of its own
("GH100 A01 GSP BROM", issued by the "NVIDIA GH100 Provisioner ICA") for a key that is derived in
the chip and never changes. That key certifies the attestation key that signs each report (the
"GSP FMC LF" leaf, re-derived when the firmware changes). The certificates above it, the
Provisioner ICA, "NVIDIA GH100 Identity" and the Device Identity CA root, are the same for every
GH100. So the hardware identity is a digest of the public key of the certificate at a fixed depth
below the pinned root. Counting from the root matters: whoever holds a chip's keys can add
certificates below its device certificate, never above it.

The simulated backend gives each device an identity certificate of its own one level below the
simulated root, so two simulated nodes are two chips exactly when their simulated devices differ.

A node with no GPU is its CPU's chip: an SEV-SNP report's CHIP_ID (which the VCEK's hwID extension
certifies), or a TDX quote's PCK certificate key (Intel's per-platform key; it changes when the
platform's TCB is updated, so such a node may count as a new chip after a microcode update).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization

from attestation import sev_snp, tdx
from attestation.bundle import EvidenceBundle
from attestation.certs import load_der_chain
from attestation.errors import ChainError

# How many certificates lie between the pinned root and the device's own identity certificate.
DEVICE_DEPTH: dict[str, int] = {"nvidia-hopper": 3, "sim": 1}
UNBOUND = "unbound"  # the source of an identity not tied to any chip
_DOMAIN = b"veil-hardware-v1"


def hardware_id(bundle: EvidenceBundle) -> str:
    """The identity of the chip `bundle` comes from, as lowercase hex SHA-256; ChainError if unreadable.

    This reads the evidence without verifying it: the identity is proven only once the verifier's
    chain check has walked the same chain to a pinned root.
    """
    if bundle.gpu is not None:
        return _device_id("gpu", bundle.gpu.kind, bundle.gpu.cert_chain)
    if bundle.cpu is not None and bundle.cpu.kind in DEVICE_DEPTH:
        return _device_id("cpu", bundle.cpu.kind, bundle.cpu.cert_chain)
    if bundle.cpu is not None and bundle.cpu.kind in CPU_CHIPS:
        return _digest(f"cpu:{bundle.cpu.kind}", CPU_CHIPS[bundle.cpu.kind](bundle.cpu.report))
    return _digest(UNBOUND, bundle.key_config + bundle.measurement.digest())


def is_bound(bundle: EvidenceBundle) -> bool:
    """Whether `hardware_id` names a chip for this evidence, rather than the node's key."""
    return bundle.gpu is not None or (bundle.cpu is not None and (bundle.cpu.kind in DEVICE_DEPTH or bundle.cpu.kind in CPU_CHIPS))


def _device_id(part: str, kind: str, chain: Sequence[bytes]) -> str:
    certificates = load_der_chain(chain, part.upper())
    depth = DEVICE_DEPTH[kind]
    if len(certificates) <= depth:
        raise ChainError(f"the {part.upper()} certificate chain is too short to hold a {kind} device identity "
                         f"certificate {depth} below its root; the device cannot be told apart from others")
    try:
        key = certificates[-1 - depth].public_key()
    except (ValueError, UnsupportedAlgorithm):
        raise ChainError(f"the {part.upper()} device identity certificate holds an unreadable public key") from None
    der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return _digest(f"{part}:{kind}", der)


def _snp_chip(report: bytes) -> bytes:
    return sev_snp.parse_snp_report(report).chip_id


def _tdx_platform(quote: bytes) -> bytes:
    chain = tdx.parse_tdx_quote(quote).pck_chain
    try:
        key = x509.load_der_x509_certificate(chain[0]).public_key()
    except (IndexError, ValueError, UnsupportedAlgorithm):
        raise ChainError("the TDX quote's PCK certificate is missing or unreadable; the platform cannot be told apart") from None
    return key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


# Hardware CPU TEEs: what names the chip in their report (verified by the chain and signature checks).
CPU_CHIPS: dict[str, Callable[[bytes], bytes]] = {"sev-snp": _snp_chip, "tdx": _tdx_platform}


def _digest(source: str, material: bytes) -> str:
    label = source.encode("ascii")
    return hashlib.sha256(_DOMAIN + struct.pack(">H", len(label)) + label + material).hexdigest()
