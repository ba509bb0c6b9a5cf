"""NVIDIA's genuine RIMs: their XML signatures verify to the pinned RIM root, the 2023 H100 report matches
its RIMs, and every single-field corruption is refused by the step meant to catch it."""

from __future__ import annotations

import dataclasses
import datetime as dt
import re

import pytest
from cryptography import x509

from attestation import spdm
from attestation.certs import fingerprint
from attestation.errors import (
    FirmwareVersionError,
    MeasurementMismatchError,
    RimChainError,
    RimFormatError,
    RimSignatureError,
)
from attestation.reference import (
    compare_measurements,
    encode_vbios_version,
    report_driver_version,
    report_vbios_version,
    verify_reference_measurements,
)
from attestation.rim import ReferenceMeasurement, Rim, verify_rim
from tests.conftest import vectors_path
from tests.policy_support import filled_strict

RIMS = vectors_path() / "nvidia-h100-rim"
RIM_ROOT = x509.load_pem_x509_certificate((vectors_path() / "nvidia-h100" / "rim-root.pem").read_bytes())
PINNED = {fingerprint(RIM_ROOT)}
# The RIM signing leaves were valid from mid-2023 to June 2025; verify as of a time inside that window.
AT = dt.datetime(2024, 1, 1, tzinfo=dt.timezone.utc)
DRIVER = (RIMS / "driver-rim-545.00.swidtag").read_bytes()
VBIOS = (RIMS / "vbios-rim-96.00.5E.00.01.swidtag").read_bytes()
VBIOS_PROD = (RIMS / "vbios-rim-96.00.5E.00.01-prod.swidtag").read_bytes()
REPORT = spdm.parse_report(bytes.fromhex((RIMS / "attestation-report-2023.hex").read_text().strip()))


def _verify(xml: bytes = VBIOS, pinned=PINNED, at_time: dt.datetime = AT) -> Rim:
    return verify_rim(xml, pinned, what="VBIOS RIM", at_time=at_time)


def _edit(xml: bytes, old: bytes, new: bytes) -> bytes:
    assert xml.count(old) >= 1 and old != new
    return xml.replace(old, new, 1)


def _element_text(xml: bytes, tag: bytes, occurrence: int = 0) -> bytes:
    return re.findall(rb"<ds:" + tag + rb">([^<]+)</ds:" + tag + rb">", xml)[occurrence]


def _change_base64(text: bytes, at: int) -> bytes:
    position = at % len(text.rstrip(b"=\n"))
    while text[position:position + 1] in (b"\n", b"="):
        position -= 1
    replacement = b"B" if text[position:position + 1] != b"B" else b"C"
    return text[:position] + replacement + text[position + 1:]


def test_each_genuine_rim_verifies_to_the_pinned_rim_root():
    assert fingerprint(RIM_ROOT) in filled_strict().attestation.pinned_rim_roots
    driver, vbios, prod = (verify_rim(xml, PINNED, what="RIM", at_time=AT) for xml in (DRIVER, VBIOS, VBIOS_PROD))
    assert (driver.version, vbios.version, prod.version) == ("545.00", "96.00.5E.00.01", "96.00.5E.00.01")
    assert [m.index for m in vbios.measurements] == [*range(0, 7), *range(8, 13)]
    assert [m.index for m in driver.measurements] == [7, *range(21, 41)]
    assert vbios.tag_id == prod.tag_id and vbios.tag_id.startswith("560b6686")
    assert vbios.chain[-1] == RIM_ROOT and len(vbios.chain) == 4


def test_the_2023_report_matches_its_driver_and_vbios_rims():
    result = verify_reference_measurements(REPORT, DRIVER, VBIOS, PINNED, at_time=AT)
    assert (result.driver_version, result.vbios_version, result.compared) == ("545.00", "96.00.5E.00.01", 33)


def test_the_production_vbios_rim_differs_at_exactly_indexes_1_2_3_and_9():
    with pytest.raises(MeasurementMismatchError, match=r"index\(es\) 1, 2, 3, 9:") as refusal:
        verify_reference_measurements(REPORT, DRIVER, VBIOS_PROD, PINNED, at_time=AT)
    assert refusal.value.indexes == (1, 2, 3, 9)
    assert refusal.value.check == "reference measurements"


def test_the_report_states_the_versions_the_rims_describe():
    assert report_driver_version(REPORT) == "545.00"
    assert report_vbios_version(REPORT) == "96.00.5E.00.01"
    assert encode_vbios_version("96.00.5E.00.01") == REPORT.opaque_value(6) == bytes.fromhex("005e009601000000")


def test_rims_swapped_between_driver_and_vbios_are_refused_by_version():
    with pytest.raises(FirmwareVersionError, match="driver 545.00"):
        verify_reference_measurements(REPORT, VBIOS, DRIVER, PINNED, at_time=AT)


def test_a_report_without_a_vbios_version_is_refused():
    stripped = dataclasses.replace(REPORT, opaque=tuple(f for f in REPORT.opaque if f.field_type != 6))
    with pytest.raises(FirmwareVersionError, match="no VBIOS version"):
        verify_reference_measurements(stripped, DRIVER, VBIOS, PINNED, at_time=AT)


def test_a_missing_measurement_block_is_a_mismatch_at_its_index():
    without_block_3 = dataclasses.replace(REPORT, blocks=tuple(b for b in REPORT.blocks if b.index != 3))
    with pytest.raises(MeasurementMismatchError) as refusal:
        verify_reference_measurements(without_block_3, DRIVER, VBIOS, PINNED, at_time=AT)
    assert refusal.value.indexes == (2,)


def test_any_listed_alternative_matches_and_none_other_does():
    block = REPORT.blocks[4]
    other = bytes(48)
    rim = Rim("tag", "1", (ReferenceMeasurement(block.index - 1, (other, block.value)),), ())
    assert compare_measurements(REPORT, (rim,)) == 1
    wrong = Rim("tag", "1", (ReferenceMeasurement(block.index - 1, (other, other[:-1] + b"\x01")),), ())
    with pytest.raises(MeasurementMismatchError):
        compare_measurements(REPORT, (wrong,))


def test_an_index_active_in_both_rims_is_refused():
    vbios = _verify()
    with pytest.raises(RimFormatError, match="more than one RIM"):
        compare_measurements(REPORT, (vbios, vbios))


def test_a_comment_is_outside_what_is_signed():
    # XMLDSig's same-document reference excludes comments; the verifier reads none.
    assert _verify(_edit(VBIOS, b"<ns0:Payload", b"<!-- note --><ns0:Payload")).version == "96.00.5E.00.01"


def _move_signature_into_payload() -> bytes:
    signature = VBIOS[VBIOS.index(b"<ds:Signature"):VBIOS.index(b"</SoftwareIdentity>")]
    return _edit(VBIOS.replace(signature, b""), b"</ns0:Payload>", signature + b"</ns0:Payload>")


# Each corruption: (name, the RIM bytes, the error expected).
def _corruptions() -> list[tuple[str, bytes, type[Exception]]]:
    signature_value = _element_text(VBIOS, b"SignatureValue")
    digest_value = _element_text(VBIOS, b"DigestValue")
    cases = [
        ("signature value", _edit(VBIOS, signature_value, _change_base64(signature_value, 40)), RimSignatureError),
        ("digest value", _edit(VBIOS, digest_value, _change_base64(digest_value, 20)), RimSignatureError),
        ("measurement value", _edit(VBIOS, b'Hash0="0b42836f', b'Hash0="0b42836e'), RimSignatureError),
        ("active flag", _edit(VBIOS, b'index="7" active="False"', b'index="7" active="True"'), RimSignatureError),
        ("version", _edit(VBIOS, b'colloquialVersion="96.00.5E.00.01"', b'colloquialVersion="96.00.5E.00.02"'),
         RimSignatureError),
        ("tagId", _edit(VBIOS, b'tagId="560b', b'tagId="660b'), RimSignatureError),
        ("truncated", VBIOS[: len(VBIOS) // 2], RimFormatError),
        ("truncated signature", VBIOS[: VBIOS.index(b"<ds:KeyInfo>")], RimFormatError),
        ("exclusive c14n", VBIOS.replace(b"http://www.w3.org/2006/12/xml-c14n11",
                                         b"http://www.w3.org/2001/10/xml-exc-c14n#"), RimFormatError),
        ("sha256 digest", _edit(VBIOS, b"xmldsig-more#sha384", b"xmlenc#sha256"), RimFormatError),
        ("signature method", _edit(VBIOS, b"ecdsa-sha384", b"ecdsa-sha256"), RimFormatError),
        ("alternative added", _edit(VBIOS, b'index="1" active="True" alternatives="1"',
                                    b'index="1" active="True" alternatives="2" ns2:Hash1="' + b"00" * 48 + b'"'),
         RimSignatureError),
        ("signature moved into the payload", _move_signature_into_payload(), RimFormatError),
        ("external entity", b'<!DOCTYPE s [<!ENTITY x SYSTEM "file:///etc/passwd">]>' + VBIOS, RimFormatError),
        ("xml:id", _edit(VBIOS, b"<ns0:Payload", b'<ns0:Payload xml:id="p"'), RimFormatError),
        ("relative namespace URI", _edit(VBIOS, b'xmlns:ns2="http://www.w3.org/2001/04/xmlenc#sha384"',
                                         b'xmlns:ns2="xmlenc#sha384"'), RimFormatError),
        ("second signature", _edit(VBIOS, b"</ns0:Payload>", b"</ns0:Payload>" + VBIOS[VBIOS.index(b"<ds:Signature"):
                                                                                      VBIOS.index(b"</SoftwareIdentity>")]),
         RimFormatError),
        ("no signing chain", re.sub(rb"<ds:KeyInfo>.*</ds:KeyInfo>", b"", VBIOS, flags=re.DOTALL), RimChainError),
    ]
    for index in range(4):
        certificate = _element_text(VBIOS, b"X509Certificate", index)
        cases.append((f"certificate {index}", _edit(VBIOS, certificate, _change_base64(certificate, -8)), RimChainError))
    certificates = [_element_text(VBIOS, b"X509Certificate", index) for index in range(4)]
    reordered = VBIOS.replace(certificates[0], b"SWAP").replace(certificates[1], certificates[0]).replace(b"SWAP", certificates[1])
    cases.append(("reordered chain", reordered, RimChainError))
    return cases


CORRUPTIONS = _corruptions()


@pytest.mark.parametrize("name,xml,expected", CORRUPTIONS, ids=[name for name, _, _ in CORRUPTIONS])
def test_every_single_field_corruption_is_refused_by_its_own_step(name, xml, expected):
    with pytest.raises(expected) as refusal:
        _verify(xml)
    assert type(refusal.value) is expected
    assert refusal.value.check == "reference measurements"


def test_the_corruption_list_is_broad():
    assert len(CORRUPTIONS) >= 20


def test_an_unpinned_rim_root_is_refused():
    with pytest.raises(RimChainError, match="pinned"):
        _verify(pinned={"00" * 32})


def test_the_device_identity_root_does_not_sign_rims():
    device_root = filled_strict().attestation.pinned_roots
    with pytest.raises(RimChainError, match="pinned"):
        _verify(pinned=set(device_root))


def test_an_expired_rim_signing_certificate_is_refused():
    with pytest.raises(RimChainError, match="not valid at"):
        _verify(at_time=dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc))


def test_a_corrupted_measurement_in_an_unsigned_copy_is_caught_by_comparison():
    # The comparison itself, apart from the signature: one golden value edited after verification.
    vbios = _verify()
    edited = tuple(
        dataclasses.replace(m, alternatives=(bytes(48),)) if m.index == 5 else m for m in vbios.measurements
    )
    with pytest.raises(MeasurementMismatchError) as refusal:
        compare_measurements(REPORT, (dataclasses.replace(vbios, measurements=edited), _driver()))
    assert refusal.value.indexes == (5,)


def _driver() -> Rim:
    return verify_rim(DRIVER, PINNED, what="driver RIM", at_time=AT)
