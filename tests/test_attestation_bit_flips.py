"""One flipped bit in a certificate, CRL, OCSP response or RIM namespace declaration: when the verifier refuses
the evidence it is with its own error (an AttestationError subclass), never a library's exception, and the
message quotes no evidence bytes.

Every byte of each structure is flipped once, one bit per byte (bit `offset * 5 mod 8`, so every bit position
occurs), and the result goes through the verifier's own entry points:

- the genuine H100 device chains (2025 and 2023): `verify_with_report`;
- the signing certificates in the genuine RIMs' KeyInfo, and every namespace declaration of those RIMs: `verify_rim`;
- the genuine SEV-SNP VCEK, ASK and ARK, and the PCK chains of both genuine TDX quotes (PEM inside the quote):
  the CPU chain and report steps that the chain and signature checks run;
- CRLs and OCSP responses: the vectors carry none, so the sweep uses ones made here in the vendors' formats (an
  RSA-PSS ARK CRL, Intel's ECDSA PCK and root CRLs, each with a CRL number, an authority key identifier and a
  revoked entry with a reason; OCSP responses signed by the issuer and by a delegated responder whose certificate
  they carry), through `verify_with_report` and `verify_chain_status`.

The rest of a RIM's XML is not swept (20 KB a RIM, over a minute each here); its own tests edit each field.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime as dt
import re
from collections.abc import Callable

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID

from attestation.backends.sim_gpu import build_ocsp_response
from attestation.bundle import CpuEvidence
from attestation.certs import pem_chain_to_der
from attestation.cpu_evidence import verify_cpu_chain, verify_cpu_report
from attestation.errors import AttestationError
from attestation.ocsp import Freshness, verify_chain_status
from attestation.rim import verify_rim
from attestation.verifier import verify_with_report
from tests.conftest import vectors_path
from tests.cpu_tee_support import (
    DER,
    NOW,
    PSS,
    GENUINE_TDX_QUOTES,
    amd_hierarchy,
    cpu_policy,
    genuine_snp,
    genuine_tdx,
    intel_hierarchy,
    issue_certificate,
    snp_evidence,
    tdx_evidence,
)
from tests.policy_support import filled_strict
from tests.test_attestation_nvidia_vectors import hopper_bundle

# A flipped serial number may turn negative, which cryptography still parses but warns about.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Parsed a serial number:cryptography.utils.CryptographyDeprecationWarning")
STRICT = filled_strict()
RIM_TIME = dt.datetime(2024, 1, 1, tzinfo=dt.timezone.utc)  # inside the genuine RIM signing leaves' validity
Verify = Callable[[bytes], object]


def flip_bit(data: bytes, offset: int) -> bytes:
    return data[:offset] + bytes([data[offset] ^ (1 << (offset * 5 % 8))]) + data[offset + 1:]


def sweep(name: str, data: bytes, verify: Verify, offsets: range | None = None) -> None:
    """Flip one bit of each byte at `offsets` (all by default) and run `verify` on the result.

    Fails on any exception that is not an AttestationError, and on a refusal quoting a run of the evidence's hex.
    A flip may also be accepted: cryptography ignores the unused-bits count of a signature's BIT STRING, so a flip
    there leaves what is signed, and the signature, unchanged."""
    escaped, messages = [], set()
    for offset in offsets if offsets is not None else range(len(data)):
        try:
            verify(flip_bit(data, offset))
        except AttestationError as error:
            messages.add(str(error))
        except Exception as error:  # noqa: BLE001 - what escapes the verifier is what this test looks for
            escaped.append(f"byte {offset}: {type(error).__module__}.{type(error).__name__}")
    assert not escaped, f"{name}: {len(escaped)} flips raised a library exception: {escaped[:10]}"
    evidence = data.hex()
    quoted = [run for message in messages for run in re.findall(r"[0-9a-f]{16,}", message) if run in evidence]
    assert not quoted, f"{name}: a refusal quotes evidence bytes"


def _raise_failure(outcome) -> None:
    if outcome.error is not None:
        raise outcome.error


# ----- the genuine GPU device chains ----------------------------------------------------------------

def _gpu_evidence(folder: str, report: str, chain: str) -> tuple[bytes, tuple[bytes, ...]]:
    path = vectors_path() / folder
    return bytes.fromhex((path / report).read_text().strip()), pem_chain_to_der((path / chain).read_bytes())


def test_a_bit_flip_anywhere_in_a_genuine_gpu_certificate_raises_only_verifier_errors():
    swept: set[bytes] = set()
    for report, chain in (_gpu_evidence("nvidia-h100", "attestation-report.hex", "cert-chain.pem"),
                          _gpu_evidence("nvidia-h100-rim", "attestation-report-2023.hex", "cert-chain-2023.pem")):
        bundle = hopper_bundle(STRICT, report, chain)
        genuine = verify_with_report(bundle, STRICT)
        assert [check.passed for check in genuine.checks[:3]] == [True, True, True]  # simulated, chain, signature
        for index, certificate in enumerate(chain):
            if certificate in swept:
                continue
            swept.add(certificate)

            def verify(der: bytes, bundle=bundle, chain=chain, index=index) -> None:
                gpu = dataclasses.replace(bundle.gpu, cert_chain=chain[:index] + (der,) + chain[index + 1:])
                _raise_failure(verify_with_report(dataclasses.replace(bundle, gpu=gpu), STRICT))

            sweep(f"H100 device certificate {index}", certificate, verify)
    assert len(swept) >= 6  # the two GPUs' leaves and BROM certificates, and the CAs above them


# ----- the genuine RIMs: signing certificates and namespace declarations ------------------------------

RIM_FILES = ("driver-rim-545.00.swidtag", "vbios-rim-96.00.5E.00.01.swidtag")
_KEY_INFO = re.compile(rb"<ds:X509Certificate>(.*?)</ds:X509Certificate>", re.DOTALL)
_PEM = re.compile(rb"-----BEGIN CERTIFICATE-----(.*?)-----END CERTIFICATE-----", re.DOTALL)


def _der_spans(text: bytes, pattern: re.Pattern[bytes]) -> list[tuple[int, int, bytes]]:
    """(start, end, DER) of each base64 certificate `pattern` finds in `text`."""
    return [(m.start(1), m.end(1), base64.b64decode(b"".join(m.group(1).split()))) for m in pattern.finditer(text)]


def _replace_der(text: bytes, start: int, end: int, der: bytes) -> bytes:
    """`text` with the base64 at start:end re-encoded from `der` (same length), keeping its line breaks."""
    old = text[start:end]
    encoded = bytearray(base64.b64encode(der))
    for position, character in enumerate(old):
        if character in b" \t\r\n":
            encoded.insert(position, character)
    return text[:start] + bytes(encoded) + text[end:]


def _rim(name: str) -> bytes:
    return (vectors_path() / "nvidia-h100-rim" / name).read_bytes()


def _verify_rim(xml: bytes) -> None:
    verify_rim(xml, set(STRICT.attestation.pinned_rim_roots), what="RIM", at_time=RIM_TIME)


def test_a_bit_flip_anywhere_in_a_genuine_rim_signing_certificate_raises_only_verifier_errors():
    swept: set[bytes] = set()
    for name in RIM_FILES:
        xml = _rim(name)
        _verify_rim(xml)
        for number, (start, end, der) in enumerate(_der_spans(xml, _KEY_INFO)):
            if der in swept:
                continue
            swept.add(der)
            verify = lambda flipped, xml=xml, start=start, end=end: _verify_rim(_replace_der(xml, start, end, flipped))
            sweep(f"{name} KeyInfo certificate {number}", der, verify)
    assert len(swept) >= 4


def test_a_bit_flip_anywhere_in_a_genuine_rim_namespace_declaration_raises_only_verifier_errors():
    for name in RIM_FILES:
        xml = _rim(name)
        declarations = list(re.finditer(rb'xmlns(:\w+)?="[^"]*"', xml))
        assert len(declarations) == 6
        for declaration in declarations:
            where = range(declaration.start(), declaration.end())
            sweep(f"{name} {declaration.group()[:12]!r}", xml, _verify_rim, where)


# ----- the genuine CPU TEE chains ---------------------------------------------------------------------

def _verify_cpu(kind: str, report: bytes, chain: tuple[bytes, ...]) -> None:
    cpu = CpuEvidence(kind, report, chain)
    verify_cpu_report(cpu, verify_cpu_chain(cpu, STRICT.attestation.pinned_roots, NOW))


def test_a_bit_flip_anywhere_in_the_genuine_vcek_ask_and_ark_raises_only_verifier_errors():
    report, chain = genuine_snp()
    _verify_cpu("sev-snp", report, chain)
    for index, (what, certificate) in enumerate(zip(("VCEK", "ASK", "ARK"), chain)):
        verify = lambda der, index=index: _verify_cpu("sev-snp", report, chain[:index] + (der,) + chain[index + 1:])
        sweep(f"SEV-SNP {what}", certificate, verify)


def test_a_bit_flip_anywhere_in_a_genuine_tdx_quotes_pck_chain_raises_only_verifier_errors():
    swept: set[bytes] = set()
    for name in GENUINE_TDX_QUOTES:
        quote = genuine_tdx(name)
        _verify_cpu("tdx", quote, ())
        for number, (start, end, der) in enumerate(_der_spans(quote, _PEM)):
            if der in swept:
                continue
            swept.add(der)
            verify = lambda flipped, quote=quote, start=start, end=end: _verify_cpu(
                "tdx", _replace_der(quote, start, end, flipped), ())
            sweep(f"{name} PCK chain certificate {number}", der, verify)
    assert len(swept) >= 4  # two leaves, their CA(s) and the root


# ----- CRLs and OCSP responses (made here: the vectors carry none) --------------------------------------

def _crl(issuer: x509.Certificate, key) -> bytes:
    """A CRL as AMD KDS and Intel PCS publish them: CRL number, authority key id, a revoked entry with a reason."""
    entry = (
        x509.RevokedCertificateBuilder().serial_number(0x5EED).revocation_date(NOW - dt.timedelta(days=2))
        .add_extension(x509.CRLReason(x509.ReasonFlags.key_compromise), critical=False).build()
    )
    builder = (
        x509.CertificateRevocationListBuilder().issuer_name(issuer.subject)
        .last_update(NOW - dt.timedelta(hours=1)).next_update(NOW + dt.timedelta(days=7))
        .add_extension(x509.CRLNumber(7), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer.public_key()), critical=False)
        .add_revoked_certificate(entry)
    )
    if isinstance(key, rsa.RSAPrivateKey):
        return builder.sign(key, hashes.SHA384(), rsa_padding=PSS).public_bytes(DER)
    return builder.sign(key, hashes.SHA256()).public_bytes(DER)


def _verify_with_crls(bundle, policy, crls: tuple[bytes, ...]) -> None:
    cpu = dataclasses.replace(bundle.cpu, crls=crls)
    _raise_failure(verify_with_report(dataclasses.replace(bundle, cpu=cpu), policy))


def test_a_bit_flip_anywhere_in_an_amd_or_intel_crl_raises_only_verifier_errors():
    policy = cpu_policy()
    amd, intel = amd_hierarchy(), intel_hierarchy()
    cases = [
        ("AMD ARK CRL", snp_evidence(policy), [_crl(amd.ark, amd.ark_key)]),
        ("Intel CRLs", tdx_evidence(policy),
         [_crl(intel.platform, intel.platform_key), _crl(intel.root, intel.root_key)]),
    ]
    for name, bundle, crls in cases:
        _verify_with_crls(bundle, policy, tuple(crls))  # the unflipped CRLs pass every check
        for index, crl in enumerate(crls):
            verify = lambda der, bundle=bundle, crls=crls, index=index: _verify_with_crls(
                bundle, policy, tuple(crls[:index] + [der] + crls[index + 1:]))
            sweep(f"{name} {index}", crl, verify)


def test_a_bit_flip_anywhere_in_an_ocsp_response_raises_only_verifier_errors():
    keys = [ec.generate_private_key(ec.SECP384R1()) for _ in range(4)]
    root = issue_certificate("OCSP Test Root", keys[0].public_key(), "OCSP Test Root", keys[0], ca=True, serial=1)
    middle = issue_certificate("OCSP Test CA", keys[1].public_key(), "OCSP Test Root", keys[0], ca=True, serial=2)
    leaf = issue_certificate("OCSP Test Leaf", keys[2].public_key(), "OCSP Test CA", keys[1], ca=False, serial=3)
    responder = issue_certificate("OCSP Test Responder", keys[3].public_key(), "OCSP Test CA", keys[1], ca=False,
                                  serial=4, extensions=(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.OCSP_SIGNING]),))
    nonce = bytes(range(32))
    freshness = Freshness(now=NOW, max_age_s=3600, max_skew_s=30, nonce=nonce)
    issued = NOW - dt.timedelta(minutes=5)
    direct = build_ocsp_response(leaf, middle, keys[1], this_update=issued, nonce=nonce)
    delegated = build_ocsp_response(leaf, middle, keys[3], this_update=issued, nonce=nonce, signer=responder)
    for_middle = build_ocsp_response(middle, root, keys[0], this_update=issued, nonce=nonce)
    chain = (leaf, middle, root)

    def verify(first: bytes) -> None:
        verify_chain_status(chain, [first, for_middle], first=0, what="test chain", freshness=freshness)

    for name, response in (("issuer-signed OCSP response", direct), ("delegated OCSP response", delegated)):
        verify(response)  # the unflipped response passes
        sweep(name, response, verify)
