"""Certificate chains: parse, walk leaf to root, end at a root pinned by fingerprint."""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Collection, Sequence

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization

from attestation.errors import AttestationError, ChainError

MAX_CHAIN_LENGTH = 8
_PEM_BLOCK = re.compile(rb"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", re.DOTALL)
# What cryptography raises on malformed DER. Beside ValueError it has a type per part (version, extensions,
# key or signature algorithm), and it parses those parts only when they are first read.
DER_ERRORS: tuple[type[Exception], ...] = (
    ValueError, TypeError, UnsupportedAlgorithm, x509.InvalidVersion, x509.DuplicateExtension,
    x509.UnsupportedGeneralNameType,
)


def fingerprint(certificate: x509.Certificate) -> str:
    """SHA-256 of the DER encoding, lowercase hex: how policies pin roots."""
    return certificate.fingerprint(hashes.SHA256()).hex()


def load_der_chain(chain: Sequence[bytes], what: str) -> tuple[x509.Certificate, ...]:
    """Parse a leaf-first chain of DER certificates; raise ChainError if any is malformed."""
    if not chain or len(chain) > MAX_CHAIN_LENGTH:
        raise ChainError(f"the {what} certificate chain must hold 1 to {MAX_CHAIN_LENGTH} certificates")
    message = f"the {what} certificate chain holds a malformed certificate"
    return tuple(parse_certificate(der, ChainError, message) for der in chain)


def parse_certificate(der: bytes, error: type[AttestationError], message: str) -> x509.Certificate:
    """Parse a DER certificate and every part the verifier reads; raise `error(message)` if any is malformed."""
    try:
        certificate = x509.load_der_x509_certificate(der)
        read_every_part(certificate)
    except DER_ERRORS:
        raise error(message) from None
    return certificate


def read_every_part(certificate: x509.Certificate) -> None:
    """Read each part cryptography parses lazily, so that a malformed one raises here (under the caller's
    handler) and never later, in a check reading it before its signature is verified."""
    _ = (certificate.version, certificate.serial_number, certificate.subject, certificate.issuer,
         certificate.not_valid_before_utc, certificate.not_valid_after_utc, certificate.signature_hash_algorithm)
    tuple(certificate.extensions)
    certificate.public_key()


def pem_chain_to_der(pem: bytes) -> tuple[bytes, ...]:
    """Split concatenated PEM certificates (as NVML returns them) into DER, in order."""
    blocks = _PEM_BLOCK.findall(pem)
    try:
        return tuple(
            x509.load_pem_x509_certificate(block).public_bytes(serialization.Encoding.DER) for block in blocks
        )
    except DER_ERRORS:
        raise ChainError("a PEM certificate chain holds a malformed certificate") from None


def verify_chain(
    chain: Sequence[x509.Certificate],
    pinned_roots: Collection[str],
    *,
    what: str,
    at_time: dt.datetime,
) -> x509.Certificate:
    """Check that each certificate is issued by the next, all are valid at `at_time`,
    and the last is a self-signed root whose fingerprint is pinned. Returns the leaf."""
    root = chain[-1]
    if fingerprint(root) not in pinned_roots:
        raise ChainError(f"the {what} chain does not end at a root pinned by the policy (wrong root)")
    for certificate in chain:
        _check_validity(certificate, what, at_time)
    for child, issuer in zip(chain, chain[1:]):
        _check_issued_by(child, issuer, what)
    _check_issued_by(root, root, what)
    return chain[0]


def _check_validity(certificate: x509.Certificate, what: str, at_time: dt.datetime) -> None:
    if not certificate.not_valid_before_utc <= at_time <= certificate.not_valid_after_utc:
        raise ChainError(
            f"a certificate in the {what} chain is not valid at {at_time:%Y-%m-%d %H:%M:%S} UTC "
            "(expired or not yet valid)"
        )


def _check_issued_by(child: x509.Certificate, issuer: x509.Certificate, what: str) -> None:
    try:
        constraints = issuer.extensions.get_extension_for_class(x509.BasicConstraints).value
    except x509.ExtensionNotFound:
        constraints = None
    if constraints is None or not constraints.ca:
        raise ChainError(f"a certificate in the {what} chain is issued by a certificate that is not a CA")
    try:
        child.verify_directly_issued_by(issuer)
    except (*DER_ERRORS, InvalidSignature):
        raise ChainError(f"the {what} chain is broken: a certificate is not signed by the next one up") from None
