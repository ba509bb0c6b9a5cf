"""NVIDIA reference integrity manifests (RIMs): SWID tags with an enveloped XML signature, verified offline.

A RIM lists golden values for a GPU's SPDM measurement blocks (RIM index i is
block i + 1), each with one or more alternative SHA-384 digests, and says which
indexes are active. NVIDIA signs it with an enveloped XMLDSig::

    Reference URI=""      transforms: enveloped-signature, C14N 1.1 (inclusive, no comments)
    DigestMethod          SHA-384
    SignatureMethod       ECDSA-SHA384, SignatureValue raw r ‖ s (96 bytes)
    KeyInfo/X509Data      the signing chain, leaf first, ending at NVIDIA's RIM root

Canonicalization is lxml's (libxml2's) inclusive C14N 1.0. C14N 1.1 differs
from 1.0 only in how attributes of the xml: namespace (xml:id, xml:base and
their inheritance into document subsets) are treated; a RIM holding any xml:
attribute is refused, so for every RIM accepted here the two are identical.

Parsing is safe: no DTD (a DOCTYPE is refused), no entity expansion, no
network, no huge-tree mode, and a size limit. Every value the verifier uses is
read from the same tree whose digest is checked.
"""

from __future__ import annotations

import base64
import binascii
import copy
import datetime as dt
from collections.abc import Collection
from dataclasses import dataclass

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, utils
from lxml import etree

from attestation.certs import MAX_CHAIN_LENGTH, parse_certificate, verify_chain
from attestation.errors import ChainError, RimChainError, RimFormatError, RimSignatureError

MAX_RIM_SIZE = 1 << 20
SWID = "http://standards.iso.org/iso/19770/-2/2015/schema.xsd"
DS = "http://www.w3.org/2000/09/xmldsig#"
HASH_NS = "http://www.w3.org/2001/04/xmlenc#sha384"
XML_NS = "http://www.w3.org/XML/1998/namespace"
C14N_11 = "http://www.w3.org/2006/12/xml-c14n11"
ENVELOPED = "http://www.w3.org/2000/09/xmldsig#enveloped-signature"
SHA384 = "http://www.w3.org/2001/04/xmldsig-more#sha384"
ECDSA_SHA384 = "http://www.w3.org/2001/04/xmldsig-more#ecdsa-sha384"
DIGEST_SIZE = 48
_MAX_INDEX = 255
_MAX_ALTERNATIVES = 16


@dataclass(frozen=True, slots=True)
class ReferenceMeasurement:
    """The golden values of one active RIM index: any one of `alternatives` is acceptable."""

    index: int
    alternatives: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class Rim:
    """A RIM whose signature verified: its identity, version and active golden values."""

    tag_id: str
    version: str
    measurements: tuple[ReferenceMeasurement, ...]
    chain: tuple[x509.Certificate, ...]  # the signing chain, leaf first, verified to a pinned root


def verify_rim(xml: bytes, pinned_roots: Collection[str], *, what: str, at_time: dt.datetime) -> Rim:
    """Parse `xml` safely, verify its enveloped signature and signing chain; return the RIM or raise."""
    root = parse_rim_xml(xml, what)
    signature = _only_signature(root, what)
    chain = rim_chain(root, what)
    try:
        leaf = verify_chain(chain, pinned_roots, what=what, at_time=at_time)
    except ChainError as error:
        raise RimChainError(str(error)) from None
    _check_leaf_usage(leaf, what)
    signed_info = _signed_info(signature, what)
    _check_digest(root, signed_info, what)
    _check_signature_value(signature, signed_info, leaf, what)
    return Rim(_tag_id(root, what), _version(root, what), _measurements(root, what), chain)


def parse_rim_xml(xml: bytes, what: str) -> etree._Element:
    """The document element of a RIM, parsed without DTDs, entities or network access."""
    if len(xml) > MAX_RIM_SIZE:
        raise RimFormatError(f"the {what} is larger than {MAX_RIM_SIZE} bytes")
    parser = etree.XMLParser(resolve_entities=False, no_network=True, huge_tree=False, load_dtd=False)
    try:
        root = etree.fromstring(xml, parser)
    except (etree.XMLSyntaxError, ValueError):
        raise RimFormatError(f"the {what} is not well-formed XML (truncated or corrupted)") from None
    if root.getroottree().docinfo.doctype:
        raise RimFormatError(f"the {what} declares a DOCTYPE; RIMs carry none and none is processed")
    if root.tag != f"{{{SWID}}}SoftwareIdentity":
        raise RimFormatError(f"the {what} is not a SWID tag (SoftwareIdentity)")
    if any(name.startswith(f"{{{XML_NS}}}") for element in root.iter() for name in element.attrib):
        raise RimFormatError(f"the {what} holds xml: attributes, whose C14N 1.1 canonical form is not supported")
    return root


def rim_chain(root: etree._Element, what: str) -> tuple[x509.Certificate, ...]:
    """The certificates in the RIM's KeyInfo/X509Data, in document order (leaf first)."""
    signature = _only_signature(root, what)
    elements = signature.findall(f"{{{DS}}}KeyInfo/{{{DS}}}X509Data/{{{DS}}}X509Certificate")
    if not 1 <= len(elements) <= MAX_CHAIN_LENGTH:
        raise RimChainError(f"the {what} must carry 1 to {MAX_CHAIN_LENGTH} signing certificates")
    message = f"the {what}'s signing chain holds a malformed certificate"
    return tuple(parse_certificate(_b64(element, what), RimChainError, message) for element in elements)


def _only_signature(root: etree._Element, what: str) -> etree._Element:
    signatures = list(root.iter(f"{{{DS}}}Signature"))
    if len(signatures) != 1 or signatures[0].getparent() is not root:
        raise RimFormatError(f"the {what} must hold exactly one enveloped signature, a child of its root")
    return signatures[0]


def _signed_info(signature: etree._Element, what: str) -> etree._Element:
    """SignedInfo, after checking it names exactly the algorithms this verifier implements."""
    signed_info = _one(signature, "SignedInfo", what)
    references = signed_info.findall(f"{{{DS}}}Reference")
    transforms = signed_info.findall(f"{{{DS}}}Reference/{{{DS}}}Transforms/{{{DS}}}Transform")
    expected = {
        "canonicalization": (_algorithm(signed_info, "CanonicalizationMethod", what), C14N_11),
        "signature method": (_algorithm(signed_info, "SignatureMethod", what), ECDSA_SHA384),
        "digest method": (_algorithm(signed_info, "Reference/{%s}DigestMethod" % DS, what), SHA384),
        "reference": ((len(references), references[0].get("URI") if references else None), (1, "")),
        "transforms": (tuple(t.get("Algorithm") for t in transforms), (ENVELOPED, C14N_11)),
    }
    for name, (found, wanted) in expected.items():
        if found != wanted:
            raise RimFormatError(f"the {what}'s signature uses an unsupported {name}; NVIDIA RIMs use {wanted}")
    return signed_info


def _check_digest(root: etree._Element, signed_info: etree._Element, what: str) -> None:
    document = copy.deepcopy(root.getroottree())
    _remove_keeping_tail(document.getroot().find(f"{{{DS}}}Signature"))
    digest = hashes.Hash(hashes.SHA384())
    digest.update(canonicalize(document, what))
    expected = _b64(_one(signed_info, f"Reference/{{{DS}}}DigestValue", what), what)
    if digest.finalize() != expected:
        raise RimSignatureError(f"the {what}'s content does not match its signed digest (the RIM was altered)")


def _check_signature_value(signature: etree._Element, signed_info: etree._Element, leaf: x509.Certificate, what: str) -> None:
    value = _b64(_one(signature, "SignatureValue", what), what)
    public_key = leaf.public_key()
    if len(value) != 96 or not isinstance(public_key, ec.EllipticCurvePublicKey):
        raise RimSignatureError(f"the {what}'s signature is not a 96-byte ECDSA P-384 value under an EC key")
    der = utils.encode_dss_signature(int.from_bytes(value[:48], "big"), int.from_bytes(value[48:], "big"))
    try:
        public_key.verify(der, canonicalize(signed_info, what), ec.ECDSA(hashes.SHA384()))
    except InvalidSignature:
        raise RimSignatureError(f"the {what}'s signature does not verify under its signing certificate") from None


def canonicalize(node: etree._Element | etree._ElementTree, what: str = "RIM") -> bytes:
    """Inclusive canonical XML without comments (equal to C14N 1.1 for RIMs without xml: attributes)."""
    try:
        return etree.tostring(node, method="c14n", exclusive=False, with_comments=False)
    except etree.C14NError:  # libxml2 refuses relative namespace URIs, which C14N does not define
        raise RimFormatError(f"the {what} declares a namespace that canonical XML cannot process") from None


def _remove_keeping_tail(element: etree._Element) -> None:
    # The enveloped-signature transform removes the Signature element only, not the text after it.
    parent, previous = element.getparent(), element.getprevious()
    if element.tail:
        if previous is not None:
            previous.tail = (previous.tail or "") + element.tail
        else:
            parent.text = (parent.text or "") + element.tail
    parent.remove(element)


def _check_leaf_usage(leaf: x509.Certificate, what: str) -> None:
    try:
        usage = leaf.extensions.get_extension_for_class(x509.KeyUsage).value
    except x509.ExtensionNotFound:
        return
    if not usage.digital_signature:
        raise RimChainError(f"the {what}'s signing certificate may not make digital signatures (key usage)")


def _tag_id(root: etree._Element, what: str) -> str:
    tag_id = root.get("tagId")
    if not tag_id:
        raise RimFormatError(f"the {what} has no tagId")
    return tag_id


def _version(root: etree._Element, what: str) -> str:
    version = _one(root, f"{{{SWID}}}Meta", what, namespace="").get("colloquialVersion")
    if not version:
        raise RimFormatError(f"the {what} names no firmware version (Meta colloquialVersion)")
    return version


def _measurements(root: etree._Element, what: str) -> tuple[ReferenceMeasurement, ...]:
    payload = _one(root, f"{{{SWID}}}Payload", what, namespace="")
    seen: set[int] = set()
    active = []
    for resource in payload.findall(f"{{{SWID}}}Resource"):
        if resource.get("type") != "Measurement":
            continue
        index = _integer(resource, "index", 0, _MAX_INDEX, what)
        if index in seen:
            raise RimFormatError(f"the {what} lists measurement index {index} twice")
        seen.add(index)
        flag = resource.get("active")
        if flag not in ("True", "False"):
            raise RimFormatError(f"the {what}'s measurement {index} is neither active nor inactive")
        if flag == "True":
            active.append(ReferenceMeasurement(index, _alternatives(resource, index, what)))
    return tuple(active)


def _alternatives(resource: etree._Element, index: int, what: str) -> tuple[bytes, ...]:
    count = _integer(resource, "alternatives", 1, _MAX_ALTERNATIVES, what)
    if _integer(resource, "size", DIGEST_SIZE, DIGEST_SIZE, what) != DIGEST_SIZE:
        raise RimFormatError(f"the {what}'s measurement {index} is not a SHA-384 digest")
    values = []
    for number in range(count):
        text = resource.get(f"{{{HASH_NS}}}Hash{number}")
        try:
            value = bytes.fromhex(text or "")
        except ValueError:
            value = b""
        if len(value) != DIGEST_SIZE:
            raise RimFormatError(f"the {what}'s measurement {index} lacks a valid alternative Hash{number}")
        values.append(value)
    return tuple(values)


def _integer(element: etree._Element, name: str, low: int, high: int, what: str) -> int:
    text = element.get(name) or ""
    if not text.isdigit() or not low <= int(text) <= high:
        raise RimFormatError(f"the {what} has a measurement whose {name} is not an integer from {low} to {high}")
    return int(text)


def _one(parent: etree._Element, path: str, what: str, *, namespace: str = DS) -> etree._Element:
    full = f"{{{namespace}}}{path}" if namespace else path
    found = parent.findall(full)
    if len(found) != 1:
        raise RimFormatError(f"the {what} must hold exactly one {path.rsplit('}', 1)[-1]}")
    return found[0]


def _algorithm(signed_info: etree._Element, path: str, what: str) -> str | None:
    return _one(signed_info, path, what).get("Algorithm")


def _b64(element: etree._Element, what: str) -> bytes:
    text = "".join((element.text or "").split())
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError):
        raise RimFormatError(f"the {what} holds a value that is not valid base64") from None
