"""Revocation status from stapled OCSP responses (RFC 6960), checked offline.

A node staples one DER OCSP response per certificate that needs a status, in
chain order: for the GPU device chain every certificate between the leaf and
the root (the leaf is the attestation key the GPU's firmware certifies at
boot, which no responder knows; revoking a GPU revokes its device-unique BROM
certificate above it), and for each RIM's signing chain every certificate
below the root. Each response must:

- be a successful basic response signed by the certificate's issuer, or by a
  responder certificate the issuer signed for OCSP signing (delegation);
- answer for exactly that certificate (CertID: issuer name and key hashes,
  serial number);
- be fresh: thisUpdate at most `max_age_s` old and not in the future (beyond
  the allowed clock skew), nextUpdate, if given, not passed;
- carry, if it has a nonce, the evidence's GPU nonce (a response the node
  fetched for this evidence); a response without one is accepted on its age;
- say good.
"""

from __future__ import annotations

import datetime as dt
import hmac
from collections.abc import Sequence
from dataclasses import dataclass

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.x509 import ocsp
from cryptography.x509.oid import ExtendedKeyUsageOID

from attestation.certs import DER_ERRORS, read_every_part
from attestation.errors import (
    CertificateRevokedError,
    OcspCertIdError,
    OcspFormatError,
    OcspNonceError,
    OcspSignatureError,
    OcspStaleError,
    RevocationError,
)

GPU_DEVICE_FIRST_CHECKED = 1  # the GPU's boot-time attestation leaf has no OCSP status
RIM_FIRST_CHECKED = 0


@dataclass(frozen=True, slots=True)
class Freshness:
    """When the check runs and how old a status may be."""

    now: dt.datetime
    max_age_s: int
    max_skew_s: int
    nonce: bytes | None  # the nonce a response must carry if it carries one


def verify_chain_status(
    chain: Sequence[x509.Certificate],
    responses: Sequence[bytes],
    *,
    first: int,
    what: str,
    freshness: Freshness,
) -> int:
    """Check a good, fresh, correctly signed status for each of chain[first:-1]; return how many."""
    subjects = list(zip(chain[first:-1], chain[first + 1:]))
    if not responses and subjects:
        raise RevocationError(
            f"the {what} carries no OCSP responses; the node must staple a fresh response for each of "
            f"its {len(subjects)} certificate(s) below the root"
        )
    if len(responses) != len(subjects):
        raise RevocationError(
            f"the {what} carries {len(responses)} OCSP response(s) for {len(subjects)} certificate(s) below the "
            "root; staple exactly one per certificate, in chain order"
        )
    for position, ((certificate, issuer), der) in enumerate(zip(subjects, responses), start=first):
        verify_status(der, certificate, issuer, what=f"{what} certificate {position}", freshness=freshness)
    return len(subjects)


def verify_status(
    der: bytes, certificate: x509.Certificate, issuer: x509.Certificate, *, what: str, freshness: Freshness
) -> None:
    """One OCSP response for `certificate`: signature, CertID, freshness, nonce and status, in that order."""
    response = _load(der, what)
    signer = _signer(response, issuer, what, freshness.now)
    _check_signature(response, signer, what)
    single = _single(response, what)
    _check_cert_id(single, certificate, issuer, what)
    _check_fresh(single, what, freshness)
    _check_nonce(response, what, freshness.nonce)
    if single.certificate_status == ocsp.OCSPCertStatus.REVOKED:
        raise CertificateRevokedError(f"the {what} is revoked by its issuer; the node must not be used")
    if single.certificate_status != ocsp.OCSPCertStatus.GOOD:
        raise CertificateRevokedError(f"the OCSP responder does not know the {what} (status unknown)")


def key_hash(certificate: x509.Certificate, algorithm: hashes.HashAlgorithm) -> bytes:
    """Hash of the certificate's public key bits, as OCSP CertIDs and responder ids use it."""
    request = ocsp.OCSPRequestBuilder().add_certificate(certificate, certificate, algorithm).build()
    return request.issuer_key_hash


def _load(der: bytes, what: str) -> ocsp.OCSPResponse:
    try:
        response = ocsp.load_der_ocsp_response(der)
        successful = response.response_status == ocsp.OCSPResponseStatus.SUCCESSFUL
        if successful:
            _read_every_part(response)
    except DER_ERRORS:
        raise OcspFormatError(f"the OCSP response for the {what} is malformed (truncated or corrupted)") from None
    if not successful:
        raise OcspFormatError(f"the OCSP responder answered {response.response_status.name} for the {what}")
    return response


def _read_every_part(response: ocsp.OCSPResponse) -> None:
    """Read each part cryptography parses lazily (the signature algorithm is read by _check_signature), so that
    a malformed one raises under _load's handler, not in a later step."""
    _ = (response.responder_name, response.responder_key_hash, response.signature, response.tbs_response_bytes,
         tuple(response.extensions))
    for certificate in response.certificates:
        read_every_part(certificate)
    for single in response.responses:
        _ = (single.hash_algorithm, single.serial_number, single.issuer_name_hash, single.issuer_key_hash,
             single.certificate_status, single.this_update_utc, single.next_update_utc)


def _signer(response: ocsp.OCSPResponse, issuer: x509.Certificate, what: str, now: dt.datetime) -> x509.Certificate:
    """The issuer itself, or a responder certificate the issuer delegated OCSP signing to."""
    if _is_responder(response, issuer):
        return issuer
    for candidate in response.certificates:
        if _is_responder(response, candidate) and _delegated(candidate, issuer, now):
            return candidate
    raise OcspSignatureError(
        f"the OCSP response for the {what} is signed neither by its issuer nor by a responder the issuer authorized"
    )


def _is_responder(response: ocsp.OCSPResponse, certificate: x509.Certificate) -> bool:
    if response.responder_name is not None:
        return response.responder_name == certificate.subject
    return hmac.compare_digest(response.responder_key_hash or b"", key_hash(certificate, hashes.SHA1()))


def _delegated(responder: x509.Certificate, issuer: x509.Certificate, now: dt.datetime) -> bool:
    try:
        responder.verify_directly_issued_by(issuer)
        usage = responder.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except (*DER_ERRORS, InvalidSignature, x509.ExtensionNotFound):
        return False
    valid = responder.not_valid_before_utc <= now <= responder.not_valid_after_utc
    return valid and ExtendedKeyUsageOID.OCSP_SIGNING in usage


def _check_signature(response: ocsp.OCSPResponse, signer: x509.Certificate, what: str) -> None:
    key = signer.public_key()
    try:
        algorithm = response.signature_hash_algorithm
        if isinstance(key, ec.EllipticCurvePublicKey) and algorithm is not None:
            key.verify(response.signature, response.tbs_response_bytes, ec.ECDSA(algorithm))
        elif isinstance(key, rsa.RSAPublicKey) and algorithm is not None:
            key.verify(response.signature, response.tbs_response_bytes, padding.PKCS1v15(), algorithm)
        else:
            raise OcspSignatureError(f"the OCSP response for the {what} uses an unsupported signature algorithm")
    except (InvalidSignature, *DER_ERRORS):
        raise OcspSignatureError(f"the OCSP response for the {what} has an invalid signature") from None


def _single(response: ocsp.OCSPResponse, what: str) -> ocsp.OCSPSingleResponse:
    singles = list(response.responses)
    if len(singles) != 1:
        raise OcspFormatError(f"the OCSP response for the {what} must answer for exactly one certificate")
    return singles[0]


def _check_cert_id(single: ocsp.OCSPSingleResponse, certificate: x509.Certificate, issuer: x509.Certificate, what: str) -> None:
    try:
        expected = ocsp.OCSPRequestBuilder().add_certificate(certificate, issuer, single.hash_algorithm).build()
    except DER_ERRORS:  # a CertID hash OCSP requests may not use (MD5, SHA-3)
        raise OcspCertIdError(f"the OCSP response for the {what} identifies it with an unsupported hash") from None
    same = (
        single.serial_number == certificate.serial_number
        and hmac.compare_digest(single.issuer_name_hash, expected.issuer_name_hash)
        and hmac.compare_digest(single.issuer_key_hash, expected.issuer_key_hash)
    )
    if not same:
        raise OcspCertIdError(f"the OCSP response stapled for the {what} answers for another certificate")


def _check_fresh(single: ocsp.OCSPSingleResponse, what: str, freshness: Freshness) -> None:
    age = (freshness.now - single.this_update_utc).total_seconds()
    if age > freshness.max_age_s:
        raise OcspStaleError(
            f"the OCSP response for the {what} is {age:.0f} s old; policy allows {freshness.max_age_s} s. "
            "Staple a fresh one"
        )
    if -age > freshness.max_skew_s:
        raise OcspStaleError(f"the OCSP response for the {what} is dated {-age:.0f} s in the future")
    next_update = single.next_update_utc
    if next_update is not None and freshness.now > next_update:
        raise OcspStaleError(f"the OCSP response for the {what} is past its nextUpdate; staple a fresh one")


def _check_nonce(response: ocsp.OCSPResponse, what: str, expected: bytes | None) -> None:
    try:
        nonce = response.extensions.get_extension_for_class(x509.OCSPNonce).value.nonce
    except x509.ExtensionNotFound:
        return
    if expected is None or not hmac.compare_digest(nonce, expected):
        raise OcspNonceError(f"the OCSP response for the {what} was fetched for other evidence (its nonce differs)")
