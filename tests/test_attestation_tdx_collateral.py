"""Intel's TDX collateral, verified offline: Intel's published TCB Info and QE Identity for the genuine SPR
quote's platform, single-byte and single-field corruptions of them, and synthetic collateral re-signed under
the test root for every status and window case; and the policy's TDX pins, each refused by its own class.

The genuine collateral (go-tdx-guest's PCS responses, June 2023) is old: tests that use it verify at
GENUINE_TIME, inside its validity window, and set the minimum evaluation data number to its own, 15, where
strict requires 18."""

from __future__ import annotations

import dataclasses
import datetime as dt

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from attestation import errors
from attestation.bundle import EvidenceBundle
from attestation.intel_collateral import CollateralLimits, verify_collateral
from attestation.revocation import CrlAgeLimits
from attestation.roots import INTEL_SGX_ROOT_CA_FINGERPRINT
from attestation.sgx_extensions import read_pck_platform
from attestation.tdx import INTEL_QE_VENDOR_ID, parse_tdx_quote
from attestation.tdx_tcb import evaluate_tcb, qe_verdict
from attestation.verifier import verify_with_report
from tests.conftest import REPO_ROOT
from tests.cpu_tee_support import (
    TDX_FMSPC,
    TDX_TEE_TCB_SVN,
    TdxFields,
    assert_refused_by,
    cpu_policy,
    issue_certificate,
    qe_identity_document,
    tcb_info_document,
    tcb_level,
    tdx_collateral,
    tdx_evidence,
)

GENUINE = REPO_ROOT / "tests" / "data" / "vectors" / "intel-tdx"
GENUINE_TIME = dt.datetime(2023, 6, 20, tzinfo=dt.timezone.utc)  # inside every genuine document's window
GENUINE_LIMITS = CollateralLimits(max_age_s=30 * 86_400, min_evaluation_number=15,
                                  crl_ages=CrlAgeLimits(max_age_s=30 * 86_400, max_root_age_s=400 * 86_400))
INTEL_PINS = (INTEL_SGX_ROOT_CA_FINGERPRINT,)
DER = serialization.Encoding.DER


def genuine_collateral(tcb_info: bytes | None = None, qe_identity: bytes | None = None):
    chain = x509.load_pem_x509_certificates((GENUINE / "tcb-signing-chain.pem").read_bytes())
    return dataclasses.replace(
        tdx_collateral(), tcb_info=tcb_info or (GENUINE / "tcb-info-50806f000000.json").read_bytes(),
        qe_identity=qe_identity or (GENUINE / "qe-identity-td-qe.json").read_bytes(),
        issuer_chain=tuple(cert.public_bytes(DER) for cert in chain),
    )


GENUINE_CRLS = ((GENUINE / "pck-platform-crl.der").read_bytes(), (GENUINE / "root-ca-crl.der").read_bytes())


def verify_genuine(collateral=None, *, at=GENUINE_TIME, limits=GENUINE_LIMITS, pins=INTEL_PINS):
    return verify_collateral(collateral or genuine_collateral(), pins, GENUINE_CRLS, at, limits)


def spr_quote():
    quote = parse_tdx_quote((GENUINE / "quote-spr-e4.bin").read_bytes())
    return quote, read_pck_platform(x509.load_der_x509_certificate(quote.pck_chain[0]))


# ----- Intel's published collateral --------------------------------------------------------------------

def test_intels_published_collateral_verifies_offline_to_the_pinned_root():
    verified = verify_genuine()
    assert verified.tcb_info.fmspc == bytes.fromhex("50806f000000") and verified.tcb_info.evaluation_number == 15
    assert [level.status for level in verified.tcb_info.levels] == ["UpToDate", "OutOfDate"]
    assert verified.qe_identity.mrsigner.hex() == "dc9e2a7c6f948f17474e34a7fc43ed030f7c1563f1babddf6340c82e0e54a8c5"


def test_the_genuine_quote_under_its_published_collateral_gets_the_status_the_collateral_states():
    quote, platform = spr_quote()
    verified = verify_genuine()
    assert platform.fmspc == verified.tcb_info.fmspc  # the collateral is this platform's
    assert qe_verdict(quote.qe_report, verified.qe_identity).status == "UpToDate"  # QE ISVSVN 4 ≥ 4
    # Its PCK's SGX SVNs (3, 3, ...) are below both of June 2023's levels (5, 5, ...): not supported.
    with pytest.raises(errors.TcbStatusError, match="below every level in Intel's TCB Info"):
        evaluate_tcb(quote, platform, verified)


@pytest.mark.parametrize("document,offset", [("tcb_info", -5), ("qe_identity", -4)])
def test_a_flipped_signature_byte_of_published_collateral_is_refused(document, offset):
    body = bytearray(getattr(genuine_collateral(), document))
    body[offset] = ord("0") if body[offset] != ord("0") else ord("1")
    with pytest.raises(errors.CollateralSignatureError, match="signature does not verify"):
        verify_genuine(genuine_collateral(**{document: bytes(body)}))


@pytest.mark.parametrize("document,old,new", [
    ("tcb_info", b'"fmspc":"50806f000000"', b'"fmspc":"50806f000001"'),
    ("tcb_info", b'"tcbStatus":"OutOfDate"', b'"tcbStatus":"UpToDate"'),
    ("qe_identity", b'"mrsigner":"DC9E', b'"mrsigner":"DD9E'),
    ("qe_identity", b'"isvsvn":4', b'"isvsvn":1'),
])
def test_a_tampered_field_inside_published_collateral_breaks_its_signature(document, old, new):
    body = getattr(genuine_collateral(), document)
    assert body.count(old) == 1
    with pytest.raises(errors.CollateralSignatureError):
        verify_genuine(genuine_collateral(**{document: body.replace(old, new)}))


def test_published_collateral_is_refused_after_its_next_update():
    with pytest.raises(errors.CollateralExpiredError, match="expired at its nextUpdate 2023-07-08"):
        verify_genuine(at=dt.datetime(2023, 7, 10, tzinfo=dt.timezone.utc))


def test_published_collateral_below_the_policys_evaluation_number_is_refused():
    with pytest.raises(errors.TcbEvaluationNumberError, match="tcbEvaluationDataNumber 15; the policy requires at least 18"):
        verify_genuine(limits=dataclasses.replace(GENUINE_LIMITS, min_evaluation_number=18))


def test_published_collateral_needs_the_intel_root_pinned_and_its_signer_unexpired():
    with pytest.raises(errors.CollateralChainError, match="pinned by the policy"):
        verify_genuine(pins=("00" * 32,))
    # Intel's TCB Signing certificate of 2018 expired on 2025-05-21.
    with pytest.raises(errors.CollateralChainError, match="not valid at"):
        verify_genuine(at=dt.datetime(2025, 6, 1, tzinfo=dt.timezone.utc),
                       limits=dataclasses.replace(GENUINE_LIMITS, max_age_s=90 * 86_400))


# ----- synthetic collateral through the verifier -----------------------------------------------------

def test_synthetic_up_to_date_collateral_passes_and_the_check_names_the_statuses():
    policy = cpu_policy()
    outcome = verify_with_report(tdx_evidence(policy), policy)
    assert outcome.error is None, outcome.error
    detail = {check.name: check.detail for check in outcome.checks}["tdx platform"]
    assert "TDX platform TCB UpToDate" in detail and "TD quoting enclave UpToDate" in detail


@pytest.mark.parametrize("status,advisories", [
    ("OutOfDate", ("INTEL-SA-01036", "INTEL-SA-01099")), ("OutOfDateConfigurationNeeded", ("INTEL-SA-00837",)),
    ("Revoked", ()), ("SWHardeningNeeded", ("INTEL-SA-00615",)), ("ConfigurationNeeded", ()),
])
def test_a_platform_status_strict_refuses_is_named_with_its_advisories(status, advisories):
    policy = cpu_policy()
    collateral = tdx_collateral(tcb_info_document([tcb_level(status, advisories=advisories)]))
    outcome = verify_with_report(tdx_evidence(policy, collateral=collateral), policy)
    assert type(outcome.error) is errors.TcbStatusError
    assert f"TDX platform TCB {status}" in str(outcome.error)
    assert all(advisory in str(outcome.error) for advisory in advisories)


def test_the_first_level_the_platform_reaches_gives_its_status():
    higher = tcb_level(tdx=(3, 0, 6) + (0,) * 13)  # a newer microcode than the quote's 5
    levels = [higher, tcb_level("OutOfDate", advisories=("INTEL-SA-01036",)), tcb_level()]
    policy = cpu_policy()
    bundle = tdx_evidence(policy, collateral=tdx_collateral(tcb_info_document(levels)))
    assert_refused_by(bundle, policy, errors.TcbStatusError, "tdx platform")


def test_sw_hardening_passes_only_with_every_advisory_the_policy_names():
    collateral = tdx_collateral(tcb_info_document([tcb_level("SWHardeningNeeded",
                                                             advisories=("INTEL-SA-00615", "INTEL-SA-00657"))]))
    statuses = '["UpToDate", "SWHardeningNeeded"]'
    both = cpu_policy(tdx_settings={"tdx_accepted_tcb_statuses": statuses,
                                    "tdx_accepted_advisories": '["INTEL-SA-00615", "INTEL-SA-00657"]'})
    assert verify_with_report(tdx_evidence(both, collateral=collateral), both).error is None
    one = cpu_policy(tdx_settings={"tdx_accepted_tcb_statuses": statuses,
                                   "tdx_accepted_advisories": '["INTEL-SA-00615"]'})
    outcome = verify_with_report(tdx_evidence(one, collateral=collateral), one)
    assert type(outcome.error) is errors.TcbStatusError and "INTEL-SA-00657" in str(outcome.error)


def test_a_qe_below_intels_current_level_is_refused_by_name():
    levels = [{"tcb": {"isvsvn": 8}, "tcbDate": "2024-11-13T00:00:00Z", "tcbStatus": "UpToDate"},
              {"tcb": {"isvsvn": 4}, "tcbDate": "2024-03-13T00:00:00Z", "tcbStatus": "OutOfDate",
               "advisoryIDs": ["INTEL-SA-01036"]}]
    policy = cpu_policy()
    bundle = tdx_evidence(policy, collateral=tdx_collateral(qe_identity=qe_identity_document(tcbLevels=levels)))
    outcome = verify_with_report(bundle, policy)
    assert type(outcome.error) is errors.TcbStatusError
    assert "TD quoting enclave OutOfDate (advisories INTEL-SA-01036)" in str(outcome.error)


def test_a_versioned_tdx_module_is_rated_by_its_own_identity():
    identity = {"id": "TDX_01", "mrsigner": "00" * 48, "attributes": "0000000000000000",
                "attributesMask": "FFFFFFFFFFFFFFFF",
                "tcbLevels": [{"tcb": {"isvsvn": 6}, "tcbDate": "2024-11-13T00:00:00Z", "tcbStatus": "UpToDate"},
                              {"tcb": {"isvsvn": 2}, "tcbDate": "2023-08-09T00:00:00Z", "tcbStatus": "OutOfDate",
                               "advisoryIDs": ["INTEL-SA-01099"]}]}
    policy = cpu_policy()
    for module_svn, passes in ((6, True), (4, False)):
        svn = bytes([module_svn, 1, 5]) + bytes(13)
        bundle = tdx_evidence(policy, TdxFields(tee_tcb_svn=svn),
                              collateral=tdx_collateral(tcb_info_document(tdxModuleIdentities=[identity])))
        outcome = verify_with_report(bundle, policy)
        assert (outcome.error is None) is passes, outcome.error
    assert type(outcome.error) is errors.TcbStatusError and "TDX module TDX_01 OutOfDate" in str(outcome.error)


def _other_signer():
    key = ec.generate_private_key(ec.SECP256R1())
    root = issue_certificate("Intel SGX Root CA", key.public_key(), "Intel SGX Root CA", key, ca=True, serial=20)
    return key, (root.public_bytes(DER),)


@pytest.mark.parametrize("make,error", [
    (lambda: None, errors.TdxCollateralFormatError),
    (lambda: tdx_collateral(tcb_info_document(version=2)), errors.CollateralVersionError),
    (lambda: tdx_collateral(tcb_info_document(id="SGX")), errors.CollateralVersionError),
    (lambda: tdx_collateral(qe_identity=qe_identity_document(id="QE")), errors.CollateralVersionError),
    (lambda: tdx_collateral(qe_identity=qe_identity_document(version=1)), errors.CollateralVersionError),
    (lambda: tdx_collateral(tcb_info_document(nextUpdate="2020-01-01T00:00:00Z")), errors.CollateralExpiredError),
    (lambda: tdx_collateral(qe_identity=qe_identity_document(nextUpdate="2020-01-01T00:00:00Z")),
     errors.CollateralExpiredError),
    (lambda: tdx_collateral(tcb_info_document(issueDate="2099-01-01T00:00:00Z")), errors.CollateralExpiredError),
    (lambda: tdx_collateral(tcb_info_document(issueDate="2020-01-01T00:00:00Z")), errors.CollateralExpiredError),
    (lambda: tdx_collateral(tcb_info_document(tcbEvaluationDataNumber=17)), errors.TcbEvaluationNumberError),
    (lambda: tdx_collateral(qe_identity=qe_identity_document(tcbEvaluationDataNumber=17)),
     errors.TcbEvaluationNumberError),
    (lambda: tdx_collateral(tcb_info_document(fmspc="00806f050000")), errors.CollateralPlatformError),
    (lambda: tdx_collateral(qe_identity=qe_identity_document(mrsigner="11" * 32)), errors.QeIdentityError),
    (lambda: tdx_collateral(qe_identity=qe_identity_document(isvprodid=3)), errors.QeIdentityError),
    (lambda: tdx_collateral(tcb_info_document(tdxModule={"mrsigner": "11" * 48, "attributes": "0000000000000000",
                                                         "attributesMask": "FFFFFFFFFFFFFFFF"})),
     errors.TdxModuleIdentityError),
    (lambda: tdx_collateral(issuer_chain=_other_signer()[1]), errors.CollateralChainError),
], ids=["missing", "tcb-info-version", "tcb-info-id", "qe-id", "qe-version", "tcb-info-expired", "qe-expired",
        "issued-in-future", "older-than-max-age", "tcb-info-evaluation-number", "qe-evaluation-number",
        "other-fmspc", "qe-mrsigner", "qe-isvprodid", "module-signer", "untrusted-chain"])
def test_bad_synthetic_collateral_is_refused_by_its_own_class(make, error):
    policy = cpu_policy()
    bundle = tdx_evidence(policy)
    bundle = dataclasses.replace(bundle, cpu=dataclasses.replace(bundle.cpu, tdx_collateral=make()))
    assert_refused_by(bundle, policy, error, "tdx platform")


def test_collateral_signed_by_a_key_outside_the_chain_is_refused():
    key, _ = _other_signer()
    forged = tdx_collateral()
    from tests.cpu_tee_support import signed_collateral

    forged = dataclasses.replace(forged, tcb_info=signed_collateral("tcbInfo", tcb_info_document(), key))
    policy = cpu_policy()
    bundle = tdx_evidence(policy, collateral=forged)
    assert_refused_by(bundle, policy, errors.CollateralSignatureError, "tdx platform")


def test_collateral_survives_the_bundles_json():
    bundle = tdx_evidence(cpu_policy())
    assert EvidenceBundle.from_json(bundle.to_json()) == bundle


# ----- the policy's TDX pins ------------------------------------------------------------------------

OTHER_48 = "ab" * 48
PIN_CASES = [
    ("tdx_fmspcs", '["00806f050000"]', f'["{TDX_FMSPC.hex()}"]', errors.FmspcError),
    ("tdx_mr_seams", f'["{OTHER_48}"]', f'["{bytes(range(48)).hex()}"]', errors.MrSeamError),
    ("tdx_mr_config_id", f'"{OTHER_48}"', f'"{"00" * 48}"', errors.MrConfigIdError),
    ("tdx_mr_owner", f'"{OTHER_48}"', f'"{"00" * 48}"', errors.MrOwnerError),
    ("tdx_mr_owner_config", f'"{OTHER_48}"', f'"{"00" * 48}"', errors.MrOwnerConfigError),
    ("tdx_min_tee_tcb_svn", f'"{bytes([3, 0, 6]).hex()}{"00" * 13}"', f'"{TDX_TEE_TCB_SVN.hex()}"',
     errors.TeeTcbSvnError),
    ("tdx_qe_vendor_id", f'"{"00" * 16}"', f'"{INTEL_QE_VENDOR_ID.hex()}"', errors.QeVendorIdError),
]


@pytest.mark.parametrize("key,refused,matching,error", PIN_CASES, ids=[case[0] for case in PIN_CASES])
def test_each_tdx_pin_refuses_evidence_it_does_not_match_by_its_own_class(key, refused, matching, error):
    policy = cpu_policy(tdx_settings={key: matching})
    assert verify_with_report(tdx_evidence(policy), policy).error is None
    policy = cpu_policy(tdx_settings={key: refused})
    outcome = verify_with_report(tdx_evidence(policy), policy)
    assert type(outcome.error) is error and outcome.error.check == "tdx platform"
    assert OTHER_48 not in str(outcome.error) and "00806f050000" not in str(outcome.error)  # names, never bytes


def test_the_genuine_quotes_pins_are_read_from_its_fields():
    quote, platform = spr_quote()
    assert quote.tee_tcb_svn.hex() == "03000400000000000000000000000000" and quote.qe_vendor_id == INTEL_QE_VENDOR_ID
    assert quote.mrseam.hex().startswith("2fd279c16164a93d") and quote.mr_config_id == bytes(48)
    assert quote.mr_owner == bytes(48) == quote.mr_owner_config and platform.fmspc.hex() == "50806f000000"
