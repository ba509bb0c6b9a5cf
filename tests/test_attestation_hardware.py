"""Hardware identity: the chip evidence comes from, the same whatever keys a node presents."""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Callable

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from attestation import errors
from attestation.backends.sim import SimBackend, _SimDevice
from attestation.backends.sim_gpu import build_ocsp_response
from attestation.certs import pem_chain_to_der
from attestation.bundle import CpuEvidence, EvidenceBundle
from attestation.hardware import hardware_id, is_bound
from attestation.sim_root import SimRoot, issue, load_or_create_sim_root
from attestation.verifier import verify, verify_with_report
from tests.conftest import vectors_path
from tests.cpu_tee_support import cpu_policy, genuine_snp, genuine_tdx, snp_evidence, tdx_evidence
from tests.policy_support import filled_strict
from tests.test_attestation_backends import hopper_bundle
from tests.test_attestation_nvidia_vectors import CHAIN
from tests.test_attestation_support import (  # noqa: F401  (fixtures)
    code_digest,
    collect,
    dev_policy,
    key_config,
    sim_root_dir,
)

OTHER_CHIP_CHAIN = pem_chain_to_der((vectors_path() / "nvidia-h100-rim" / "cert-chain-2023.pem").read_bytes())


def _certificates(chain) -> list[x509.Certificate]:
    return [x509.load_der_x509_certificate(der) for der in chain]


def _with_gpu_chain(bundle, chain):
    return dataclasses.replace(bundle, gpu=dataclasses.replace(bundle.gpu, cert_chain=tuple(chain)))


def test_two_genuine_h100s_have_different_identities_though_they_share_every_certificate_above_the_device():
    policy = filled_strict()
    first, second = hopper_bundle(policy), _with_gpu_chain(hopper_bundle(policy), OTHER_CHIP_CHAIN)
    assert hardware_id(first) != hardware_id(second)
    mine, theirs = _certificates(CHAIN), _certificates(OTHER_CHIP_CHAIN)
    # Provisioner ICA, GH100 Identity and the root are the same certificates on every GH100 ...
    assert [c.fingerprint(hashes.SHA256()) for c in mine[2:]] == [c.fingerprint(hashes.SHA256()) for c in theirs[2:]]
    # ... and the device's own certificate, one below them, is what tells the chips apart.
    device = mine[1]
    assert device.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)[0].value == "GH100 A01 GSP BROM"
    assert device.public_key() != theirs[1].public_key()


def test_the_h100_identity_is_its_device_certificates_key_whatever_the_bundle_binds():
    policy = filled_strict()
    one, other = hopper_bundle(policy), hopper_bundle(policy)  # two key configurations
    assert one.key_config != other.key_config and hardware_id(one) == hardware_id(other)
    report = verify_with_report(one, policy)
    chain = next(check for check in report.checks if check.name == "chain")
    assert chain.passed and f"device identity {hardware_id(one)[:16]}" in chain.detail


def test_a_chain_too_short_to_hold_the_device_certificate_names_no_chip():
    bundle = _with_gpu_chain(hopper_bundle(filled_strict()), CHAIN[2:])
    with pytest.raises(errors.ChainError, match="too short"):
        hardware_id(bundle)


def test_every_simulated_backend_is_a_chip_of_its_own_and_keeps_it_across_keys(code_digest):
    policy = dev_policy()
    first, second = SimBackend(), SimBackend()
    before = verify(collect(first, policy, code_digest), policy)
    rotated = verify(collect(first, policy, code_digest, config=key_config()), policy)
    other = verify(collect(second, policy, code_digest), policy)
    assert before.node_id != rotated.node_id and before.hardware_id == rotated.hardware_id
    assert other.hardware_id != before.hardware_id
    assert len(before.hardware_id) == 64 and int(before.hardware_id, 16) >= 0


def test_holding_the_chips_key_cannot_mint_another_identity_below_it(code_digest):
    # Whoever holds a device identity key can certify a CA of their own under it, and attestation
    # keys under that: the evidence verifies, and still names the same chip.
    policy, root = dev_policy(), load_or_create_sim_root()
    identity_key = ec.generate_private_key(ec.SECP384R1())
    identity = issue(root, "Veil SIMULATED GPU Identity", identity_key.public_key(), is_ca=True)
    direct = _device_under(SimRoot(identity, identity_key), [identity, root.certificate])
    minted_key = ec.generate_private_key(ec.SECP384R1())
    minted = issue(SimRoot(identity, identity_key), "Veil SIMULATED minted CA", minted_key.public_key(), is_ca=True)
    extended = _device_under(SimRoot(minted, minted_key), [minted, identity, root.certificate])
    keys = {identity.subject: identity_key, minted.subject: minted_key, root.certificate.subject: root.private_key}
    nodes = []
    for device in (direct, extended):
        backend = SimBackend()
        backend._gpu = device  # the simulated GPU, with a chain of the test's making
        backend._ocsp = _issuers_answer(keys)  # as the key holder can: each issuer vouches for what it issued
        nodes.append(verify(collect(backend, policy, code_digest), policy))
    assert len(extended.chain) == 4 and nodes[0].hardware_id == nodes[1].hardware_id


def _issuers_answer(keys: dict) -> Callable:
    def answer(chain, first: int, nonce: bytes, when: dt.datetime) -> tuple[bytes, ...]:
        return tuple(build_ocsp_response(certificate, issuer, keys[issuer.subject], this_update=when, nonce=nonce)
                     for certificate, issuer in zip(chain[first:-1], chain[first + 1:]))
    return answer


def _device_under(issuer: SimRoot, above: list[x509.Certificate]) -> _SimDevice:
    key = ec.generate_private_key(ec.SECP384R1())
    leaf = issue(issuer, "Veil SIMULATED GPU Attestation Key", key.public_key(), is_ca=False)
    certificates = (leaf, *above)
    return _SimDevice(key, tuple(c.public_bytes(serialization.Encoding.DER) for c in certificates), certificates)


def test_a_cpu_only_node_is_its_cpus_chip_however_many_keys_it_presents():
    policy = cpu_policy(modes='["cpu"]')
    snp, other_snp = snp_evidence(policy), snp_evidence(policy)
    assert hardware_id(snp) == hardware_id(other_snp) and is_bound(snp)  # two keys, one chip
    node = verify(snp, policy)
    assert node.hardware_id == hardware_id(snp)
    assert hardware_id(tdx_evidence(policy)) == hardware_id(tdx_evidence(policy))


def test_genuine_cpu_reports_name_their_chips():
    report, chain = genuine_snp()
    snp = CpuEvidence("sev-snp", report, chain)
    assert hardware_id(_cpu_only(snp)) == hardware_id(_cpu_only(snp))
    platforms = {hardware_id(_cpu_only(CpuEvidence("tdx", genuine_tdx(name), ())))
                 for name in ("quote-spr-e4.bin", "quote-gcp-cos113.bin")}
    assert len(platforms) == 2 and hardware_id(_cpu_only(snp)) not in platforms


def _cpu_only(cpu: CpuEvidence) -> EvidenceBundle:
    bundle = snp_evidence(cpu_policy(modes='["cpu"]'))
    return dataclasses.replace(bundle, cpu=cpu)
