"""Intel TDX evidence: both genuine version 4 quotes and their embedded PCK chains through the verifier's
own steps, and single-field corruptions of genuine and synthetic quotes, each refused by its own check."""

from __future__ import annotations

import dataclasses
import datetime as dt
import struct

import pytest

from attestation import errors
from attestation.bundle import CpuEvidence
from attestation.certs import fingerprint
from attestation.cpu_evidence import verify_cpu_chain, verify_cpu_report
from attestation.roots import INTEL_SGX_ROOT_CA_FINGERPRINT
from attestation.tdx import TdxQuoteFormatError, parse_tdx_quote
from attestation.verifier import verify, verify_with_report
from tests.cpu_tee_support import (
    CODE_DIGEST,
    GENUINE_TDX_QUOTES,
    NOW,
    TDX_MRTD,
    TDX_RTMRS,
    TdxFields,
    assert_refused_by,
    cpu_policy,
    genuine_tdx,
    intel_hierarchy,
    make_crl,
    tdx_evidence,
)
from tests.policy_support import filled_strict
from tests.test_attestation_support import flip

STRICT_PINS = filled_strict().attestation.pinned_roots
GENUINE = {
    "quote-spr-e4.bin": {
        "mrtd": "6363b8043668a3ad953278e10389574d326c6749fb78aa810ecd9336923db86f22fc00b8dcd404bc10d5e119d7215cbb",
        "rtmr0": "2927da70461cd63266f43230cc1849c03ef25ebe490062a801d8fcc80af42976823adf08f833c1e50b51779c6593f32a",
        "report_data": "6c62dec1b8191749a31dab490be532a35944dea47caef1f980863993d9899545"
                       "eb7406a38d1eed313b987a467dacead6f0c87a6d766c66f6f29f8acb281f1113",
    },
    "quote-gcp-cos113.bin": {
        "mrtd": "dae67181d3d65e073ad8f95b7907d5e927bfe9761c9ff3e9b89734a45d8954dba41394c7717cb2735396c1d04231f94a",
        "rtmr0": "3fa2f61f395b7f5feefb4ec2df61297f109ad8abcd6410c1b7df60f21f37b19297fc35e544039c7e1edece752afd17f6",
        "report_data": "00" * 64,
    },
}
SPR = "quote-spr-e4.bin"


def verify_genuine(quote: bytes, pins=STRICT_PINS, chain: tuple[bytes, ...] = ()):
    """The chain and signature steps the verifier's checks run, on quotes without a Veil binding."""
    cpu = CpuEvidence("tdx", quote, chain)
    return verify_cpu_report(cpu, verify_cpu_chain(cpu, pins, NOW))


def patched(quote: bytes, offset: int, value: bytes) -> bytes:
    return quote[:offset] + value + quote[offset + len(value):]


# ----- the genuine quotes ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", GENUINE_TDX_QUOTES)
def test_each_genuine_quote_verifies_to_the_pinned_intel_root(name):
    quote = genuine_tdx(name)
    verified = verify_cpu_chain(CpuEvidence("tdx", quote, ()), STRICT_PINS, NOW)
    assert fingerprint(verified.certificates[-1]) == INTEL_SGX_ROOT_CA_FINGERPRINT
    fields = verify_genuine(quote)
    expected = GENUINE[name]
    assert fields.report_data.hex() == expected["report_data"]  # compared with the vector, not a binding
    assert fields.launch is not None and fields.launch.measurement.hex() == expected["mrtd"]
    assert fields.launch.rtmrs[0].hex() == expected["rtmr0"] and fields.launch.rtmrs[3] == bytes(48)
    assert not fields.debug and fields.chip_id is not None and fields.chip_id.startswith("tdx-pck:")


def test_the_two_platforms_have_different_chip_identities():
    identities = {verify_genuine(genuine_tdx(name)).chip_id for name in GENUINE_TDX_QUOTES}
    assert len(identities) == 2


def test_a_genuine_quote_under_strict_is_refused_for_want_of_crls():
    policy = cpu_policy(roots=(INTEL_SGX_ROOT_CA_FINGERPRINT,))
    bundle = tdx_evidence(policy)
    bundle = dataclasses.replace(bundle, cpu=CpuEvidence("tdx", genuine_tdx(SPR), ()))
    outcome = verify_with_report(bundle, policy)
    assert isinstance(outcome.error, errors.CrlError) and "lacks the CRL of" in str(outcome.error)


@pytest.mark.parametrize("offset,field", [
    (0x238, "REPORTDATA"), (0x0B8, "MRTD"), (0x178, "RTMR0"), (0x208, "RTMR3"), (0x0A8, "TDATTRIBUTES"),
    (0x040, "MRSEAM"), (0x030, "TEE_TCB_SVN"), (0x0B1, "XFAM bit 8"), (0x27C, "quote signature r"),
    (0x27C + 32, "quote signature s"),
])
def test_a_flipped_bit_of_a_signed_field_breaks_the_quote_signature(offset, field):
    with pytest.raises(errors.SignatureError, match="quote signature does not verify"):
        verify_genuine(flip(genuine_tdx(SPR), offset))


@pytest.mark.parametrize("offset,field", [(0x302 + 64, "QE MRENCLAVE"), (0x302 + 320, "QE report data"),
                                          (0x482, "QE report signature")])
def test_a_flipped_bit_of_the_qe_report_breaks_its_pck_signature(offset, field):
    with pytest.raises(errors.SignatureError, match="QE report signature does not verify under its PCK"):
        verify_genuine(flip(genuine_tdx(SPR), offset))


@pytest.mark.parametrize("offset,field", [(0x2BC, "attestation key"), (0x4C4, "QE auth data")])
def test_an_attestation_key_the_qe_did_not_certify_is_refused(offset, field):
    with pytest.raises(errors.QuotingEnclaveError, match="does not certify its attestation key"):
        verify_genuine(flip(genuine_tdx(SPR), offset))


@pytest.mark.parametrize("version,message", [(5, "version 5 is not supported"), (3, "version 3 is not supported")])
def test_other_quote_versions_are_refused_clearly(version, message):
    with pytest.raises(TdxQuoteFormatError, match=message):
        verify_genuine(patched(genuine_tdx(SPR), 0, struct.pack("<H", version)))


@pytest.mark.parametrize("offset,value,message", [
    (2, struct.pack("<H", 3), "ECDSA P-256 attestation key"),
    (4, struct.pack("<I", 0), "TEE type 0x81"),
    (12, bytes(16), "QE vendor id"),
    (0x2FC, struct.pack("<H", 5), "type 5 where its QE report certification data"),
    (0x4E4, struct.pack("<H", 3), "type 3 where its PCK certificate chain"),
])
def test_malformed_quote_headers_are_refused(offset, value, message):
    with pytest.raises(TdxQuoteFormatError, match=message):
        verify_genuine(patched(genuine_tdx(SPR), offset, value))


@pytest.mark.parametrize("length,what", [(0x100, "TD report body"), (0x2A0, "quote signature"),
                                         (0x400, "QE report"), (0x4C5, "QE auth data"),
                                         (0x800, "PCK certificate chain")])
def test_truncated_quotes_name_the_missing_part(length, what):
    with pytest.raises(TdxQuoteFormatError, match=f"ends inside the {what}"):
        verify_genuine(genuine_tdx(SPR)[:length])


SIGNATURE_DATA_SIZE = 0x278  # offset of the u32 signature data length; 4299 in both genuine quotes
QE_DATA_SIZE = 0x2FE  # u32 size of the QE report certification data (type 6); 4165
PCK_CHAIN_SIZE = 0x4E6  # u32 size of the PCK chain certification data (type 5); 3677


@pytest.mark.parametrize("name", GENUINE_TDX_QUOTES)
def test_the_genuine_quotes_declare_exactly_their_bytes(name):
    quote = genuine_tdx(name)
    offsets = (SIGNATURE_DATA_SIZE, QE_DATA_SIZE, PCK_CHAIN_SIZE)
    sizes = [struct.unpack_from("<I", quote, offset)[0] for offset in offsets]
    assert sizes == [len(quote) - 0x27C, len(quote) - 0x302, len(quote) - 0x4EA] == [4299, 4165, 3677]


@pytest.mark.parametrize("offset,size,what", [
    (SIGNATURE_DATA_SIZE, 0, "signature data size disagrees"),
    (SIGNATURE_DATA_SIZE, 4112, "signature data size disagrees"),
    (SIGNATURE_DATA_SIZE, 4300, "signature data size disagrees"),
    (SIGNATURE_DATA_SIZE, 0xFFFFFFFF, "signature data size disagrees"),
    (QE_DATA_SIZE, 0, "QE report certification data size disagrees"),
    (QE_DATA_SIZE, 4164, "QE report certification data size disagrees"),
    (QE_DATA_SIZE, 0xFFFFFFFF, "QE report certification data size disagrees"),
    (PCK_CHAIN_SIZE, 3676, "bytes after its PCK certificate chain"),
    (PCK_CHAIN_SIZE, 3678, "ends inside the PCK certificate chain"),
])
def test_a_declared_size_that_disagrees_with_the_quotes_bytes_is_a_format_error(offset, size, what):
    for name in GENUINE_TDX_QUOTES:
        with pytest.raises(TdxQuoteFormatError, match=what):
            verify_genuine(patched(genuine_tdx(name), offset, struct.pack("<I", size)))


def test_bytes_after_the_quote_are_a_format_error():
    # go-tdx-guest's copy of the SPR quote ends with 39 such bytes; the Linux TSM interface returns the quote alone.
    with pytest.raises(TdxQuoteFormatError, match="bytes after its PCK certificate chain"):
        verify_genuine(genuine_tdx(SPR) + b"\nextra bytes(only for testing purpose)\n")


def test_a_corrupted_pck_certificate_is_refused():
    quote = genuine_tdx(SPR)
    start = quote.index(b"-----BEGIN CERTIFICATE-----") + 200  # inside the PCK leaf's base64
    corrupted = quote[:start] + (b"A" if quote[start:start + 1] != b"A" else b"B") + quote[start + 1:]
    with pytest.raises(errors.ChainError):
        verify_genuine(corrupted)


def test_a_chain_to_an_unpinned_root_is_refused():
    with pytest.raises(errors.ChainError, match="wrong root"):
        verify_genuine(genuine_tdx(SPR), pins=[fingerprint(intel_hierarchy().root)])


def test_a_chain_carried_beside_the_quote_is_refused():
    with pytest.raises(errors.ChainError, match="cpu.cert_chain must be empty"):
        verify_genuine(genuine_tdx(SPR), chain=(b"\x30\x00",))


def test_the_parser_reads_the_documented_offsets():
    quote = parse_tdx_quote(genuine_tdx(SPR))
    assert quote.td_attributes == 0x40000000 and len(quote.pck_chain) == 3
    assert quote.qe_auth_data == bytes(range(32)) and len(quote.signed) == 0x278


# ----- synthetic quotes through the whole verifier -------------------------------------------------

def test_synthetic_evidence_passes_every_check_and_names_its_pck():
    policy = cpu_policy()
    node = verify(tdx_evidence(policy), policy)
    assert node.cpu_chip_id is not None and node.cpu_chip_id.startswith("tdx-pck:")
    assert all(check.passed for check in node.checks)


@pytest.mark.parametrize("fields,error_type,check", [
    (TdxFields(td_attributes=1), errors.DebugModeError, "debug"),
    (TdxFields(td_attributes=1 << 5), errors.DebugModeError, "debug"),  # any TD-under-debug bit
    (TdxFields(td_attributes=(1 << 28) | (1 << 29)), errors.MigrationAgentError, "debug"),  # MIGRATABLE
    (TdxFields(seam_attributes=1), errors.DebugModeError, "debug"),  # a debug TDX module
    (TdxFields(seam_attributes=1 << 63), errors.DebugModeError, "debug"),
    (TdxFields(mrsigner_seam=bytes(47) + b"\x01"), errors.ConfidentialModeError, "confidential mode"),
    (TdxFields(qe_mrsigner=bytes(32)), errors.QuotingEnclaveError, "signature"),
    (TdxFields(certify_other_key=True), errors.QuotingEnclaveError, "signature"),
    (TdxFields(report_data=bytes(63) + b"\x01"), errors.BindingError, "binding"),
    (TdxFields(mrtd=bytes(48)), errors.LaunchMeasurementError, "measurement"),
    (TdxFields(rtmrs=(bytes(48),) + TDX_RTMRS[1:]), errors.LaunchMeasurementError, "measurement"),
    (TdxFields(pem_chain=b""), errors.ChainError, "chain"),
])
def test_a_quote_field_is_refused_by_its_own_check(fields, error_type, check):
    policy = cpu_policy()
    assert_refused_by(tdx_evidence(policy, fields), policy, error_type, check)


# TDATTRIBUTES bits 1-3, 7-15, 17-26 and 32-61 are reserved; XFAM must hold x87 and SSE, and only what
# XFAM_FIXED0 allows.
@pytest.mark.parametrize("fields,message", [
    (TdxFields(td_attributes=(1 << 28) | (1 << 1)), "TDATTRIBUTES"),
    (TdxFields(td_attributes=(1 << 28) | (1 << 8)), "TDATTRIBUTES"),
    (TdxFields(td_attributes=(1 << 28) | (1 << 17)), "TDATTRIBUTES"),
    (TdxFields(td_attributes=(1 << 28) | (1 << 32)), "TDATTRIBUTES"),
    (TdxFields(td_attributes=(1 << 28) | (1 << 61)), "TDATTRIBUTES"),
    (TdxFields(xfam=0x0006_00E7 | (1 << 3)), "XFAM"),  # MPX
    (TdxFields(xfam=0x0006_00E7 | (1 << 10)), "XFAM"),  # PASID
    (TdxFields(xfam=0x0006_00E7 | (1 << 19)), "XFAM"),
    (TdxFields(xfam=0x0006_00E7 | (1 << 63)), "XFAM"),
    (TdxFields(xfam=0x0006_00E6), "XFAM"),  # x87 clear
    (TdxFields(xfam=0x0006_00E5), "XFAM"),  # SSE clear
])
def test_reserved_td_attributes_or_xfam_bits_are_a_format_error(fields, message):
    policy = cpu_policy()
    bundle = tdx_evidence(policy, fields)
    assert_refused_by(bundle, policy, TdxQuoteFormatError, "chain")
    assert message in str(verify_with_report(bundle, policy).error)


def test_a_tdx_module_intel_did_not_sign_is_refused_by_name():
    policy = cpu_policy()
    error = verify_with_report(tdx_evidence(policy, TdxFields(mrsigner_seam=b"\x5a" * 48)), policy).error
    assert type(error) is errors.ConfidentialModeError and "MRSIGNERSEAM" in str(error)


def test_the_genuine_quotes_come_from_intels_production_tdx_module():
    for name in GENUINE_TDX_QUOTES:
        quote = parse_tdx_quote(genuine_tdx(name))
        assert quote.intel_module and not quote.debug_module and not quote.debug and not quote.migratable


def test_a_migratable_td_is_refused_by_name():
    policy = cpu_policy()
    error = verify_with_report(tdx_evidence(policy, TdxFields(td_attributes=1 << 29)), policy).error
    assert isinstance(error, errors.MigrationAgentError) and "MIGRATABLE" in str(error)


def test_every_td_attribute_and_xfam_bit_the_module_defines_is_accepted_but_debug_and_migratable():
    policy = cpu_policy()
    attributes = sum(1 << bit for bit in (16, 27, 28, 30, 31, 62, 63))  # not the TD-under-debug group, not MIGRATABLE
    node = verify(tdx_evidence(policy, TdxFields(td_attributes=attributes, xfam=0x0006_DBE7)), policy)
    assert all(check.passed for check in node.checks)


def test_the_genuine_quotes_attributes_and_xfam_are_allowed():
    for name in GENUINE_TDX_QUOTES:
        quote = genuine_tdx(name)
        attributes, xfam = struct.unpack_from("<QQ", quote, 0x0A8)
        assert (attributes, xfam) in {(1 << 30, 0x61AE7), (1 << 28, 0x600E7)}
        assert parse_tdx_quote(quote).td_attributes == attributes


def test_rtmrs_a_release_does_not_fix_are_not_compared():
    # The policy fixes RTMR0 only: RTMR1-3 may differ, RTMR0 may not.
    policy = cpu_policy()
    assert verify(tdx_evidence(policy, TdxFields(rtmrs=TDX_RTMRS[:1] + (bytes(48),) * 3)), policy)
    assert TDX_MRTD.hex() in {ref.measurement for ref in policy.attestation.launch_measurements}


def test_a_launch_measurement_for_another_tee_does_not_count():
    launch = f'{{ tee = "sev-snp", code = "{CODE_DIGEST}", measurement = "{TDX_MRTD.hex()}" }}'
    policy = cpu_policy(launch=launch)
    outcome = verify_with_report(tdx_evidence(policy), policy)
    assert isinstance(outcome.error, errors.LaunchMeasurementError) and "not one the policy names" in str(outcome.error)


@pytest.mark.parametrize("which,options,message", [
    ("pck", {"revoked": (12,)}, "'Intel SGX PCK Certificate' is revoked by 'Intel SGX PCK Platform CA'"),
    ("root", {"revoked": (11,)}, "'Intel SGX PCK Platform CA' is revoked by 'Intel SGX Root CA'"),
    ("pck", {"next_update": NOW - dt.timedelta(minutes=5), "this_update": NOW - dt.timedelta(hours=1)}, "stale"),
    ("root", {"this_update": NOW - dt.timedelta(days=2)}, "policy allows 86400 s (attestation.max_root_crl_age_s)"),
    ("pck", {"this_update": NOW - dt.timedelta(days=2)}, "policy allows 86400 s (attestation.max_crl_age_s)"),
])
def test_a_bad_intel_crl_is_refused(which, options, message):
    policy = cpu_policy()
    crls = intel_hierarchy().crls(**{which: options})
    outcome = verify_with_report(tdx_evidence(policy, crls=crls), policy)
    assert isinstance(outcome.error, errors.CrlError) and message in str(outcome.error)


@pytest.mark.parametrize("keep,missing", [(1, "Intel SGX PCK Platform CA"), (0, "Intel SGX Root CA")])
def test_evidence_missing_a_crl_names_it(keep, missing):
    policy = cpu_policy()
    crls = intel_hierarchy().crls()
    outcome = verify_with_report(tdx_evidence(policy, crls=(crls[keep],)), policy)
    assert isinstance(outcome.error, errors.CrlError) and f"lacks the CRL of '{missing}'" in str(outcome.error)


def test_a_pck_crl_signed_by_the_root_instead_of_the_pck_ca_is_refused():
    policy = cpu_policy()
    hierarchy = intel_hierarchy()
    forged = make_crl(hierarchy.platform, hierarchy.root_key)
    outcome = verify_with_report(tdx_evidence(policy, crls=(forged, hierarchy.crls()[1])), policy)
    assert isinstance(outcome.error, errors.CrlError) and "not signed by it" in str(outcome.error)


def test_a_malformed_or_duplicated_crl_is_refused():
    policy = cpu_policy()
    pck_crl, root_crl = intel_hierarchy().crls()
    for crls, message in (((b"not a crl", root_crl), "malformed CRL"), ((pck_crl, pck_crl, root_crl), "more than one CRL")):
        outcome = verify_with_report(tdx_evidence(policy, crls=crls), policy)
        assert isinstance(outcome.error, errors.CrlError) and message in str(outcome.error)
