"""What a simulated GPU staples beside its report: RIMs and OCSP responses, in NVIDIA's formats.

The simulated backend signs a driver RIM and a VBIOS RIM (SWID tags with an
enveloped XMLDSig, exactly the layout of NVIDIA's) with a RIM signing
certificate under the simulated root, and answers OCSP for its certificates
with the simulated root's key, so that simulated evidence runs through the
same reference-measurement and revocation checks as hardware evidence.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
from collections.abc import Mapping, Sequence

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509 import ocsp
from lxml import etree

from attestation.backends.base import sign_raw_p384
from attestation.rim import C14N_11, DS, ECDSA_SHA384, ENVELOPED, HASH_NS, SHA384, SWID, canonicalize

OCSP_VALIDITY = dt.timedelta(days=1)


def build_rim(
    *,
    tag_id: str,
    version: str,
    golden: Mapping[int, Sequence[bytes]],
    count: int,
    signer_key: ec.EllipticCurvePrivateKey,
    chain: Sequence[x509.Certificate],
) -> bytes:
    """A signed RIM with `count` measurement entries, those in `golden` active with their alternatives."""
    root = etree.Element(f"{{{SWID}}}SoftwareIdentity", nsmap={None: SWID, "ns0": SWID, "ns2": HASH_NS})
    root.set("name", "SIMULATED GPU")
    root.set("tagId", tag_id)
    root.set("version", "1.0")
    meta = etree.SubElement(root, f"{{{SWID}}}Meta")
    meta.set("colloquialVersion", version)
    meta.set("product", "Veil SIMULATED GPU")
    payload = etree.SubElement(root, f"{{{SWID}}}Payload")
    for index in range(count):
        _resource(payload, index, golden.get(index, ()))
    _sign(root, signer_key, chain)
    return etree.tostring(root, xml_declaration=False, encoding="UTF-8")


def build_ocsp_response(
    certificate: x509.Certificate,
    issuer: x509.Certificate,
    signer_key: ec.EllipticCurvePrivateKey,
    *,
    this_update: dt.datetime,
    signer: x509.Certificate | None = None,
    status: ocsp.OCSPCertStatus = ocsp.OCSPCertStatus.GOOD,
    next_update: dt.datetime | None = None,
    nonce: bytes | None = None,
) -> bytes:
    """A DER OCSP response for `certificate`, signed by the issuer (or `signer`, a delegated responder)."""
    responder = signer or issuer
    builder = ocsp.OCSPResponseBuilder().add_response(
        cert=certificate, issuer=issuer, algorithm=hashes.SHA256(), cert_status=status,
        this_update=this_update, next_update=next_update or this_update + OCSP_VALIDITY,
        revocation_time=this_update if status == ocsp.OCSPCertStatus.REVOKED else None,
        revocation_reason=None,
    ).responder_id(ocsp.OCSPResponderEncoding.HASH, responder)
    if signer is not None:
        builder = builder.certificates([signer])
    if nonce is not None:
        builder = builder.add_extension(x509.OCSPNonce(nonce), critical=False)
    return builder.sign(signer_key, hashes.SHA384()).public_bytes(serialization.Encoding.DER)


def _resource(payload: etree._Element, index: int, alternatives: Sequence[bytes]) -> None:
    resource = etree.SubElement(payload, f"{{{SWID}}}Resource")
    resource.set("type", "Measurement")
    resource.set("index", str(index))
    resource.set("active", "True" if alternatives else "False")
    resource.set("alternatives", str(max(len(alternatives), 1)))
    for number, value in enumerate(alternatives or (bytes(48),)):
        resource.set(f"{{{HASH_NS}}}Hash{number}", value.hex())
    resource.set("name", f"Measurement_{index}")
    resource.set("size", "48")


def _sign(root: etree._Element, key: ec.EllipticCurvePrivateKey, chain: Sequence[x509.Certificate]) -> None:
    digest = base64.b64encode(hashlib.sha384(canonicalize(root.getroottree())).digest()).decode()
    signature = etree.SubElement(root, f"{{{DS}}}Signature", nsmap={"ds": DS})
    signed_info = etree.SubElement(signature, f"{{{DS}}}SignedInfo")
    etree.SubElement(signed_info, f"{{{DS}}}CanonicalizationMethod", Algorithm=C14N_11)
    etree.SubElement(signed_info, f"{{{DS}}}SignatureMethod", Algorithm=ECDSA_SHA384)
    reference = etree.SubElement(signed_info, f"{{{DS}}}Reference", URI="")
    transforms = etree.SubElement(reference, f"{{{DS}}}Transforms")
    for algorithm in (ENVELOPED, C14N_11):
        etree.SubElement(transforms, f"{{{DS}}}Transform", Algorithm=algorithm)
    etree.SubElement(reference, f"{{{DS}}}DigestMethod", Algorithm=SHA384)
    etree.SubElement(reference, f"{{{DS}}}DigestValue").text = digest
    value = etree.SubElement(signature, f"{{{DS}}}SignatureValue")
    data = etree.SubElement(etree.SubElement(signature, f"{{{DS}}}KeyInfo"), f"{{{DS}}}X509Data")
    for certificate in chain:
        der = certificate.public_bytes(serialization.Encoding.DER)
        etree.SubElement(data, f"{{{DS}}}X509Certificate").text = base64.b64encode(der).decode()
    # Inclusive C14N of SignedInfo takes in the namespaces in scope, so it is signed in place.
    value.text = base64.b64encode(sign_raw_p384(key, canonicalize(signed_info))).decode()
