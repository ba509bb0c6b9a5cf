"""Veil's attestation: what a node proves about itself, and the one strict verifier.

Model. A node measures its code (every module file of Veil's packages), its
policy (the canonical policy digest) and its model weights
(:mod:`attestation.measurement`), and binds that measurement, its OHTTP key
configuration, its receipt key (:mod:`attestation.receipts`) and a verifier's
nonce into hardware evidence (:mod:`attestation.binding`)::

    report_data = SHA-512("veil-attest-v2" ‖ key_config ‖ receipt_key ‖ measurement ‖ freshness)   CPU TEE report
    gpu_nonce   = SHA-256(report_data)                                              GPU SPDM report

An :class:`~attestation.bundle.EvidenceBundle` (versioned JSON with base64
fields) carries it all, produced by one of three backends
(:func:`attestation.backends.get_backend`):

- ``sim``: a software TEE for development and CI, signed by a development
  root CA created on first use in ``$VEIL_SIM_ROOT_DIR``; everything it signs
  says SIMULATED, and only a policy that opts in accepts it;
- ``nvml``: H100/H200 confidential computing through NVML (CC settings, SPDM
  attestation report, device certificate chain), plus the CPU TEE quote when
  configfs-tsm is present;
- ``tsm``: a CPU TEE quote (Intel TDX, AMD SEV-SNP) through Linux configfs-tsm.

:func:`attestation.verifier.verify` runs a fixed sequence of checks (simulated
evidence acceptable, chain to a pinned root, signatures, GPU reference
measurements against NVIDIA's signed RIMs (:mod:`attestation.rim`,
:mod:`attestation.reference`), binding, freshness, revocation from stapled
OCSP responses (:mod:`attestation.ocsp`), confidential mode, debug off,
measurement allowed, key configuration well-formed), each with its own error
type, and returns a :class:`~attestation.verifier.VerifiedNode` or raises.

CPU TEE evidence is verified offline (:mod:`attestation.cpu_evidence`): an
SEV-SNP report under its VCEK → ASK → ARK, a TDX quote under its QE report,
PCK → PCK CA → Intel SGX Root CA, the CRLs the node staples
(:mod:`attestation.revocation`), and the launch measurement the policy names
for the attested code digest.

No check is left to an ``accepted_gaps`` entry: every part of the hardware
evidence is verified offline, from what the node staples (RIMs, OCSP
responses, VCEK and CRLs) and the roots its policy pins; no verifier asks a
remote attestation service.

Verified results can be issued as ES384 JWTs (:mod:`attestation.results`).
"""
