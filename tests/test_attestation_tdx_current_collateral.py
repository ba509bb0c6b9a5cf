"""A genuine TDX quote with its genuine, matching Intel collateral (Phala's dcap-qvl sample: FMSPC b0c06f000000,
PCS responses of June 2025; tests/data/vectors/intel-tdx-dcap-qvl/SOURCE.txt): every signature is checked under
Intel's real SGX Root CA, and Intel's TCB Info rates the platform, its TDX module and its QE UpToDate.

The collateral is tcbEvaluationDataNumber 17 (Intel's 2024-03-13 TCB recovery), below strict's 18: the tests
that accept it set the policy's minimum to 17, explicitly, and verify at VERIFIED_AT, inside its window."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from attestation import errors
from attestation.bundle import CpuEvidence, TdxCollateral
from attestation.certs import fingerprint, load_der_chain
from attestation.cpu_evidence import check_cpu_revocation, verify_cpu_chain, verify_cpu_report
from attestation.intel_collateral import CollateralLimits, verify_collateral
from attestation.revocation import CrlAgeLimits, check_chain_not_revoked
from attestation.sgx_extensions import read_pck_platform
from attestation.tdx_tcb import check_statuses, evaluate_tcb
from attestation.verifier import verify_with_report
from tests.conftest import REPO_ROOT, vectors_path
from tests.cpu_tee_support import cpu_policy, tdx_evidence
from tests.policy_support import filled_strict

SAMPLE = REPO_ROOT / "tests" / "data" / "vectors" / "intel-tdx-dcap-qvl"
VERIFIED_AT = dt.datetime(2025, 6, 20, tzinfo=dt.timezone.utc)  # inside the TCB Info's, QE Identity's and CRLs' windows
AFTER_NEXT_UPDATE = dt.datetime(2025, 7, 19, 10, 20, tzinfo=dt.timezone.utc)  # TCB Info's nextUpdate was 10:16:03
EVALUATION_NUMBER = 17  # the collateral's own: old enough for it, where strict requires 18
# Intel's root CA CRL is issued for a year (thisUpdate 2025-03-20 11:21:57, nextUpdate 2026-04-03 11:21:57), so
# at VERIFIED_AT it is 92 days old: older than strict's 30-day max_crl_age_s, which bounds the PCK CA's CRL
# only (thisUpdate 2025-06-19, reissued monthly); strict's max_root_crl_age_s bounds the root's.
ROOT_CRL_NEXT_UPDATE = dt.datetime(2026, 4, 3, 11, 21, 57, tzinfo=dt.timezone.utc)
STRICT_CRL_AGES = CrlAgeLimits.of(filled_strict().attestation)
LIMITS = CollateralLimits(max_age_s=30 * 86_400, min_evaluation_number=EVALUATION_NUMBER, crl_ages=STRICT_CRL_AGES)


def intel_root_pin() -> str:
    """Intel's real SGX Root CA, the one both the PCK chain and the TCB Signing chain must end in."""
    root = (vectors_path() / "intel-tdx" / "intel-sgx-root-ca.pem").read_bytes()
    return fingerprint(x509.load_pem_x509_certificate(root))


def _pcs_body(outer: str, inner: str, signature: str) -> bytes:
    """Intel PCS's response body, which the signature (over the inner object's bytes only) makes exact."""
    return b'{"' + outer.encode() + b'":' + inner.encode() + b',"signature":"' + signature.encode() + b'"}'


@dataclasses.dataclass(frozen=True)
class GenuineSample:
    quote: bytes
    collateral: TdxCollateral
    crls: tuple[bytes, bytes]  # PCK Platform CA's, Intel SGX Root CA's

    @property
    def evidence(self) -> CpuEvidence:
        return CpuEvidence("tdx", self.quote, (), self.crls, self.collateral)


def genuine_sample() -> GenuineSample:
    sample = json.loads((SAMPLE / "collateral.json").read_text())
    assert sample["tcb_info_issuer_chain"] == sample["qe_identity_issuer_chain"]  # one TCB Signing certificate
    chain = x509.load_pem_x509_certificates(sample["tcb_info_issuer_chain"].encode())
    collateral = TdxCollateral(
        _pcs_body("tcbInfo", sample["tcb_info"], sample["tcb_info_signature"]),
        _pcs_body("enclaveIdentity", sample["qe_identity"], sample["qe_identity_signature"]),
        tuple(cert.public_bytes(serialization.Encoding.DER) for cert in chain),
    )
    crls = (bytes.fromhex(sample["pck_crl"]), bytes.fromhex(sample["root_ca_crl"]))
    return GenuineSample((SAMPLE / "quote.bin").read_bytes(), collateral, crls)


def verify_genuine_platform(at: dt.datetime = VERIFIED_AT, limits: CollateralLimits = LIMITS):
    """The verifier's chain, report, revocation and "tdx platform" steps on the genuine quote (which carries
    no Veil binding, so the binding checks cannot run): the statuses Intel's collateral gives it."""
    sample, pins = genuine_sample(), (intel_root_pin(),)
    chain = verify_cpu_chain(sample.evidence, pins, at)
    verify_cpu_report(sample.evidence, chain)
    check_cpu_revocation(sample.evidence, chain, at, limits.crl_ages)
    collateral = verify_collateral(sample.collateral, pins, sample.crls, at, limits)
    return evaluate_tcb(chain.tdx_quote, read_pck_platform(chain.certificates[0]), collateral), collateral


def test_the_genuine_quote_with_its_current_collateral_is_up_to_date():
    verdicts, collateral = verify_genuine_platform()
    assert collateral.tcb_info.fmspc.hex() == "b0c06f000000" and collateral.tcb_info.evaluation_number == 17
    assert [(verdict.part, verdict.status, verdict.advisories) for verdict in verdicts] == [
        ("TDX platform TCB", "UpToDate", ()), ("TDX module TDX_01", "UpToDate", ()),
        ("TD quoting enclave", "UpToDate", ())]
    # strict's statuses (UpToDate only) accept it, once the minimum evaluation data number is its own.
    policy = cpu_policy(tdx_settings={"tdx_min_tcb_evaluation_data_number": str(EVALUATION_NUMBER)})
    assert policy.attestation.tdx_accepted_tcb_statuses == ("UpToDate",)
    assert check_statuses(verdicts, policy.attestation) == (
        "TDX platform TCB UpToDate; TDX module TDX_01 UpToDate; TD quoting enclave UpToDate")


def test_strict_refuses_the_genuine_collateral_for_predating_its_tcb_recovery():
    strict = filled_strict().attestation
    limits = dataclasses.replace(LIMITS, min_evaluation_number=strict.tdx_min_tcb_evaluation_data_number)
    with pytest.raises(errors.TcbEvaluationNumberError,
                       match="tcbEvaluationDataNumber 17; the policy requires at least 18"):
        verify_genuine_platform(limits=limits)


def test_the_genuine_collateral_is_refused_after_its_next_update():
    sample = genuine_sample()
    limits = dataclasses.replace(LIMITS, max_age_s=60 * 86_400)  # so that only nextUpdate can refuse it
    with pytest.raises(errors.CollateralExpiredError, match="expired at its nextUpdate 2025-07-19 10:16 UTC"):
        verify_collateral(sample.collateral, (intel_root_pin(),), sample.crls, AFTER_NEXT_UPDATE, limits)


def test_the_genuine_collateral_is_refused_past_the_policys_maximum_age():
    sample = genuine_sample()
    limits = dataclasses.replace(LIMITS, max_age_s=86_400)
    with pytest.raises(errors.CollateralExpiredError, match="the policy allows 86400 s"):
        verify_collateral(sample.collateral, (intel_root_pin(),), sample.crls, VERIFIED_AT + dt.timedelta(days=2), limits)


def test_a_flipped_byte_of_the_genuine_tcb_info_signature_is_refused():
    sample = genuine_sample()
    body = bytearray(sample.collateral.tcb_info)
    body[-5] = ord("0") if body[-5] != ord("0") else ord("1")
    forged = dataclasses.replace(sample.collateral, tcb_info=bytes(body))
    with pytest.raises(errors.CollateralSignatureError, match="signature does not verify"):
        verify_collateral(forged, (intel_root_pin(),), sample.crls, VERIFIED_AT, LIMITS)


def _genuine_under(policy, at: dt.datetime):
    """The verifier's report on the genuine quote and its stapled CRLs, under `policy`, at `at`: the checks up to
    the binding run on it (the quote's report_data is not this bundle's binding, so that check refuses it)."""
    bundle = dataclasses.replace(tdx_evidence(policy), cpu=genuine_sample().evidence)
    report = verify_with_report(bundle, policy, chain_time=at)
    return {check.name: check for check in report.checks}, report.error


def test_strict_accepts_intels_genuine_root_crl_a_quarter_into_its_year():
    # 92 days after the root CRL's thisUpdate: past the 30 days a PCK CRL may be, well inside its own window.
    checks, error = _genuine_under(filled_strict(), VERIFIED_AT)
    assert checks["chain"].passed, checks["chain"].detail
    assert "Intel SGX Root CA (at most 34560000 s old)" in checks["chain"].detail
    assert isinstance(error, errors.BindingError)  # refused for the binding only, after every CRL passed


def test_strict_accepts_intels_genuine_root_crl_for_its_tcb_signing_chain():
    # The TCB Signing certificate's revocation is read from the same root CRL, under the same limit.
    strict = filled_strict().attestation
    limits = CollateralLimits(strict.tdx_max_collateral_age_s, EVALUATION_NUMBER, CrlAgeLimits.of(strict))
    sample = genuine_sample()
    collateral = verify_collateral(sample.collateral, (intel_root_pin(),), sample.crls, VERIFIED_AT, limits)
    assert collateral.tcb_info.evaluation_number == EVALUATION_NUMBER


def _tcb_signing_revocation(at: dt.datetime) -> str:
    sample = genuine_sample()
    chain = load_der_chain(sample.collateral.issuer_chain, "Intel TCB signing")
    return check_chain_not_revoked(chain, sample.crls, issuers=(1,), at_time=at, limits=STRICT_CRL_AGES,
                                   what="Intel TCB signing chain")


def test_intels_genuine_root_crl_is_refused_from_its_next_update_on():
    # Inside its window up to the last second (379 days old, within strict's 400); from nextUpdate on, stale.
    assert "Intel SGX Root CA" in _tcb_signing_revocation(ROOT_CRL_NEXT_UPDATE - dt.timedelta(seconds=1))
    for at in (ROOT_CRL_NEXT_UPDATE, ROOT_CRL_NEXT_UPDATE + dt.timedelta(days=1)):
        with pytest.raises(errors.CrlError, match="CRL of 'Intel SGX Root CA' is past its next update"):
            _tcb_signing_revocation(at)


def test_a_root_crl_older_than_the_root_limit_is_refused_inside_its_window():
    limits = CrlAgeLimits(max_age_s=30 * 86_400, max_root_age_s=60 * 86_400)
    with pytest.raises(errors.CrlError, match=r"policy allows 5184000 s \(attestation.max_root_crl_age_s\)"):
        check_cpu_revocation(genuine_sample().evidence, verify_cpu_chain(genuine_sample().evidence, (intel_root_pin(),),
                                                                         VERIFIED_AT), VERIFIED_AT, limits)


def test_a_genuine_pck_crl_older_than_max_crl_age_s_is_still_refused():
    # Two days after VERIFIED_AT the PCK CA's CRL is 3 days old: a policy allowing one day refuses it by the
    # limit below the root, however lax its root limit.
    policy = cpu_policy(roots=(intel_root_pin(),), max_crl_age_s=86_400, max_root_crl_age_s=400 * 86_400)
    checks, error = _genuine_under(policy, VERIFIED_AT + dt.timedelta(days=2))
    assert not checks["chain"].passed and isinstance(error, errors.CrlError)
    assert "CRL of 'Intel SGX PCK Platform CA'" in str(error)
    assert "policy allows 86400 s (attestation.max_crl_age_s)" in str(error)
