"""The genuine H100 attestation report and certificate chain, and every single-field corruption of them."""

from __future__ import annotations

import datetime as dt
import struct

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from attestation import spdm
from attestation.certs import fingerprint, pem_chain_to_der
from attestation.errors import BindingError, ChainError, EvidenceFormatError, SignatureError
from attestation.nvidia import verify_gpu_report
from attestation.roots import NVIDIA_DEVICE_IDENTITY_CA_FINGERPRINT, NVIDIA_DEVICE_IDENTITY_CA_PEM
from policy import shipped_policy
from tests.conftest import vectors_path
from tests.test_attestation_support import flip

EXPECTED_NONCE = bytes.fromhex("931d8dd0add203ac3d8b4fbde75e115278eefcdceac5b87671a748f32364dfcb")
VECTORS = vectors_path() / "nvidia-h100"
REPORT = bytes.fromhex((VECTORS / "attestation-report.hex").read_text().strip())
CHAIN = pem_chain_to_der((VECTORS / "cert-chain.pem").read_bytes())
ROOT_PEM = (VECTORS / "device-identity-root.pem").read_bytes()
PINNED = {NVIDIA_DEVICE_IDENTITY_CA_FINGERPRINT}


def _verify(report: bytes = REPORT, chain=CHAIN, pinned=PINNED, nonce: bytes = EXPECTED_NONCE, at_time=None):
    return verify_gpu_report(report, chain, pinned, expected_nonce=nonce, at_time=at_time)


def test_the_genuine_report_verifies():
    parsed = _verify()
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
    assert NVIDIA_DEVICE_IDENTITY_CA_FINGERPRINT in shipped_policy("strict").attestation.pinned_roots


def test_the_chain_is_valid_today_without_a_special_time():
    # These certificates are valid until 9999, so no explicit verification time is needed.
    _verify(at_time=dt.datetime(2026, 11, 21, tzinfo=dt.timezone.utc))
    _verify()


def test_a_time_before_the_chain_existed_is_refused():
    with pytest.raises(ChainError, match="not valid at"):
        _verify(at_time=dt.datetime(2019, 1, 1, tzinfo=dt.timezone.utc))


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
    with pytest.raises(SignatureError):
        _verify(flip(REPORT, offset))


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
    with pytest.raises(EvidenceFormatError):
        _verify(flip(REPORT, offset))


def test_signature_not_requested_is_refused():
    with pytest.raises(EvidenceFormatError, match="without a signature"):
        _verify(flip(REPORT, 2))


@pytest.mark.parametrize("cut", [1, 96, 500, len(REPORT) - 10])
def test_truncated_report_is_refused(cut):
    with pytest.raises(EvidenceFormatError):
        _verify(REPORT[:-cut])


def test_appended_bytes_are_refused():
    with pytest.raises(EvidenceFormatError):
        _verify(REPORT + b"\x00")


def test_another_nonce_is_a_binding_error():
    with pytest.raises(BindingError):
        _verify(nonce=flip(EXPECTED_NONCE, 0))


def test_a_chain_to_an_unpinned_root_is_refused():
    with pytest.raises(ChainError, match="pinned"):
        _verify(pinned={"00" * 32})


def test_a_missing_intermediate_breaks_the_chain():
    with pytest.raises(ChainError, match="broken"):
        _verify(chain=CHAIN[:1] + CHAIN[2:])


def test_a_reordered_chain_is_refused():
    with pytest.raises(ChainError):
        _verify(chain=(CHAIN[1], CHAIN[0]) + CHAIN[2:])


@pytest.mark.parametrize("index", range(len(CHAIN)))
def test_corrupting_any_certificate_signature_is_refused(index):
    corrupted = list(CHAIN)
    corrupted[index] = flip(CHAIN[index], len(CHAIN[index]) - 3)  # inside the signature value
    with pytest.raises(ChainError):
        _verify(chain=tuple(corrupted))


def test_a_truncated_certificate_is_refused():
    with pytest.raises(ChainError, match="malformed"):
        _verify(chain=(CHAIN[0][:-20],) + CHAIN[1:])


def test_the_wrong_leaf_key_breaks_the_signature():
    # Drop the leaf: the rest still chains to the root, but the report was not signed by its key.
    with pytest.raises(SignatureError):
        _verify(chain=CHAIN[1:])


def test_the_parser_reads_the_layout_the_readme_describes():
    parsed = spdm.parse_report(REPORT)
    assert REPORT[1] == spdm.GET_MEASUREMENTS and REPORT[_RESPONSE + 1] == spdm.MEASUREMENTS
    assert parsed.signed_part == REPORT[:-96] and parsed.signature == REPORT[-96:]
    (opaque_length,) = struct.unpack_from("<H", REPORT, _OPAQUE_LENGTH)
    assert _OPAQUE_LENGTH + 2 + opaque_length == len(REPORT) - 96
