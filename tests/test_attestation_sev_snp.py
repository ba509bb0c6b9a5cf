"""AMD SEV-SNP evidence: the genuine Milan report and its VCEK, ASK and ARK through the verifier's own
steps, and single-field corruptions of genuine and synthetic evidence, each refused by its own check."""

from __future__ import annotations

import dataclasses
import datetime as dt
import re
import struct

import pytest
from cryptography import x509

from attestation import errors, sev_snp
from attestation.bundle import CpuEvidence
from attestation.certs import fingerprint
from attestation.cpu_evidence import check_cpu_revocation, verify_cpu_chain, verify_cpu_report
from attestation.revocation import CrlAgeLimits
from attestation.roots import AMD_ARK_FINGERPRINTS
from attestation.sev_snp import SnpReportFormatError
from attestation.verifier import verify, verify_with_report
from tests.cpu_tee_support import (
    CODE_DIGEST,
    DER,
    NOW,
    SNP_MEASUREMENT,
    SnpFields,
    amd_hierarchy,
    assert_refused_by,
    cpu_policy,
    genuine_snp,
    issue_certificate,
    make_crl,
    snp_evidence,
    snp_report,
    vcek_extensions,
)
from tests.policy_support import filled_strict
from tests.test_attestation_support import flip

STRICT_PINS = filled_strict().attestation.pinned_roots
GENUINE_MEASUREMENT = (
    "b07af9620f3b839b47996422ddec6058338951d984e312115131ea82705eaf5b6bdf8a9ece31a5a608eb0cf2e4872b01"
)
GENUINE_CHIP_ID = (
    "3ac3fe21e13fb0990eb28a802e3fb6a29483a6b0753590c951bdd3b8e53786184ca39e359669a2b76a1936776b564ea4"
    "64cdce40c05f63c9b610c5068b006b5d"
)


def verify_genuine(report: bytes, chain: tuple[bytes, ...], pins=STRICT_PINS):
    """The chain and signature steps the verifier's checks run, on evidence without a Veil binding."""
    cpu = CpuEvidence("sev-snp", report, chain)
    verified = verify_cpu_chain(cpu, pins, NOW)
    return verify_cpu_report(cpu, verified)


# ----- the genuine report ----------------------------------------------------------------------------

def test_the_genuine_milan_report_verifies_to_the_pinned_ark():
    report, chain = genuine_snp()
    verified = verify_cpu_chain(CpuEvidence("sev-snp", report, chain), STRICT_PINS, NOW)
    assert fingerprint(verified.certificates[-1]) == AMD_ARK_FINGERPRINTS["Milan"]
    assert "ARK-Milan" in verified.detail
    fields = verify_genuine(report, chain)
    assert fields.report_data == bytes.fromhex("0102030405") + bytes(59)  # compared with the vector, not a binding
    assert fields.launch is not None and fields.launch.measurement.hex() == GENUINE_MEASUREMENT
    assert fields.chip_id == "sev-snp:" + GENUINE_CHIP_ID
    assert fields.vmpl == 0 and not fields.migration_agent
    assert fields.debug  # the vector's guest policy is 0xB0000: DEBUG allowed


def test_the_genuine_report_is_refused_by_strict_for_want_of_a_crl_and_by_its_debug_policy():
    report, chain = genuine_snp()
    policy = cpu_policy(roots=(AMD_ARK_FINGERPRINTS["Milan"],))
    bundle = snp_evidence(policy, chain=chain)
    bundle = dataclasses.replace(bundle, cpu=CpuEvidence("sev-snp", report, chain, ()))
    outcome = verify_with_report(bundle, policy)
    assert isinstance(outcome.error, errors.CrlError) and "CRL of 'ARK-Milan'" in str(outcome.error)
    with pytest.raises(errors.DebugModeError):
        from attestation.checks import Context, check_debug

        context = Context(bundle, policy, 0.0, None, NOW)
        context.cpu_report = verify_genuine(report, chain)
        check_debug(context)


@pytest.mark.parametrize("offset,field", [
    (0x2A0, "signature r"), (0x2E8, "signature s"), (0x50, "REPORT_DATA"), (0x90, "MEASUREMENT"),
    (0x08, "POLICY"), (0x30, "VMPL"), (0x140, "REPORT_ID"), (0x1E0, "COMMITTED_TCB"),
])
def test_a_flipped_bit_of_the_genuine_report_breaks_its_signature(offset, field):
    report, chain = genuine_snp()
    with pytest.raises(errors.SignatureError, match="does not verify under its VCEK"):
        verify_genuine(flip(report, offset), chain)


def test_a_flipped_reported_tcb_or_chip_id_breaks_the_signature_first():
    report, chain = genuine_snp()
    for offset in (0x180, 0x1A0):
        with pytest.raises(errors.SignatureError) as refusal:
            verify_genuine(flip(report, offset), chain)
        assert type(refusal.value) is errors.SignatureError


@pytest.mark.parametrize("version", [0, 1, 6, 0x100])
def test_unsupported_report_versions_are_refused(version):
    report, chain = genuine_snp()
    with pytest.raises(SnpReportFormatError, match=f"version {version} is not supported"):
        verify_genuine(struct.pack("<I", version) + report[4:], chain)


@pytest.mark.parametrize("length", [0x49F, 0x2A0, 100, 0x4A1])
def test_truncated_or_padded_reports_are_refused(length):
    report, chain = genuine_snp()
    with pytest.raises(SnpReportFormatError, match="truncated or padded"):
        verify_genuine((report + bytes(1))[:length], chain)


@pytest.mark.parametrize("offset", [0x330, 0x400, 0x49F])
def test_bytes_after_the_signature_are_reserved_and_must_be_zero(offset):
    report, chain = genuine_snp()
    assert not any(report[0x330:])  # the firmware's own report: zero there
    with pytest.raises(SnpReportFormatError, match="0x330 to 0x49f"):
        verify_genuine(flip(report, offset), chain)


def test_another_signature_algorithm_is_refused():
    report, chain = genuine_snp()
    with pytest.raises(SnpReportFormatError, match="ECDSA P-384"):
        verify_genuine(report[:0x34] + struct.pack("<I", 2) + report[0x38:], chain)


@pytest.mark.parametrize("index,what", [(0, "VCEK"), (1, "ASK"), (2, "ARK")])
def test_a_corrupted_certificate_of_the_genuine_chain_is_refused(index, what):
    report, chain = genuine_snp()
    certificate = chain[index]
    corrupted = list(chain)
    corrupted[index] = flip(certificate, len(certificate) - 20)  # inside the signature value
    with pytest.raises(errors.ChainError):
        verify_genuine(report, tuple(corrupted))


def test_a_chain_missing_a_certificate_names_what_is_missing():
    report, chain = genuine_snp()
    for partial in (chain[1:], chain[:2], ()):
        with pytest.raises(errors.ChainError, match="VCEK, ASK and ARK"):
            verify_genuine(report, partial)


def test_an_unpinned_ark_is_a_wrong_root():
    report, chain = genuine_snp()
    with pytest.raises(errors.ChainError, match="wrong root"):
        verify_genuine(report, chain, pins=[AMD_ARK_FINGERPRINTS["Genoa"]])


def test_another_chips_vcek_does_not_verify_the_genuine_report():
    report, _ = genuine_snp()
    with pytest.raises(errors.SignatureError):
        verify_genuine(report, amd_hierarchy().chain, pins=[fingerprint(amd_hierarchy().ark)])


def test_a_vcek_under_another_products_chain_is_refused():
    hierarchy = amd_hierarchy()
    genoa_vcek = issue_certificate(
        "SEV-VCEK", hierarchy.vcek_key.public_key(), "SEV-Milan", hierarchy.ask_key, ca=False, serial=4,
        extensions=vcek_extensions("Genoa-B1", hierarchy.tcb, hierarchy.chip_id),
    )
    chain = (genoa_vcek.public_bytes(DER), *hierarchy.chain[1:])
    with pytest.raises(errors.ChainError, match="'Genoa' but its chain is not that product's"):
        verify_cpu_chain(CpuEvidence("sev-snp", bytes(0x4A0), chain), [fingerprint(hierarchy.ark)], NOW)


# ----- synthetic evidence through the whole verifier -------------------------------------------------

def test_synthetic_evidence_passes_every_check_and_names_its_chip():
    policy = cpu_policy()
    node = verify(snp_evidence(policy), policy)
    assert node.cpu_chip_id == "sev-snp:" + amd_hierarchy().chip_id.hex()
    assert all(check.passed for check in node.checks)


def refusal(bundle, policy) -> errors.AttestationError:
    outcome = verify_with_report(bundle, policy)
    assert outcome.error is not None
    return outcome.error


def test_a_reported_tcb_the_vcek_does_not_certify_is_refused():
    policy = cpu_policy()
    for index, what in ((0, "boot loader"), (1, "TEE"), (6, "SNP firmware"), (7, "microcode")):
        tcb = bytearray(amd_hierarchy().tcb)
        tcb[index] += 1
        error = refusal(snp_evidence(policy, SnpFields(reported_tcb=bytes(tcb))), policy)
        assert isinstance(error, errors.CertifiedTcbError) and what in str(error)


def test_a_chip_id_other_than_the_vceks_is_refused():
    policy = cpu_policy()
    error = refusal(snp_evidence(policy, SnpFields(chip_id=bytes(64))), policy)
    assert isinstance(error, errors.ChipIdError)


@pytest.mark.parametrize("fields,error_type,check", [
    (SnpFields(policy=(1 << 17) | (1 << 19)), errors.DebugModeError, "debug"),
    (SnpFields(policy=(1 << 17) | (1 << 18)), errors.MigrationAgentError, "debug"),
    (SnpFields(vmpl=1), errors.PrivilegeLevelError, "confidential mode"),
    (SnpFields(key_info=1 << 2), errors.SignatureError, "signature"),
    (SnpFields(report_data=bytes(63) + b"\x01"), errors.BindingError, "binding"),
    (SnpFields(measurement=bytes(48)), errors.LaunchMeasurementError, "measurement"),
])
def test_a_guest_field_is_refused_by_its_own_check(fields, error_type, check):
    policy = cpu_policy()
    assert_refused_by(snp_evidence(policy, fields), policy, error_type, check)


# Guest POLICY per AMD's ABI (Table 9): bit 17 must be one, bits 26-63 must be zero.
@pytest.mark.parametrize("guest_policy,message", [
    (1 << 16, "bit 17 clear"),
    (0, "bit 17 clear"),
    ((1 << 17) | (1 << 26), "reserves"),
    ((1 << 17) | (1 << 40), "reserves"),
    ((1 << 17) | (1 << 63), "reserves"),
])
def test_a_guest_policy_the_firmware_never_signs_is_a_format_error(guest_policy, message):
    policy = cpu_policy()
    bundle = snp_evidence(policy, SnpFields(policy=guest_policy))
    # The chain check reads CHIP_ID (the node's hardware identity) from the report, so the parse refuses it there.
    assert_refused_by(bundle, policy, SnpReportFormatError, "chain")
    assert message in str(verify_with_report(bundle, policy).error)


def test_every_bit_the_abi_defines_is_accepted():
    policy = cpu_policy()
    defined = (0x1F << 20) | (1 << 25) | (1 << 17) | (1 << 16) | 0x0102  # no debug, no migration agent: ABI 1.2
    assert all(check.passed for check in verify(snp_evidence(policy, SnpFields(policy=defined)), policy).checks)


def test_the_genuine_reports_policy_has_its_must_be_one_bit():
    report, _ = genuine_snp()
    assert sev_snp.parse_snp_report(report).policy == 0xB0000
    cleared = report[:0x08] + struct.pack("<Q", 0x90000) + report[0x10:]
    with pytest.raises(SnpReportFormatError, match="bit 17 clear"):
        sev_snp.parse_snp_report(cleared)


def test_a_launch_measurement_listed_for_other_code_is_refused():
    other_code = "0c0d" * 16
    launch = f'{{ tee = "sev-snp", code = "{other_code}", measurement = "{SNP_MEASUREMENT.hex()}" }}'
    policy = cpu_policy(launch=launch, extra=f', "{other_code}"')
    error = refusal(snp_evidence(policy, code_digest=CODE_DIGEST), policy)
    assert isinstance(error, errors.LaunchMeasurementError) and "listed for other code" in str(error)
    assert verify(snp_evidence(policy, code_digest=other_code), policy).cpu_chip_id is not None


@pytest.mark.parametrize("crl_options,message", [
    ({"next_update": NOW - dt.timedelta(hours=1), "this_update": NOW - dt.timedelta(hours=2)}, "stale"),
    ({"this_update": NOW - dt.timedelta(days=3)}, "policy allows 86400 s (attestation.max_root_crl_age_s)"),
    ({"this_update": NOW + dt.timedelta(hours=1)}, "dated in the future"),
    ({"revoked": (2,)}, "'SEV-Milan' is revoked by 'ARK-Milan'"),
])
def test_a_bad_ark_crl_is_refused(crl_options, message):
    policy = cpu_policy()
    hierarchy = amd_hierarchy()
    error = refusal(snp_evidence(policy, crls=hierarchy.crls(**crl_options)), policy)
    assert isinstance(error, errors.CrlError) and message in str(error)


def test_a_crl_not_signed_by_the_ark_is_refused():
    policy = cpu_policy()
    hierarchy = amd_hierarchy()
    forged = make_crl(hierarchy.ark, hierarchy.ask_key)  # ARK's name, ASK's key
    error = refusal(snp_evidence(policy, crls=(forged,)), policy)
    assert isinstance(error, errors.CrlError) and "not signed by it" in str(error)


def test_evidence_without_its_crl_names_the_missing_crl():
    policy = cpu_policy()
    error = refusal(snp_evidence(policy, crls=()), policy)
    assert isinstance(error, errors.CrlError) and "lacks the CRL of 'ARK-Milan'" in str(error)


def test_evidence_without_a_report_names_it():
    policy = cpu_policy()
    bundle = snp_evidence(policy)
    bundle = dataclasses.replace(bundle, cpu=dataclasses.replace(bundle.cpu, report=b""))
    error = refusal(bundle, policy)
    assert isinstance(error, errors.CpuReportFormatError) and "no report or quote" in str(error)


def test_the_arks_crl_is_the_one_revocation_reads_for_a_vcek_chain():
    # AMD revokes ASKs through the ARK's CRL; VCEKs are retired by TCB, so no ASK CRL is asked for.
    hierarchy = amd_hierarchy()
    cpu = CpuEvidence("sev-snp", bytes(0x4A0), hierarchy.chain, hierarchy.crls())
    verified = verify_cpu_chain(cpu, [fingerprint(hierarchy.ark)], NOW)
    # The ARK is the chain's root: its CRL takes the root's limit, whatever the limit below the root.
    assert "CRLs of ARK-Milan (at most 7200 s old)" in check_cpu_revocation(cpu, verified, NOW, CrlAgeLimits(60, 7200))
    with pytest.raises(errors.CrlError, match=r"policy allows 60 s \(attestation.max_root_crl_age_s\)"):
        check_cpu_revocation(cpu, verified, NOW, CrlAgeLimits(7200, 60))


def test_the_genoa_ark_pinned_by_strict_is_the_one_amd_serves():
    from tests.conftest import REPO_ROOT

    ark = x509.load_pem_x509_certificate((REPO_ROOT / "tests" / "data" / "amd-ark-genoa.pem").read_bytes())
    ark.verify_directly_issued_by(ark)
    assert fingerprint(ark) == AMD_ARK_FINGERPRINTS["Genoa"] and fingerprint(ark) in STRICT_PINS
    assert sev_snp.POLICY_DEBUG == 1 << 19 and sev_snp.POLICY_MIGRATE_MA == 1 << 18


# ----- Turin (EPYC 9005) -------------------------------------------------------------------------------

def test_the_turin_ark_pinned_by_strict_is_self_signed_and_certifies_the_turin_ask():
    from cryptography.hazmat.primitives.asymmetric import padding, rsa

    from tests.conftest import REPO_ROOT

    # AMD KDS's /vcek/v1/Turin/cert_chain (the ASK, then the ARK), as go-sev-guest embeds it.
    ask, ark = x509.load_pem_x509_certificates((REPO_ROOT / "tests" / "data" / "amd-ask-ark-turin.pem").read_bytes())
    assert ark.subject == ark.issuer and ark.subject.rfc4514_string().startswith("CN=ARK-Turin,")
    assert ask.issuer == ark.subject and ask.subject.rfc4514_string().startswith("CN=SEV-Turin,")
    for certificate in (ark, ask):
        key = ark.public_key() if certificate is ark else ask.public_key()
        assert isinstance(key, rsa.RSAPublicKey) and key.key_size == 4096
        assert isinstance(certificate.signature_algorithm_parameters, padding.PSS)
        assert certificate.signature_hash_algorithm is not None and certificate.signature_hash_algorithm.name == "sha384"
    ark.verify_directly_issued_by(ark)
    ask.verify_directly_issued_by(ark)
    assert fingerprint(ark) == AMD_ARK_FINGERPRINTS["Turin"] and fingerprint(ark) in STRICT_PINS
    assert fingerprint(ask) == "5b77ef5fe7a7a004fd9032668fba9d0fda22f88c4442069a479636a6ae3b3185"


TURIN_MINIMUM = '{ product = "Turin", fmc = 1, boot_loader = 3, tee = 0, snp = 8, microcode = 115 }'


def turin_policy():
    return cpu_policy(roots=(fingerprint(amd_hierarchy("Turin").ark),), snp_min_tcb=TURIN_MINIMUM)


def test_synthetic_turin_evidence_passes_every_check_with_its_short_chip_id_and_fmc():
    policy = turin_policy()
    node = verify(snp_evidence(policy, product="Turin"), policy)
    assert all(check.passed for check in node.checks)
    assert node.cpu_chip_id == "sev-snp:" + amd_hierarchy("Turin").chip_id.hex()
    assert amd_hierarchy("Turin").chip_id[8:] == bytes(56)  # a Turin CHIP_ID: 8-byte silicon id, then zeros
    details = {check.name: check.detail for check in node.checks}
    assert "ARK-Turin" in details["chain"]
    assert "SEV-SNP Turin TCB (FMC 1, boot loader 3, TEE 0, SNP firmware 8, microcode 115) meets" in details["revocation"]


@pytest.mark.parametrize("chip_id", [
    bytes(8) + bytes(56),  # another silicon id
    amd_hierarchy("Turin").chip_id[:8] + bytes(55) + b"\x01",  # the VCEK's id, but not zero after it
])
def test_a_turin_chip_id_other_than_the_vceks_hwid_then_zeros_is_refused(chip_id):
    policy = turin_policy()
    error = refusal(snp_evidence(policy, SnpFields(chip_id=chip_id), product="Turin"), policy)
    assert isinstance(error, errors.ChipIdError)


def vcek_chain(product: str, extensions) -> tuple[bytes, ...]:
    hierarchy = amd_hierarchy(product)
    vcek = issue_certificate("SEV-VCEK", hierarchy.vcek_key.public_key(), f"SEV-{product}", hierarchy.ask_key,
                             ca=False, serial=6, extensions=extensions)
    return (vcek.public_bytes(DER), *hierarchy.chain[1:])


@pytest.mark.parametrize("product,struct_version", [("Turin", 0), ("Milan", 1), ("Genoa", 1)])
def test_a_vcek_whose_struct_version_is_not_its_products_is_refused_at_the_chain(product, struct_version):
    hierarchy = amd_hierarchy(product)
    extensions = vcek_extensions(f"{product}-B0", hierarchy.tcb, hierarchy.chip_id, struct_version=struct_version)
    cpu = CpuEvidence("sev-snp", bytes(0x4A0), vcek_chain(product, extensions))
    with pytest.raises(errors.ChainError, match=f"for '{product}' but its structVersion is not"):
        verify_cpu_chain(cpu, [fingerprint(hierarchy.ark)], NOW)


def test_a_turin_vcek_with_a_64_byte_hwid_is_refused_by_name():
    policy = turin_policy()
    hierarchy = amd_hierarchy("Turin")
    long_hwid = tuple(
        x509.UnrecognizedExtension(extension.oid, hierarchy.chip_id) if extension.oid.dotted_string.endswith(".1.4")
        else extension for extension in vcek_extensions("Turin-B0", hierarchy.tcb, hierarchy.chip_id))
    bundle = snp_evidence(policy, chain=vcek_chain("Turin", long_hwid), product="Turin")
    error = refusal(bundle, policy)
    assert isinstance(error, errors.ChainError) and "hwID is 64 bytes; a Turin VCEK's is 8" in str(error)


# Strict's own minimums, as inline tables (no Turin among them: none is published; SECURITY.md, "Platform TCB").
STRICT_SNP_MINIMUMS = ", ".join(
    f'{{ product = "{entry.product}", boot_loader = {entry.boot_loader}, tee = {entry.tee}, snp = {entry.snp}, '
    f"microcode = {entry.microcode} }}" for entry in filled_strict().attestation.sev_snp_min_tcb)


def test_strict_refuses_turin_evidence_by_name_for_want_of_a_published_turin_floor():
    policy = cpu_policy(roots=(fingerprint(amd_hierarchy("Turin").ark),), snp_min_tcb=STRICT_SNP_MINIMUMS)
    error = refusal(snp_evidence(policy, product="Turin"), policy)
    assert isinstance(error, errors.TcbMinimumMissingError) and "for Turin, for which the policy sets no minimum" in str(error)


# ----- the report's version and CPUID against its VCEK's product -------------------------------------------

def test_the_genuine_report_is_version_2_without_a_cpuid_and_verifies_as_milan():
    report, chain = genuine_snp()
    parsed = sev_snp.parse_snp_report(report)
    assert parsed.version == 2 and parsed.cpuid_family is None and not any(report[0x188:0x1A0])
    fields = verify_genuine(report, chain)
    assert fields.snp is not None and fields.snp.product == "Milan"


def product_report(product: str, fields: SnpFields) -> tuple[bytes, tuple[bytes, ...], list[str]]:
    """A synthetic report of `product`'s test chip, its chain, and that chain's ARK to pin."""
    hierarchy = amd_hierarchy(product)
    return snp_report(hierarchy, fields), hierarchy.chain, [fingerprint(hierarchy.ark)]


@pytest.mark.parametrize("product,version,cpuid", [
    ("Milan", 2, None), ("Milan", 3, (0x19, 0x01, 1)), ("Milan", 5, (0x19, 0x0F, 0)),
    ("Genoa", 2, None), ("Genoa", 3, (0x19, 0x11, 1)), ("Genoa", 4, (0x19, 0xA0, 2)),
    ("Turin", 3, (0x1A, 0x02, 1)), ("Turin", 5, (0x1A, 0x11, 0)),
])
def test_a_report_of_its_vceks_product_is_accepted(product, version, cpuid):
    report, chain, pins = product_report(product, SnpFields(version=version, cpuid=cpuid))
    fields = verify_genuine(report, chain, pins)
    assert fields.snp is not None and fields.snp.product == product


@pytest.mark.parametrize("product,cpuid,named", [
    ("Milan", (0x19, 0x11, 1), "Genoa"), ("Milan", (0x1A, 0x02, 1), "Turin"),
    ("Genoa", (0x19, 0x01, 1), "Milan"), ("Genoa", (0x1A, 0x11, 0), "Turin"),
    ("Turin", (0x19, 0x11, 1), "Genoa"), ("Turin", (0x19, 0x01, 0), "Milan"),
])
def test_a_report_whose_cpuid_names_another_product_than_its_vceks_is_refused(product, cpuid, named):
    report, chain, pins = product_report(product, SnpFields(version=3, cpuid=cpuid))
    with pytest.raises(errors.SnpProductError, match=f"name a {named} chip, but its VCEK is for {product}"):
        verify_genuine(report, chain, pins)


@pytest.mark.parametrize("product,cpuid", [
    ("Milan", (0x17, 0x31, 0)),  # family 17h (Rome): no SEV-SNP
    ("Genoa", (0x19, 0x21, 0)),  # family 19h, model 21h: a client Zen 3
    ("Turin", (0x1A, 0x12, 0)),  # just past Turin's models
    ("Turin", (0x1A, 0x50, 0)),  # Venice, whose VCEK layout Veil does not know
    ("Milan", (0, 0, 0)),  # a version 3 report with its CPUID left zero
])
def test_a_report_whose_cpuid_names_no_known_product_is_refused_by_name(product, cpuid):
    report, chain, pins = product_report(product, SnpFields(version=3, cpuid=cpuid))
    with pytest.raises(errors.SnpProductError, match="CPUID_FAM_ID and CPUID_MOD_ID name no processor whose VCEK"):
        verify_genuine(report, chain, pins)


def test_a_turin_report_below_version_3_is_refused_by_name():
    report, chain, pins = product_report("Turin", SnpFields(version=2))
    with pytest.raises(errors.SnpProductError, match="version 2, but its VCEK is for Turin, whose reports must be "
                                                     "version 3 or later"):
        verify_genuine(report, chain, pins)
    policy = turin_policy()  # the whole verifier: refused once the signature verified, at its check
    assert_refused_by(snp_evidence(policy, SnpFields(version=2), product="Turin"), policy, errors.SnpProductError,
                      "signature")


# ----- reserved bytes (AMD 56860, ATTESTATION_REPORT; go-sev-guest's abi.ReportToProto) ----------------------

@pytest.mark.parametrize("version,offset,span", [
    (2, 0x4C, "bytes 0x4c to 0x4f (after KEY_INFO)"), (5, 0x4F, "bytes 0x4c to 0x4f"),
    (2, 0x188, "bytes 0x188 to 0x19f (between REPORTED_TCB and CHIP_ID)"),
    (2, 0x18A, "bytes 0x188 to 0x19f"),  # CPUID_STEP from version 3 on; reserved in version 2
    (3, 0x18B, "bytes 0x18b to 0x19f (between CPUID_STEP and CHIP_ID)"), (5, 0x19F, "bytes 0x18b to 0x19f"),
    (2, 0x1EB, "byte 0x1eb (after CURRENT_MAJOR)"), (4, 0x1EF, "byte 0x1ef (after COMMITTED_MAJOR)"),
    (2, 0x1F8, "bytes 0x1f8 to 0x207 (after LAUNCH_TCB)"), (3, 0x207, "bytes 0x1f8 to 0x207"),
    (2, 0x208, "bytes 0x208 to 0x29f (before the signature)"), (4, 0x250, "bytes 0x208 to 0x29f"),
    (5, 0x29F, "bytes 0x208 to 0x29f"),
    (3, 0x330, "bytes 0x330 to 0x49f (after the signature)"),
])
def test_a_signed_report_with_a_reserved_byte_set_is_refused_by_name(version, offset, span):
    report, chain, pins = product_report("Milan", SnpFields(version=version, raw={offset: b"\x01"}))
    with pytest.raises(SnpReportFormatError, match=rf"reserved {re.escape(span)}.*zero in a version {version} report"):
        verify_genuine(report, chain, pins)


@pytest.mark.parametrize("version,raw", [
    (3, {0x18A: b"\x0f"}),  # CPUID_STEP
    (5, {0x1F8: b"\x01" * 8, 0x200: b"\x03" * 8}),  # LAUNCH_MIT_VECTOR, CURRENT_MIT_VECTOR
    (4, {0x1F8: b"\x01", 0x207: b"\x01"}),  # version 4's layout is unpublished: those bytes are not judged
])
def test_bytes_a_later_report_version_defines_are_not_refused_as_reserved(version, raw):
    report, chain, pins = product_report("Milan", SnpFields(version=version, raw=raw))
    fields = verify_genuine(report, chain, pins)
    assert fields.snp is not None and fields.snp.product == "Milan"


@pytest.mark.parametrize("key_info", [1 << 5, 1 << 31])
def test_reserved_key_info_bits_are_refused_by_name(key_info):
    report, chain, pins = product_report("Milan", SnpFields(key_info=key_info))
    with pytest.raises(SnpReportFormatError, match="KEY_INFO sets bits AMD's ABI reserves"):
        verify_genuine(report, chain, pins)


def test_key_info_bits_the_abi_defines_are_not_refused():
    report, chain, pins = product_report("Milan", SnpFields(key_info=0b11))  # AUTHOR_KEY_EN, MASK_CHIP_KEY
    assert sev_snp.parse_snp_report(report).signing_key == sev_snp.SIGNING_KEY_VCEK
    verify_genuine(report, chain, pins)


VERSION_2_RESERVED = "reserved .* zero in a version 2 report"
MILAN_TCB_RESERVED = "of its TCB_VERSION, which Milan's layout reserves"


@pytest.mark.parametrize("offset,refusal", [
    *((offset, VERSION_2_RESERVED) for offset in (0x4C, 0x190, 0x1EB, 0x1EF, 0x1F8, 0x208, 0x29F)),
    (0x41, "PLATFORM_INFO sets bits AMD's ABI reserves"),  # bit 8; the firmware set SMT_EN (bit 0) only
    # A reserved byte of CURRENT_TCB, REPORTED_TCB, COMMITTED_TCB and LAUNCH_TCB
    *((offset, MILAN_TCB_RESERVED) for offset in (0x3A, 0x183, 0x1E4, 0x1F5)),
])
def test_a_reserved_byte_set_in_the_genuine_report_is_refused_as_reserved_not_as_a_bad_signature(offset, refusal):
    report, chain = genuine_snp()
    with pytest.raises(SnpReportFormatError, match=refusal):
        verify_genuine(flip(report, offset), chain)


def test_a_reserved_byte_set_is_refused_by_the_whole_verifier_at_the_chain_check():
    policy = cpu_policy()
    bundle = snp_evidence(policy, SnpFields(raw={0x190: b"\x80"}))
    # The chain check reads CHIP_ID (the node's hardware identity) from the report, so the parse refuses it there.
    assert_refused_by(bundle, policy, SnpReportFormatError, "chain")
    assert "reserved bytes 0x188 to 0x19f" in str(verify_with_report(bundle, policy).error)


# ----- PLATFORM_INFO's reserved bits and each TCB_VERSION's reserved bytes ---------------------------------

@pytest.mark.parametrize("platform_info", [1 << 8, 1 << 63])
def test_platform_info_bits_no_abi_revision_defines_are_refused_by_name(platform_info):
    report, chain, pins = product_report("Milan", SnpFields(raw={0x40: struct.pack("<Q", platform_info)}))
    with pytest.raises(SnpReportFormatError, match="PLATFORM_INFO sets bits AMD's ABI reserves \\(8 to 63"):
        verify_genuine(report, chain, pins)


@pytest.mark.parametrize("product,version", [("Milan", 2), ("Genoa", 5), ("Turin", 5)])
def test_every_platform_info_bit_an_abi_revision_defines_is_accepted(product, version):
    # Bits 0-5 and 7 (SMT_EN ... ALIAS_CHECK_COMPLETE, TIO_EN), and bit 6, which AMD's published ABI reserves
    # but Turin verifiers read as IOMMU_WRITE_SAFE: a genuine report may set it, so it is not judged.
    report, chain, pins = product_report(product, SnpFields(version=version, raw={0x40: struct.pack("<Q", 0xFF)}))
    verified = verify_genuine(report, chain, pins)
    assert verified.snp is not None and verified.snp.product == product


TCB_FIELDS = {"CURRENT_TCB": 0x38, "REPORTED_TCB": 0x180, "COMMITTED_TCB": 0x1E0, "LAUNCH_TCB": 0x1F0}


def every_tcb(product: str, field: str = "", byte: int = 0) -> dict[int, bytes]:
    """Raw writes giving all four TCB_VERSIONs the product's synthetic TCB, with `byte` of `field` set to 1."""
    raw = {offset: amd_hierarchy(product).tcb for offset in TCB_FIELDS.values()}
    return {**raw, TCB_FIELDS[field] + byte: b"\x01"} if field else raw


@pytest.mark.parametrize("field", TCB_FIELDS)
@pytest.mark.parametrize("product,byte", [
    ("Milan", 2), ("Milan", 5), ("Genoa", 3), ("Genoa", 4),  # family 19h: bytes 2-5 reserved
    ("Turin", 4), ("Turin", 6),  # family 1Ah: bytes 4-6 reserved (byte 6 holds the SNP level on Milan)
])
def test_a_reserved_tcb_version_byte_is_refused_by_name_in_its_products_layout(field, product, byte):
    report, chain, pins = product_report(product, SnpFields(raw=every_tcb(product, field, byte)))
    with pytest.raises(SnpReportFormatError, match=rf"{field} sets byte {byte} of its TCB_VERSION, which "
                                                   rf"{product}'s layout reserves"):
        verify_genuine(report, chain, pins)


@pytest.mark.parametrize("field", TCB_FIELDS)
def test_turins_tee_and_snp_bytes_reserved_in_milans_layout_are_read_not_refused(field):
    tcb = bytes([1, 3, 2, 8, 0, 0, 0, 115])  # FMC 1, boot loader 3, TEE 2, SNP 8: Milan reserves bytes 2 and 3
    raw = every_tcb("Turin") | ({} if field == "REPORTED_TCB" else {TCB_FIELDS[field]: tcb})
    report, chain, pins = product_report("Turin", SnpFields(raw=raw))
    fields = verify_genuine(report, chain, pins)
    assert fields.snp is not None and dict(fields.snp.tcb)["snp"] == 8
    milan_report, milan_chain, milan_pins = product_report("Milan", SnpFields(raw={TCB_FIELDS[field]: tcb}))
    with pytest.raises(SnpReportFormatError, match=f"{field} sets byte 2 of its TCB_VERSION, which Milan's"):
        verify_genuine(milan_report, milan_chain, milan_pins)


def test_a_reserved_tcb_byte_is_refused_by_the_whole_verifier_before_the_signature_counts():
    policy = cpu_policy()
    bundle = snp_evidence(policy, SnpFields(raw={0x1F3: b"\x01"}))  # LAUNCH_TCB byte 3, reserved on Milan
    # The layout is the verified VCEK's product's, so the check runs in the signature step, before the signature.
    assert_refused_by(bundle, policy, SnpReportFormatError, "signature")
    assert "LAUNCH_TCB sets byte 3 of its TCB_VERSION" in str(verify_with_report(bundle, policy).error)
