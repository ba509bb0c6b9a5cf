"""What a node staples to its CPU TEE quote: the vendor's certificates and CRLs, read from the folder its
operator fills, carried through the evidence bundle's JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization

from attestation.backends.collateral import COLLATERAL_DIR_ENV, collateral_dir, load_collateral, load_tdx_collateral
from attestation.bundle import EvidenceBundle
from attestation.errors import BackendError, EvidenceFormatError
from tests.cpu_tee_support import amd_hierarchy, cpu_policy, intel_hierarchy, snp_evidence, tdx_collateral


def write_amd_collateral(folder: Path) -> None:
    hierarchy = amd_hierarchy()
    folder.mkdir(exist_ok=True)
    (folder / "vcek.der").write_bytes(hierarchy.chain[0])
    (folder / "cert_chain.pem").write_bytes(b"".join(
        cert.public_bytes(serialization.Encoding.PEM) for cert in (hierarchy.ask, hierarchy.ark)))
    (folder / "crl.der").write_bytes(hierarchy.crls()[0])


def test_sev_snp_collateral_is_the_vcek_ask_ark_and_the_arks_crl(tmp_path: Path):
    write_amd_collateral(tmp_path)
    chain, crls = load_collateral("sev-snp", tmp_path)
    assert chain == amd_hierarchy().chain and crls == ((tmp_path / "crl.der").read_bytes(),)


def test_tdx_collateral_is_two_crls_and_no_certificate(tmp_path: Path):
    pck_crl, root_crl = intel_hierarchy().crls()
    (tmp_path / "pck-crl.der").write_bytes(pck_crl)
    (tmp_path / "root-crl.der").write_bytes(root_crl)
    assert load_collateral("tdx", tmp_path) == ((), (pck_crl, root_crl))


@pytest.mark.parametrize("kind,missing", [("sev-snp", "vcek.der"), ("sev-snp", "crl.der"),
                                          ("sev-snp", "cert_chain.pem"), ("tdx", "root-crl.der")])
def test_a_missing_file_is_named(tmp_path: Path, kind: str, missing: str):
    write_amd_collateral(tmp_path)
    for name in ("pck-crl.der", "root-crl.der"):
        (tmp_path / name).write_bytes(b"crl")
    (tmp_path / missing).unlink()
    with pytest.raises(BackendError, match=missing):
        load_collateral(kind, tmp_path)


def test_a_kds_chain_without_the_ark_is_refused(tmp_path: Path):
    write_amd_collateral(tmp_path)
    (tmp_path / "cert_chain.pem").write_bytes(amd_hierarchy().ask.public_bytes(serialization.Encoding.PEM))
    with pytest.raises(BackendError, match="ASK then the ARK"):
        load_collateral("sev-snp", tmp_path)


def test_the_folder_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv(COLLATERAL_DIR_ENV, str(tmp_path))
    assert collateral_dir() == tmp_path


def test_crls_survive_the_bundles_json():
    bundle = snp_evidence(cpu_policy())
    parsed = EvidenceBundle.from_json(bundle.to_json())
    assert parsed == bundle and parsed.cpu is not None and len(parsed.cpu.crls) == 1


def test_a_bundle_without_crls_parses_with_none_and_a_bad_crl_list_is_refused():
    document = json.loads(snp_evidence(cpu_policy()).to_json())
    del document["cpu"]["crls"]
    parsed = EvidenceBundle.from_json(json.dumps(document))
    assert parsed.cpu is not None and parsed.cpu.crls == () and parsed.cpu.cert_chain == amd_hierarchy().chain
    document["cpu"]["crls"] = "not a list"
    with pytest.raises(EvidenceFormatError, match="cpu.crls"):
        EvidenceBundle.from_json(json.dumps(document))


def test_tdx_collateral_is_intels_tcb_info_qe_identity_and_their_signing_chain(tmp_path: Path):
    hierarchy, expected = intel_hierarchy(), tdx_collateral()
    (tmp_path / "tcb-info.json").write_bytes(expected.tcb_info)
    (tmp_path / "qe-identity.json").write_bytes(expected.qe_identity)
    (tmp_path / "tcb-signing-chain.pem").write_bytes(b"".join(
        cert.public_bytes(serialization.Encoding.PEM) for cert in (hierarchy.signing, hierarchy.root)))
    assert load_tdx_collateral(tmp_path) == expected
    (tmp_path / "qe-identity.json").unlink()
    with pytest.raises(BackendError, match="qe-identity.json"):
        load_tdx_collateral(tmp_path)
    (tmp_path / "tcb-signing-chain.pem").write_bytes(hierarchy.root.public_bytes(serialization.Encoding.PEM))
    with pytest.raises(BackendError, match="TCB Signing certificate then the root"):
        load_tdx_collateral(tmp_path)
