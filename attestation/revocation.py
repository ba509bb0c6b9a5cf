"""Revocation of attestation certificates, checked offline from what the node staples.

A node fetches its vendor's certificate revocation lists (AMD KDS for the
ARK's CRL; Intel PCS for the PCK CRL and the Intel SGX Root CA CRL) and
staples them to its evidence; the verifier never goes online. For each
issuer that must vouch for its children, the CRL it signed must be present,
verify under that issuer's key, be inside its own validity window
(thisUpdate <= now < nextUpdate), be no older than the policy allows for its
issuer, and must not list the certificate that issuer signed in the chain.

How old a CRL may be depends on who issued it (`CrlAgeLimits`): a CA below the
root (Intel's PCK CAs) reissues its CRL monthly, while a root reissues its own
rarely (Intel's SGX Root CA about once a year: nextUpdate a year after
thisUpdate), so one limit for both would refuse every genuine root CRL.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cryptography import x509

from attestation.certs import DER_ERRORS
from attestation.errors import CrlError

if TYPE_CHECKING:
    from policy.model import AttestationPolicy

MAX_CRLS = 8


@dataclass(frozen=True, slots=True)
class CrlAgeLimits:
    """How old (seconds since its thisUpdate) a stapled CRL may be, by the place of its issuer in the chain."""

    max_age_s: int  # a CRL issued by a CA below the root (Intel's PCK Platform / Processor CA)
    max_root_age_s: int  # a CRL issued by the chain's root itself (Intel's SGX Root CA, AMD's ARK)

    @classmethod
    def of(cls, attestation: AttestationPolicy) -> CrlAgeLimits:
        return cls(attestation.max_crl_age_s, attestation.max_root_crl_age_s)

    def for_issuer(self, is_root: bool) -> tuple[int, str]:
        """The limit for an issuer, and the policy key that sets it (named in a refusal)."""
        if is_root:
            return self.max_root_age_s, "max_root_crl_age_s"
        return self.max_age_s, "max_crl_age_s"


def load_crls(crls: Sequence[bytes], what: str) -> tuple[x509.CertificateRevocationList, ...]:
    """Parse stapled DER CRLs; raise CrlError if any is malformed."""
    if len(crls) > MAX_CRLS:
        raise CrlError(f"the {what} evidence staples more than {MAX_CRLS} CRLs")
    try:
        return tuple(_parse_crl(der) for der in crls)
    except DER_ERRORS:
        raise CrlError(f"the {what} evidence staples a malformed CRL (DER expected)") from None


def _parse_crl(der: bytes) -> x509.CertificateRevocationList:
    """Parse a CRL and read each part cryptography parses lazily, so that a malformed one raises here."""
    crl = x509.load_der_x509_crl(der)
    _ = (crl.issuer, crl.last_update_utc, crl.next_update_utc, tuple(crl.extensions))
    for entry in crl:
        _ = (entry.serial_number, entry.revocation_date_utc, tuple(entry.extensions))
    return crl


def check_chain_not_revoked(
    chain: Sequence[x509.Certificate],
    crls: Sequence[bytes],
    *,
    issuers: Sequence[int],
    at_time: dt.datetime,
    limits: CrlAgeLimits,
    what: str,
) -> str:
    """Check the CRL of each chain[i], i in `issuers`, against chain[i - 1]; return a one-line detail.

    `chain` ends at its root (verified to a pinned one before): chain[-1]'s CRL takes the root's age limit."""
    parsed = load_crls(crls, what)
    ages = []
    for index in issuers:
        issuer, child = chain[index], chain[index - 1]
        crl = _crl_signed_by(issuer, parsed, what)
        max_age_s, key = limits.for_issuer(index == len(chain) - 1)
        _check_crl_fresh(crl, _name(issuer), at_time, (max_age_s, key), what)
        if crl.get_revoked_certificate_by_serial_number(child.serial_number) is not None:
            raise CrlError(f"the {what} certificate {_name(child)!r} is revoked by {_name(issuer)!r}")
        ages.append(f"{_name(issuer)} (at most {max_age_s} s old)")
    return f"not revoked (CRLs of {', '.join(ages)})"


def _crl_signed_by(
    issuer: x509.Certificate, crls: Sequence[x509.CertificateRevocationList], what: str
) -> x509.CertificateRevocationList:
    candidates = [crl for crl in crls if crl.issuer == issuer.subject]
    if not candidates:
        raise CrlError(
            f"the {what} evidence lacks the CRL of {_name(issuer)!r}; the node must staple it (fetched from its vendor)"
        )
    if len(candidates) > 1:
        raise CrlError(f"the {what} evidence staples more than one CRL of {_name(issuer)!r}; staple the newest only")
    crl = candidates[0]
    try:
        valid = crl.is_signature_valid(issuer.public_key())  # type: ignore[arg-type]
    except DER_ERRORS:  # a signature algorithm cryptography does not know, or one that does not fit the key
        valid = False
    if not valid:
        raise CrlError(f"the stapled CRL of {_name(issuer)!r} is not signed by it")
    return crl


def _check_crl_fresh(
    crl: x509.CertificateRevocationList, issuer: str, at_time: dt.datetime, limit: tuple[int, str], what: str
) -> None:
    """Inside its own window (thisUpdate <= t < nextUpdate: at nextUpdate a newer CRL is due) and within
    `limit`: the policy's maximum age for this issuer's CRLs, and the key that sets it."""
    issued, expires = crl.last_update_utc, crl.next_update_utc
    if issued > at_time:
        raise CrlError(f"the {what} CRL of {issuer!r} is dated in the future; check the node's collateral")
    if expires is None or expires <= at_time:
        raise CrlError(f"the {what} CRL of {issuer!r} is past its next update (stale); fetch a new one")
    age, (max_age_s, key) = (at_time - issued).total_seconds(), limit
    if age > max_age_s:
        raise CrlError(
            f"the {what} CRL of {issuer!r} is {age:.0f} s old; policy allows {max_age_s} s "
            f"(attestation.{key}). Fetch a new one"
        )


def _name(certificate: x509.Certificate) -> str:
    names = certificate.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)
    return str(names[0].value) if names else certificate.subject.rfc4514_string()
