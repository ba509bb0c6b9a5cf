"""Evidence bundle format: round trip, strict parsing, binding arithmetic."""

from __future__ import annotations

import hashlib
import json
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attestation.backends.sim import SimBackend
from attestation.binding import ATTEST_TAG, freshness_bytes, gpu_nonce, report_data
from attestation.bundle import BUNDLE_VERSION, EvidenceBundle
from attestation.errors import EvidenceFormatError
from attestation.measurement import Measurement
from tests.test_attestation_support import (  # noqa: F401  (fixtures)
    NONCE,
    b64,
    code_digest,
    collect,
    dev_policy,
    edit_json,
    sim_root_dir,
)


@pytest.fixture()
def bundle(code_digest) -> EvidenceBundle:
    return collect(SimBackend(), dev_policy(), code_digest)


def test_round_trip_is_exact(bundle):
    parsed = EvidenceBundle.from_json(bundle.to_json())
    assert parsed == bundle
    assert parsed.to_json() == bundle.to_json()
    assert json.loads(bundle.to_json())["version"] == BUNDLE_VERSION


def test_stapled_rims_and_ocsp_round_trip_and_are_optional(bundle):
    assert bundle.gpu.rims is not None and bundle.gpu.ocsp  # the simulated GPU staples both
    document = json.loads(bundle.to_json())
    assert set(document["gpu"]["rims"]) == {"driver", "vbios"}
    bare = EvidenceBundle.from_json(edit_json(bundle, lambda d: [d["gpu"].pop("rims"), d["gpu"].pop("ocsp")]))
    assert bare.gpu.rims is None and bare.gpu.ocsp == ()
    assert "rims" not in json.loads(bare.to_json())["gpu"]


@pytest.mark.parametrize(
    "change",
    [
        lambda d: d["gpu"]["rims"].pop("vbios"),
        lambda d: d["gpu"]["rims"]["driver"].pop("ocsp"),
        lambda d: d["gpu"]["rims"]["driver"].update(signed=True),
        lambda d: d["gpu"]["rims"]["driver"].update(xml=d["gpu"]["rims"]["driver"]["xml"][:-1]),
        lambda d: d["gpu"].update(ocsp="not a list"),
        lambda d: d["gpu"].update(ocsp=d["gpu"]["ocsp"] * 9),
    ],
)
def test_stapled_parts_are_parsed_strictly(bundle, change):
    with pytest.raises(EvidenceFormatError):
        EvidenceBundle.from_json(edit_json(bundle, change))


def test_report_data_follows_the_documented_formula(bundle):
    freshness = struct.pack(">B", 32) + NONCE + struct.pack(">QH", bundle.timestamp, len(bundle.gpu.state.encode()))
    freshness += bundle.gpu.state.encode()
    assert bundle.freshness() == freshness
    assert ATTEST_TAG == b"veil-attest-v2" and len(bundle.receipt_key) == 32
    material = ATTEST_TAG + struct.pack(">H", len(bundle.key_config)) + bundle.key_config + bundle.receipt_key
    material += bundle.measurement.digest() + freshness
    assert bundle.report_data == hashlib.sha512(material).digest()
    assert gpu_nonce(bundle.report_data) == hashlib.sha256(bundle.report_data).digest()


def test_binding_is_unambiguous_across_the_key_config_boundary():
    measurement = Measurement(bytes(32), bytes(32), bytes(32))
    fresh = freshness_bytes(NONCE, 1, b"")
    receipt_key = bytes(range(32))
    assert report_data(b"ab", receipt_key, measurement, fresh) != report_data(b"a", receipt_key, measurement, b"b" + fresh)
    with pytest.raises(ValueError, match="32 bytes"):
        report_data(b"ab", receipt_key[:31], measurement, fresh)  # a fixed size, so no boundary to move


@pytest.mark.parametrize(
    "change",
    [
        lambda d: d.pop("gpu"),
        lambda d: d["measurement"].pop("model"),
        lambda d: d["freshness"].update(extra=1),
        lambda d: d.update(backend="sgx"),
        lambda d: d.update(version=1),
        lambda d: d["freshness"].update(timestamp="now"),
        lambda d: d["freshness"].update(timestamp=True),
        lambda d: d["freshness"].update(timestamp=-1),
        lambda d: d["freshness"].update(nonce=b64(bytes(31))),
        lambda d: d["measurement"].update(code=b64(bytes(33))),
        lambda d: d.pop("receipt_key"),
        lambda d: d.update(receipt_key=b64(bytes(31))),
        lambda d: d.update(report_data="not base64!"),
        lambda d: d.update(report_data=d["report_data"].rstrip("=")),
        lambda d: d["gpu"].update(kind="amd-mi300"),
        lambda d: d["gpu"]["state"].update(cc_feature="yes"),
        lambda d: d["gpu"]["state"].update(environment="DEV"),
        lambda d: d["cpu"].update(cert_chain="one"),
        lambda d: d["cpu"].update(cert_chain=[d["cpu"]["cert_chain"][0]] * 9),
        lambda d: d["cpu"].update(kind="sgx"),
    ],
)
def test_malformed_bundles_are_format_errors(bundle, change):
    with pytest.raises(EvidenceFormatError):
        EvidenceBundle.from_json(edit_json(bundle, change))


@pytest.mark.parametrize("text", ["", "[]", "null", "{", '{"version": NaN}', "\"bundle\""])
def test_non_bundles_are_format_errors(text):
    with pytest.raises(EvidenceFormatError):
        EvidenceBundle.from_json(text)


def test_duplicated_nested_field_is_refused(bundle):
    text = bundle.to_json().replace('"cc_feature":true', '"cc_feature":false,"cc_feature":true', 1)
    assert text != bundle.to_json()
    with pytest.raises(EvidenceFormatError, match="duplicated"):
        EvidenceBundle.from_json(text)


def test_unknown_version_message_names_the_supported_one(bundle):
    with pytest.raises(EvidenceFormatError, match=BUNDLE_VERSION):
        EvidenceBundle.from_json(edit_json(bundle, lambda d: d.update(version="veil-evidence-v9")))


@settings(max_examples=40, deadline=None)
@given(st.binary(max_size=64))
def test_arbitrary_bytes_never_crash_the_parser(data):
    try:
        EvidenceBundle.from_json(data)
    except EvidenceFormatError:
        pass
