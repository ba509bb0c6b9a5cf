"""The SEV-SNP platform's floor and pins: the minimum TCB per component, REPORTED_TCB against the VCEK's
TCB extensions (laid out by the product the VCEK names), and the HOST_DATA and ID block pins.

The genuine Milan report carries an old TCB (boot loader 2, TEE 0, SNP 5, microcode 68): the tests that
accept it set a minimum equal to its own TCB, explicitly, and `strict`'s floor refuses it. Synthetic
evidence (tests/cpu_tee_support.py) runs under its own old minimum, `SYNTHETIC_SNP_MINIMUM`."""

from __future__ import annotations

import dataclasses
import struct

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, utils

from attestation import errors
from attestation.bundle import CpuEvidence
from attestation.certs import fingerprint
from attestation.checks import Context
from attestation.cpu_evidence import verify_cpu_chain, verify_cpu_report
from attestation.cpu_reports import CpuReport
from attestation.snp_platform import check_minimum_tcb, check_platform_tcb
from attestation.verifier import node_id_for, verify, verify_with_report
from client.directory import DirectoryEntry
from client.verify import CandidateVerifier
from policy import InvalidValueError, parse_policy
from policy.model import SnpTcbMinimum
from tests.cpu_tee_support import (
    DER,
    NOW,
    SYNTHETIC_CPUIDS,
    SYNTHETIC_SNP_MINIMUM,
    SnpFields,
    amd_hierarchy,
    assert_refused_by,
    cpu_policy,
    cpu_policy_text,
    genuine_snp,
    issue_certificate,
    snp_evidence,
    vcek_extensions,
)
from tests.policy_support import filled_strict
from tests.test_policy_loading import with_value

GENUINE_TCB = {"boot_loader": 2, "tee": 0, "snp": 5, "microcode": 68}  # REPORTED_TCB 0x4405000000000002
GENUINE_MINIMUM = '{ product = "Milan", boot_loader = 2, tee = 0, snp = 5, microcode = 68 }'
SYNTHETIC_TCB = {"boot_loader": 3, "tee": 0, "snp": 8, "microcode": 115}  # amd_hierarchy().tcb
COMPONENT_NAMES = {"boot_loader": "boot loader", "tee": "TEE", "snp": "SNP firmware", "microcode": "microcode",
                   "fmc": "FMC"}


def minimum_text(product: str, levels: dict[str, int]) -> str:
    return "{ " + ", ".join([f'product = "{product}"', *(f"{key} = {value}" for key, value in levels.items())]) + " }"


def raised(levels: dict[str, int], component: str) -> dict[str, int]:
    return {**levels, component: levels[component] + 1}


def genuine_report() -> CpuReport:
    report, chain = genuine_snp()
    cpu = CpuEvidence("sev-snp", report, chain)
    return verify_cpu_report(cpu, verify_cpu_chain(cpu, filled_strict().attestation.pinned_roots, NOW))


def tcb_check_on(report: CpuReport, policy) -> str:
    """The revocation step's SEV-SNP part on a report verified outside a bundle (the genuine one has no binding)."""
    context = Context(snp_evidence(policy), policy, 0.0, None, NOW)
    context.cpu_report = report
    return check_platform_tcb(context)


# ----- the minimum TCB ------------------------------------------------------------------------------

def test_the_genuine_report_is_accepted_under_a_minimum_equal_to_its_own_tcb():
    report = genuine_report()
    assert report.snp is not None and report.snp.product == "Milan"
    assert dict(report.snp.tcb) == GENUINE_TCB
    detail = tcb_check_on(report, cpu_policy(snp_min_tcb=GENUINE_MINIMUM))
    assert "meets the policy's minimum" in detail and "SNP firmware 5" in detail


@pytest.mark.parametrize("component", sorted(GENUINE_TCB))
def test_the_genuine_report_is_refused_under_a_minimum_above_it(component):
    policy = cpu_policy(snp_min_tcb=minimum_text("Milan", raised(GENUINE_TCB, component)))
    with pytest.raises(errors.TcbBelowMinimumError) as refusal:
        tcb_check_on(genuine_report(), policy)
    assert f"{COMPONENT_NAMES[component]} security patch level is below" in str(refusal.value)
    assert refusal.value.check == "revocation"


def test_strict_refuses_the_genuine_reports_old_snp_firmware():
    strict = filled_strict().attestation.sev_snp_min_tcb
    with pytest.raises(errors.TcbBelowMinimumError, match="SNP firmware security patch level is below the "
                                                          "policy's minimum of 24 for Milan"):
        check_minimum_tcb(genuine_report().snp, strict)
    # Its SNP firmware is the one component below: its microcode, 68, is exactly Milan's floor.
    milan = next(entry for entry in strict if entry.product == "Milan")
    snp_lowered = dataclasses.replace(milan, snp=GENUINE_TCB["snp"])
    assert "meets the policy's minimum" in check_minimum_tcb(genuine_report().snp, (snp_lowered,))


def strict_floors() -> dict[str, dict[str, int]]:
    """Strict's minimum per product line and component, as shipped."""
    return {entry.product: {component: getattr(entry, component) for component in GENUINE_TCB}
            for entry in filled_strict().attestation.sev_snp_min_tcb}


def family_19h_tcb(levels: dict[str, int]) -> bytes:
    """TCB_VERSION bytes of Milan and Genoa: boot loader 0, TEE 1, SNP firmware 6, microcode 7."""
    return bytes([levels["boot_loader"], levels["tee"], 0, 0, 0, 0, levels["snp"], levels["microcode"]])


def test_strict_ships_the_published_floors():
    # AMD-SB-3019 (SECURITY.md, "Platform TCB"): SNP firmware 0x18 / 0x17, and each line's lowest fixed
    # microcode patch (Milan-X 0x0A001244, Bergamo/Siena 0x0AA00219). No published boot loader or TEE floor.
    assert strict_floors() == {"Milan": {"boot_loader": 0, "tee": 0, "snp": 24, "microcode": 68},
                               "Genoa": {"boot_loader": 0, "tee": 0, "snp": 23, "microcode": 25}}


FLOORED = [(product, component) for product in ("Genoa", "Milan") for component in ("snp", "microcode")]


@pytest.mark.parametrize("product,component", FLOORED, ids=[f"{p}-{c}" for p, c in FLOORED])
def test_a_platform_at_stricts_floor_passes_and_one_step_below_is_refused_by_name(product, component):
    floor = strict_floors()[product]
    assert floor[component] > 0, f"strict sets no {component} floor for {product}"
    minimums = filled_strict().attestation.sev_snp_min_tcb
    at_floor = verified(resigned_genuine(family_19h_tcb(floor), family_19h_tcb(floor), product), product)
    assert at_floor.snp is not None and "meets the policy's minimum" in check_minimum_tcb(at_floor.snp, minimums)
    below = family_19h_tcb({**floor, component: floor[component] - 1})
    report = verified(resigned_genuine(below, below, product), product)
    assert report.snp is not None
    with pytest.raises(errors.TcbBelowMinimumError, match=f"{COMPONENT_NAMES[component]} security patch level is "
                                                          f"below the policy's minimum of {floor[component]} "
                                                          f"for {product}"):
        check_minimum_tcb(report.snp, minimums)


@pytest.mark.parametrize("component", sorted(SYNTHETIC_TCB))
def test_an_spl_below_the_minimum_is_refused_by_the_revocation_check(component):
    policy = cpu_policy(snp_min_tcb=minimum_text("Milan", raised(SYNTHETIC_TCB, component)))
    assert_refused_by(snp_evidence(policy), policy, errors.TcbBelowMinimumError, "revocation")


def test_a_platform_at_or_above_every_minimum_passes_and_says_so():
    for floor in (SYNTHETIC_TCB, {key: 0 for key in SYNTHETIC_TCB}):
        policy = cpu_policy(snp_min_tcb=minimum_text("Milan", floor))
        checks = {check.name: check.detail for check in verify(snp_evidence(policy), policy).checks}
        assert "SEV-SNP Milan TCB (boot loader 3, TEE 0, SNP firmware 8, microcode 115) meets" in checks["revocation"]


def test_a_product_the_minimums_do_not_name_is_refused_and_none_listed_compares_nothing():
    genoa_only = cpu_policy(snp_min_tcb=minimum_text("Genoa", {key: 0 for key in SYNTHETIC_TCB}))
    assert_refused_by(snp_evidence(genoa_only), genoa_only, errors.TcbMinimumMissingError, "revocation")
    unset = cpu_policy(snp_min_tcb="")
    checks = {check.name: check.detail for check in verify(snp_evidence(unset), unset).checks}
    assert "the policy sets no minimum" in checks["revocation"]


def test_refusals_name_the_field_never_the_evidence():
    policy = cpu_policy(snp_min_tcb=minimum_text("Milan", raised(SYNTHETIC_TCB, "microcode")),
                        snp_pins={"sev_snp_host_data": "11" * 32})
    error = verify_with_report(snp_evidence(policy), policy).error
    assert "microcode" in str(error) and "116" in str(error)  # the field and the policy's minimum
    host_data = bytes(range(32))
    policy = cpu_policy(snp_pins={"sev_snp_host_data": "11" * 32})
    error = verify_with_report(snp_evidence(policy, SnpFields(host_data=host_data)), policy).error
    assert isinstance(error, errors.HostDataError) and host_data.hex() not in str(error)


# ----- REPORTED_TCB against the VCEK, by product ----------------------------------------------------

def resigned_genuine(vcek_tcb: bytes, reported_tcb: bytes, product: str = "Milan") -> CpuEvidence:
    """The genuine report's bytes with `reported_tcb` and the test chip's CHIP_ID of `product` (and for Turin,
    whose reports are version 3 or later, version 3, the test chip's CPUID, and `reported_tcb` as its CURRENT,
    COMMITTED and LAUNCH TCB too, whose Milan layout would set a byte Turin's reserves), re-signed by a test
    VCEK that certifies `vcek_tcb` laid out as `product` lays it out, under the test hierarchy of that product."""
    report, _ = genuine_snp()
    hierarchy = amd_hierarchy(product)
    vcek = issue_certificate("SEV-VCEK", hierarchy.vcek_key.public_key(), f"SEV-{product}", hierarchy.ask_key,
                             ca=False, serial=5, extensions=vcek_extensions(f"{product}-B0", vcek_tcb,
                                                                            hierarchy.chip_id))
    body = bytearray(report[:0x2A0])
    body[0x180:0x188] = reported_tcb
    body[0x1A0:0x1E0] = hierarchy.chip_id
    if product == "Turin":
        body[0x00:0x04] = struct.pack("<I", 3)
        body[0x188:0x18B] = bytes(SYNTHETIC_CPUIDS["Turin"])
        for offset in (0x38, 0x1E0, 0x1F0):
            body[offset:offset + 8] = reported_tcb
    r, s = utils.decode_dss_signature(hierarchy.vcek_key.sign(bytes(body), ec.ECDSA(hashes.SHA384())))
    signed = bytes(body) + r.to_bytes(72, "little") + s.to_bytes(72, "little") + report[0x330:]
    return CpuEvidence("sev-snp", signed, (vcek.public_bytes(DER), *hierarchy.chain[1:]))


def verified(cpu: CpuEvidence, product: str = "Milan") -> CpuReport:
    return verify_cpu_report(cpu, verify_cpu_chain(cpu, [fingerprint(amd_hierarchy(product).ark)], NOW))


GENUINE_TCB_BYTES = struct.pack("<Q", 0x4405000000000002)


def test_the_re_signed_genuine_report_verifies_with_its_own_tcb():
    report = verified(resigned_genuine(GENUINE_TCB_BYTES, GENUINE_TCB_BYTES))
    assert report.snp is not None and dict(report.snp.tcb) == GENUINE_TCB


@pytest.mark.parametrize("component,offset", [("boot loader", 0), ("TEE", 1), ("SNP firmware", 6), ("microcode", 7)])
def test_a_reported_tcb_disagreeing_with_the_vceks_extension_is_refused(component, offset):
    reported = bytearray(GENUINE_TCB_BYTES)
    reported[offset] += 1
    with pytest.raises(errors.CertifiedTcbError, match=f"{component} security patch level \\(REPORTED_TCB\\)"):
        verified(resigned_genuine(GENUINE_TCB_BYTES, bytes(reported)))


def test_a_turin_tcb_is_read_in_turins_layout_with_its_fmc():
    tcb = bytes([1, 2, 3, 4, 0, 0, 0, 5])  # FMC 1, boot loader 2, TEE 3, SNP 4, microcode 5
    report = verified(resigned_genuine(tcb, tcb, "Turin"), "Turin")
    assert report.snp is not None and report.snp.product == "Turin"
    assert dict(report.snp.tcb) == {"fmc": 1, "boot_loader": 2, "tee": 3, "snp": 4, "microcode": 5}
    floor = SnpTcbMinimum("Turin", boot_loader=2, tee=3, snp=4, microcode=5, fmc=1)
    assert "meets" in check_minimum_tcb(report.snp, (floor,))
    with pytest.raises(errors.TcbBelowMinimumError, match="FMC security patch level"):
        check_minimum_tcb(report.snp, (dataclasses.replace(floor, fmc=2),))
    with pytest.raises(errors.CertifiedTcbError, match="FMC"):
        verified(resigned_genuine(tcb, bytes([9, *tcb[1:]]), "Turin"), "Turin")


def test_a_vcek_for_a_product_of_unknown_tcb_layout_is_refused_at_the_chain():
    hierarchy = amd_hierarchy("Venice")
    cpu = CpuEvidence("sev-snp", snp_evidence(cpu_policy()).cpu.report, hierarchy.chain)
    with pytest.raises(errors.ChainError, match="'Venice', whose TCB layout Veil does not know"):
        verify_cpu_chain(cpu, [fingerprint(hierarchy.ark)], NOW)


# ----- HOST_DATA and the ID block ---------------------------------------------------------------------

PINS = [
    ("sev_snp_host_data", "host_data", 32, errors.HostDataError),
    ("sev_snp_id_key_digests", "id_key_digest", 48, errors.IdKeyDigestError),
    ("sev_snp_author_key_digests", "author_key_digest", 48, errors.AuthorKeyDigestError),
]


@pytest.mark.parametrize("key,field,size,error_type", PINS, ids=[pin[0] for pin in PINS])
def test_each_pin_refuses_evidence_that_does_not_match_it(key, field, size, error_type):
    evidence_value, pinned_value = bytes([0xA5]) * size, bytes([0x5A]) * size
    mismatched = cpu_policy(snp_pins={key: pinned_value.hex()})
    bundle = snp_evidence(mismatched, SnpFields(**{field: evidence_value}))
    assert_refused_by(bundle, mismatched, error_type, "measurement")
    assert f"attestation.{key}" in str(verify_with_report(bundle, mismatched).error)
    matched = cpu_policy(snp_pins={key: evidence_value.hex()})
    checks = {check.name: check.detail for check in verify(snp_evidence(matched, SnpFields(**{field: evidence_value})),
                                                           matched).checks}
    assert "pinned" in checks["measurement"] and "no SEV-SNP" not in checks["measurement"]


def test_unpinned_fields_compare_nothing():
    policy = cpu_policy()
    node = verify(snp_evidence(policy, SnpFields(host_data=bytes([7]) * 32, id_key_digest=bytes([8]) * 48)), policy)
    details = {check.name: check.detail for check in node.checks}
    assert "no SEV-SNP HOST_DATA or ID block pinned" in details["measurement"]


def test_the_genuine_reports_empty_id_block_reads_as_zeros():
    report = genuine_report()
    assert report.snp is not None
    assert report.snp.host_data == bytes(32) and report.snp.id_key_digest == bytes(48)
    assert report.snp.author_key_digest == bytes(48)


# ----- the policy keys ------------------------------------------------------------------------------

@pytest.mark.parametrize("key,value", [
    ("sev_snp_min_tcb", [{"product": "Rome", "boot_loader": 0, "tee": 0, "snp": 0, "microcode": 0}]),
    ("sev_snp_min_tcb", [{"product": "Milan", "boot_loader": 0, "tee": 0, "snp": 256, "microcode": 0}]),
    ("sev_snp_min_tcb", [{"product": "Milan", "boot_loader": 0, "tee": 0, "snp": 0}]),
    ("sev_snp_min_tcb", [{"product": "Milan", "boot_loader": 0, "tee": 0, "snp": 0, "microcode": 0, "fmc": 0}]),
    ("sev_snp_min_tcb", [{"product": "Turin", "boot_loader": 0, "tee": 0, "snp": 0, "microcode": 0}]),
    ("sev_snp_min_tcb", [{"product": "Milan", "boot_loader": 0, "tee": 0, "snp": 0, "microcode": 0}] * 2),
    ("sev_snp_min_tcb", "Milan"),
    ("sev_snp_host_data", ["ab" * 31]),
    ("sev_snp_host_data", ["ab" * 32, "AB" * 32]),
    ("sev_snp_id_key_digests", ["ab" * 32]),
    ("sev_snp_author_key_digests", ["zz" * 48]),
])
def test_malformed_snp_policy_values_are_refused(key, value):
    with pytest.raises(InvalidValueError, match=f"attestation.{key}"):
        parse_policy(with_value("attestation", key, value))


def test_old_minimums_are_stated_by_the_tests_that_need_them():
    # The synthetic chip's TCB is below strict's floor: cpu_policy replaces strict's minimums, visibly.
    assert "snp = 8" in SYNTHETIC_SNP_MINIMUM
    strict_floor = {entry.product: entry.snp for entry in filled_strict().attestation.sev_snp_min_tcb}
    assert strict_floor == {"Milan": 24, "Genoa": 23} and SYNTHETIC_TCB["snp"] < strict_floor["Milan"]
    assert "sev_snp_min_tcb = [" + SYNTHETIC_SNP_MINIMUM + "]" in cpu_policy_text()


# ----- the SDK sends to none below the floor -------------------------------------------------------------

def listed(bundle) -> DirectoryEntry:
    """`bundle` as a directory lists it: under the node id its key configuration and measurement give."""
    return DirectoryEntry(node_id=node_id_for(bundle.key_config, bundle.measurement), key_config=bundle.key_config,
                          evidence=bundle.to_json(), capacity=1)


def test_the_sdk_refuses_a_candidate_whose_tcb_is_below_its_policys_minimum():
    old_enough = cpu_policy()
    accepted = CandidateVerifier(old_enough).check(listed(snp_evidence(old_enough)))
    # Verified; only the transparency log that strict requires (no proof from it is stapled) refuses it then.
    assert (accepted.failed_check or "transparency").startswith("transparency"), accepted
    floor = cpu_policy(snp_min_tcb=minimum_text("Milan", raised(SYNTHETIC_TCB, "snp")))
    refused = CandidateVerifier(floor).check(listed(snp_evidence(floor)))
    assert refused.verified is None and refused.failed_check == "revocation", refused
    assert "SNP firmware security patch level is below" in (refused.failure or "")
