"""The genuine H100 attestation report and certificate chain through the verifier's own checks, and every
single-field corruption of them.

NVIDIA published no RIMs for this report's firmware, so `verify_with_report` passes the chain and
signature checks and then stops at the reference check; what these tests assert is which check
passed and which refused. The report answers NVIDIA's sample nonce, so the binding check, which runs
after the reference check, is reached by running the verifier's checks in its order.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import struct
import time

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from attestation import checks, spdm
from attestation.backends.base import bind
from attestation.bundle import EvidenceBundle, GpuEvidence, GpuRims, GpuState
from attestation.certs import fingerprint, pem_chain_to_der
from attestation.errors import (
    AttestationError,
    BindingError,
    ChainError,
    EvidenceFormatError,
    ReferenceMeasurementError,
    SignatureError,
)
from attestation.roots import NVIDIA_DEVICE_IDENTITY_CA_FINGERPRINT, NVIDIA_DEVICE_IDENTITY_CA_PEM
from attestation.verifier import VerificationReport, verify_with_report
from policy import Policy
from tests.conftest import vectors_path
from tests.policy_support import filled_strict
from tests.test_attestation_support import NONCE, RECEIPT_KEY, flip, key_config, measurement_for

EXPECTED_NONCE = bytes.fromhex("931d8dd0add203ac3d8b4fbde75e115278eefcdceac5b87671a748f32364dfcb")
VECTORS = vectors_path() / "nvidia-h100"
REPORT = bytes.fromhex((VECTORS / "attestation-report.hex").read_text().strip())
CHAIN = pem_chain_to_der((VECTORS / "cert-chain.pem").read_bytes())
ROOT_PEM = (VECTORS / "device-identity-root.pem").read_bytes()
STRICT = filled_strict()


def hopper_bundle(policy: Policy, report: bytes = REPORT, chain: tuple[bytes, ...] = CHAIN,
                  rims: GpuRims | None = None) -> EvidenceBundle:
    """Evidence as the nvml backend sends it, carrying `report` and `chain`, bound to a fresh key configuration."""
    measurement = measurement_for(policy, bytes(32))
    config = key_config()
    state = GpuState("PROD", cc_feature=True, devtools_mode=False)
    timestamp = int(time.time())
    bound = bind(config, RECEIPT_KEY, measurement, NONCE, timestamp, state.encode())
    return EvidenceBundle(backend="nvml", key_config=config, receipt_key=RECEIPT_KEY, measurement=measurement, nonce=NONCE,
                          timestamp=timestamp, report_data=bound, cpu=None,
                          gpu=GpuEvidence("nvidia-hopper", report, chain, state, rims=rims))


def _verify(report: bytes = REPORT, chain: tuple[bytes, ...] = CHAIN, policy: Policy = STRICT,
            at_time: dt.datetime | None = None) -> VerificationReport:
    return verify_with_report(hopper_bundle(policy, report, chain), policy, chain_time=at_time)


def _passed(report: VerificationReport) -> dict[str, bool | None]:
    return {check.name: check.passed for check in report.checks}


def _refusal(report: VerificationReport, check: str) -> AttestationError:
    """The error of `report`, after asserting that `check` is the one that refused."""
    assert _passed(report)[check] is False, report.checks
    assert report.error is not None
    return report.error


def test_the_genuine_report_verifies():
    report = _verify()
    assert _passed(report)["chain"] and _passed(report)["signature"]
    # Without RIMs for this firmware the GPU is refused next, naming them.
    assert isinstance(_refusal(report, "reference measurements"), ReferenceMeasurementError)
    assert "no driver and VBIOS RIMs" in str(report.error)
    parsed = spdm.parse_report(REPORT)
    assert parsed.request_nonce == EXPECTED_NONCE
    assert len(parsed.blocks) == 64
    assert all(len(block.value) == 48 for block in parsed.blocks)  # SHA-384 measurements
    assert parsed.opaque_value(spdm.OPAQUE_DRIVER_VERSION).rstrip(b"\x00") == b"550.90.07"
    assert not parsed.is_simulated


def test_the_chain_ends_at_the_root_the_strict_policy_pins():
    root = x509.load_pem_x509_certificate(ROOT_PEM)
    assert CHAIN[-1] == root.public_bytes(serialization.Encoding.DER)
    assert fingerprint(root) == NVIDIA_DEVICE_IDENTITY_CA_FINGERPRINT
    assert pem_chain_to_der(NVIDIA_DEVICE_IDENTITY_CA_PEM)[0] == CHAIN[-1]
    assert NVIDIA_DEVICE_IDENTITY_CA_FINGERPRINT in STRICT.attestation.pinned_roots


def test_the_chain_is_valid_today_without_a_special_time():
    # These certificates are valid until 9999, so no explicit verification time is needed.
    assert _passed(_verify(at_time=dt.datetime(2026, 11, 21, tzinfo=dt.timezone.utc)))["signature"]
    assert _passed(_verify())["signature"]


def test_a_time_before_the_chain_existed_is_refused():
    error = _refusal(_verify(at_time=dt.datetime(2019, 1, 1, tzinfo=dt.timezone.utc)), "chain")
    assert isinstance(error, ChainError) and "not valid at" in str(error)


# Offsets inside the report: request (0..37), response header, first block, responder nonce, opaque data, signature.
_RESPONSE = spdm.REQUEST_SIZE
_RECORD_LENGTH = int.from_bytes(REPORT[_RESPONSE + 5 : _RESPONSE + 8], "little")
_RESPONDER_NONCE = _RESPONSE + 8 + _RECORD_LENGTH
_OPAQUE_LENGTH = _RESPONDER_NONCE + 32


@pytest.mark.parametrize(
    "field,offset",
    [
        ("request nonce", 4),
        ("request slot id", 36),
        ("measurement block index", _RESPONSE + 8),
        ("measurement value", _RESPONSE + 8 + 10),
        ("last measurement value", _RESPONDER_NONCE - 1),
        ("responder nonce", _RESPONDER_NONCE + 3),
        ("opaque driver version byte", len(REPORT) - 96 - 30),
        ("signature r", len(REPORT) - 96),
        ("signature s", len(REPORT) - 1),
    ],
)
def test_corrupting_a_signed_field_breaks_the_signature(field, offset):
    assert isinstance(_refusal(_verify(flip(REPORT, offset)), "signature"), SignatureError)


@pytest.mark.parametrize(
    "field,offset",
    [
        ("request code", 1),
        ("response code", _RESPONSE + 1),
        ("SPDM version", _RESPONSE),
        ("record length", _RESPONSE + 5),
        ("block count", _RESPONSE + 4),
        ("opaque length", _OPAQUE_LENGTH),
    ],
)
def test_corrupting_a_length_or_code_field_is_a_format_error(field, offset):
    assert isinstance(_refusal(_verify(flip(REPORT, offset)), "signature"), EvidenceFormatError)


def test_signature_not_requested_is_refused():
    error = _refusal(_verify(flip(REPORT, 2)), "signature")
    assert isinstance(error, EvidenceFormatError) and "without a signature" in str(error)


@pytest.mark.parametrize("cut", [1, 96, 500, len(REPORT) - 10])
def test_truncated_report_is_refused(cut):
    assert isinstance(_refusal(_verify(REPORT[:-cut]), "signature"), EvidenceFormatError)


def test_appended_bytes_are_refused():
    assert isinstance(_refusal(_verify(REPORT + b"\x00"), "signature"), EvidenceFormatError)


def test_another_nonce_is_a_binding_error():
    # The genuine report answers NVIDIA's sample nonce, never SHA-256(report_data) of a bundle made here.
    ctx = checks.Context(hopper_bundle(STRICT), STRICT, time.time(), None, dt.datetime.now(dt.timezone.utc))
    checks.check_chain(ctx)
    checks.check_signature(ctx)
    assert ctx.gpu_report is not None and ctx.gpu_report.request_nonce == EXPECTED_NONCE
    with pytest.raises(BindingError, match="nonce other than SHA-256"):
        checks.check_binding(ctx)


def test_a_chain_to_an_unpinned_root_is_refused():
    pinned = tuple(root for root in STRICT.attestation.pinned_roots if root != NVIDIA_DEVICE_IDENTITY_CA_FINGERPRINT)
    unpinned = dataclasses.replace(STRICT, attestation=dataclasses.replace(STRICT.attestation, pinned_roots=pinned))
    error = _refusal(_verify(policy=unpinned), "chain")
    assert isinstance(error, ChainError) and "pinned" in str(error)


def test_a_missing_intermediate_breaks_the_chain():
    error = _refusal(_verify(chain=CHAIN[:1] + CHAIN[2:]), "chain")
    assert isinstance(error, ChainError) and "broken" in str(error)


def test_a_reordered_chain_is_refused():
    assert isinstance(_refusal(_verify(chain=(CHAIN[1], CHAIN[0]) + CHAIN[2:]), "chain"), ChainError)


@pytest.mark.parametrize("index", range(len(CHAIN)))
def test_corrupting_any_certificate_signature_is_refused(index):
    corrupted = list(CHAIN)
    corrupted[index] = flip(CHAIN[index], len(CHAIN[index]) - 3)  # inside the signature value
    assert isinstance(_refusal(_verify(chain=tuple(corrupted)), "chain"), ChainError)


def test_a_truncated_certificate_is_refused():
    error = _refusal(_verify(chain=(CHAIN[0][:-20],) + CHAIN[1:]), "chain")
    assert isinstance(error, ChainError) and "malformed" in str(error)


def test_the_wrong_leaf_key_breaks_the_signature():
    # Drop the leaf: the rest still chains to the root, but the report was not signed by its key.
    assert isinstance(_refusal(_verify(chain=CHAIN[1:]), "signature"), SignatureError)


def test_the_parser_reads_the_layout_the_readme_describes():
    parsed = spdm.parse_report(REPORT)
    assert REPORT[1] == spdm.GET_MEASUREMENTS and REPORT[_RESPONSE + 1] == spdm.MEASUREMENTS
    assert parsed.signed_part == REPORT[:-96] and parsed.signature == REPORT[-96:]
    (opaque_length,) = struct.unpack_from("<H", REPORT, _OPAQUE_LENGTH)
    assert _OPAQUE_LENGTH + 2 + opaque_length == len(REPORT) - 96
