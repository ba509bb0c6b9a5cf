"""Stapled OCSP responses over synthetic chains (test CAs made here): each fault is refused by its own error."""

from __future__ import annotations

import datetime as dt

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509 import ocsp as x509_ocsp
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from attestation.backends.sim_gpu import build_ocsp_response
from attestation.errors import (
    CertificateRevokedError,
    OcspCertIdError,
    OcspFormatError,
    OcspNonceError,
    OcspSignatureError,
    OcspStaleError,
    RevocationError,
)
from attestation.ocsp import Freshness, verify_chain_status

NOW = dt.datetime(2026, 3, 1, 12, 0, tzinfo=dt.timezone.utc)
NONCE = bytes(range(32))
MAX_AGE = 3600


def _certificate(name: str, key, issuer_name: str, issuer_key, *, ca: bool, ocsp_signing: bool = False):
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer_name)]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(NOW - dt.timedelta(days=30))
        .not_valid_after(NOW + dt.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ocsp_signing:
        builder = builder.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.OCSP_SIGNING]), critical=False)
    return builder.sign(issuer_key, hashes.SHA384())


class Pki:
    """Root → intermediate → leaf, with every key, as a device or RIM signing chain is shaped."""

    def __init__(self) -> None:
        self.keys = [ec.generate_private_key(ec.SECP384R1()) for _ in range(3)]
        leaf_key, middle_key, root_key = self.keys
        self.root = _certificate("Test Root", root_key, "Test Root", root_key, ca=True)
        self.middle = _certificate("Test Intermediate", middle_key, "Test Root", root_key, ca=True)
        self.leaf = _certificate("Test Leaf", leaf_key, "Test Intermediate", middle_key, ca=False)
        self.chain = (self.leaf, self.middle, self.root)

    def good(self, **options) -> list[bytes]:
        """Good responses for leaf (by the intermediate) and intermediate (by the root)."""
        return [self.response(0, **options), self.response(1, **options)]

    def response(self, position: int, **options) -> bytes:
        options.setdefault("this_update", NOW - dt.timedelta(minutes=5))
        options.setdefault("nonce", NONCE)
        certificate, issuer = self.chain[position], self.chain[position + 1]
        signer_key = options.pop("signer_key", self.keys[position + 1])
        return build_ocsp_response(certificate, issuer, signer_key, **options)


def _check(pki: Pki, responses, *, now: dt.datetime = NOW, nonce: bytes | None = NONCE, first: int = 0) -> int:
    freshness = Freshness(now=now, max_age_s=MAX_AGE, max_skew_s=30, nonce=nonce)
    return verify_chain_status(pki.chain, responses, first=first, what="test chain", freshness=freshness)


@pytest.fixture(scope="module")
def pki() -> Pki:
    return Pki()


def test_good_fresh_responses_for_every_certificate_below_the_root_pass(pki):
    assert _check(pki, pki.good()) == 2


def test_a_response_without_a_nonce_is_accepted_on_its_age(pki):
    assert _check(pki, pki.good(nonce=None)) == 2


def test_the_device_chain_leaves_out_its_boot_time_leaf(pki):
    assert _check(pki, [pki.response(1)], first=1) == 1


def test_a_delegated_responder_signed_by_the_issuer_is_accepted(pki):
    responder_key = ec.generate_private_key(ec.SECP384R1())
    responder = _certificate("Test OCSP", responder_key, "Test Intermediate", pki.keys[1], ca=False, ocsp_signing=True)
    delegated = pki.response(0, signer_key=responder_key, signer=responder)
    assert _check(pki, [delegated, pki.response(1)]) == 2


def _delegated_without_ocsp_usage(pki):
    key = ec.generate_private_key(ec.SECP384R1())
    responder = _certificate("Test OCSP", key, "Test Intermediate", pki.keys[1], ca=False, ocsp_signing=False)
    return [pki.response(0, signer_key=key, signer=responder), pki.response(1)]


def _delegated_by_a_stranger(pki):
    stranger_key, key = ec.generate_private_key(ec.SECP384R1()), ec.generate_private_key(ec.SECP384R1())
    responder = _certificate("Test OCSP", key, "Test Intermediate", stranger_key, ca=False, ocsp_signing=True)
    return [pki.response(0, signer_key=key, signer=responder), pki.response(1)]


def _signed_by_the_wrong_key(pki):
    # An impostor CA with the intermediate's name but its own key answers for the leaf.
    impostor_key = ec.generate_private_key(ec.SECP384R1())
    impostor = _certificate("Test Intermediate", impostor_key, "Test Root", impostor_key, ca=True)
    forged = build_ocsp_response(pki.leaf, impostor, impostor_key, this_update=NOW, nonce=NONCE)
    return [forged, pki.response(1)]


def _corrupted_signature(pki):
    der = pki.response(0)
    return [der[:-2] + bytes([der[-2] ^ 1]) + der[-1:], pki.response(1)]


def _swapped(pki):
    return list(reversed(pki.good()))


def _about_another_certificate(pki):
    other = Pki()
    return [build_ocsp_response(other.leaf, pki.middle, pki.keys[1], this_update=NOW, nonce=NONCE), pki.response(1)]


def _status(pki, status):
    return [pki.response(0, status=status), pki.response(1)]


FAULTS = [
    ("signed by the wrong key", _signed_by_the_wrong_key, OcspSignatureError, {}),
    ("corrupted signature", _corrupted_signature, OcspSignatureError, {}),
    ("responder not allowed to sign OCSP", _delegated_without_ocsp_usage, OcspSignatureError, {}),
    ("responder not issued by the issuer", _delegated_by_a_stranger, OcspSignatureError, {}),
    ("responses swapped", _swapped, OcspSignatureError, {}),
    ("wrong CertID", _about_another_certificate, OcspCertIdError, {}),
    ("revoked", lambda pki: _status(pki, x509_ocsp.OCSPCertStatus.REVOKED), CertificateRevokedError, {}),
    ("unknown", lambda pki: _status(pki, x509_ocsp.OCSPCertStatus.UNKNOWN), CertificateRevokedError, {}),
    ("stale", lambda pki: pki.good(this_update=NOW - dt.timedelta(seconds=MAX_AGE + 1)), OcspStaleError, {}),
    ("future", lambda pki: pki.good(this_update=NOW + dt.timedelta(minutes=5)), OcspStaleError, {}),
    ("past nextUpdate", lambda pki: pki.good(next_update=NOW - dt.timedelta(seconds=1)), OcspStaleError, {}),
    ("another nonce", lambda pki: pki.good(nonce=bytes(32)), OcspNonceError, {}),
    ("nonce without an expected one", lambda pki: pki.good(), OcspNonceError, {"nonce": None}),
    ("truncated", lambda pki: [pki.response(0)[:-10], pki.response(1)], OcspFormatError, {}),
    ("not an OCSP response", lambda pki: [b"\x30\x03\x02\x01\x00", pki.response(1)], OcspFormatError, {}),
    ("responder refused", lambda pki: [x509_ocsp.OCSPResponseBuilder.build_unsuccessful(
        x509_ocsp.OCSPResponseStatus.UNAUTHORIZED).public_bytes(encoding=_der()), pki.response(1)], OcspFormatError, {}),
    ("one missing", lambda pki: [pki.response(0)], RevocationError, {}),
    ("none stapled", lambda pki: [], RevocationError, {}),
]


def _der():
    from cryptography.hazmat.primitives.serialization import Encoding

    return Encoding.DER


@pytest.mark.parametrize("name,make,expected,options", FAULTS, ids=[name for name, _, _, _ in FAULTS])
def test_every_fault_is_refused_with_its_own_error(pki, name, make, expected, options):
    with pytest.raises(RevocationError) as refusal:
        _check(pki, make(pki), **options)
    assert type(refusal.value) is expected, f"refused by {type(refusal.value).__name__}: {refusal.value}"
    assert refusal.value.check == "revocation"


def test_a_stale_intermediate_status_is_refused_even_when_the_leaf_is_fresh(pki):
    with pytest.raises(OcspStaleError, match="certificate 1"):
        _check(pki, [pki.response(0), pki.response(1, this_update=NOW - dt.timedelta(days=2))])


def test_the_missing_responses_are_named(pki):
    with pytest.raises(RevocationError, match="carries no OCSP responses"):
        _check(pki, [])
