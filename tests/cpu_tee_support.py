"""CPU TEE evidence for tests: the genuine vectors, and synthetic AMD and Intel hierarchies that sign
reports and CRLs with the same formats, so that every field and every CRL case can be exercised through
the verifier (genuine reports cannot be re-signed, and no genuine CRLs are published with them)."""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import json
import re
import struct
import time
from dataclasses import dataclass, field

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa, utils
from cryptography.x509.oid import NameOID

from attestation.backends.base import bind
from attestation.bundle import CpuEvidence, EvidenceBundle, TdxCollateral
from attestation.certs import fingerprint
from attestation.measurement import Measurement
from attestation.tdx import INTEL_QE_MRSIGNER, INTEL_QE_VENDOR_ID
from attestation.verifier import verify_with_report
from policy import parse_policy
from tests.conftest import vectors_path
from tests.policy_support import filled_strict_text
from tests.test_attestation_support import NONCE, RECEIPT_KEY, key_config

DER = serialization.Encoding.DER
NOW = dt.datetime.now(dt.timezone.utc)
CODE_DIGEST = "c0de" * 16
MODEL_DIGEST = "ab0e0a8e2b3a3b1e2cc3d7a0b5bd5b04bd0f1cc07e8c2d5fa45e5ab2b3f3f4a1"
SNP_MEASUREMENT = bytes(range(48))
TDX_MRTD = bytes(range(100, 148))
TDX_RTMRS = tuple(bytes([index + 1]) * 48 for index in range(4))
PSS = padding.PSS(padding.MGF1(hashes.SHA384()), 48)
# The synthetic chip's own TCB as a policy minimum: older than `strict`'s floor (AMD-SB-3019), so every test
# that verifies synthetic or genuine SEV-SNP evidence names the old minimum it accepts, explicitly.
SYNTHETIC_SNP_MINIMUM = '{ product = "Milan", boot_loader = 3, tee = 0, snp = 8, microcode = 115 }'


# ----- the genuine vectors ----------------------------------------------------------------------

def genuine_snp() -> tuple[bytes, tuple[bytes, bytes, bytes]]:
    """The genuine Milan report and its VCEK, ASK and ARK (DER)."""
    folder = vectors_path() / "amd-sev-snp"
    ask, ark = x509.load_pem_x509_certificates((folder / "ask-ark-milan.pem").read_bytes())
    chain = ((folder / "vcek-milan.der").read_bytes(), ask.public_bytes(DER), ark.public_bytes(DER))
    return (folder / "report.bin").read_bytes(), chain


def genuine_tdx(name: str) -> bytes:
    return (vectors_path() / "intel-tdx" / name).read_bytes()


GENUINE_TDX_QUOTES = ("quote-spr-e4.bin", "quote-gcp-cos113.bin")


# ----- synthetic certificate hierarchies ------------------------------------------------------------

def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def issue_certificate(
    subject: str, public_key, issuer: str, issuer_key, *, ca: bool, serial: int,
    extensions: tuple[x509.ExtensionType, ...] = (), days: int = 3650,
) -> x509.Certificate:
    builder = (
        x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(_name(issuer))
        .public_key(public_key).serial_number(serial)
        .not_valid_before(NOW - dt.timedelta(days=1)).not_valid_after(NOW + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    for extension in extensions:
        builder = builder.add_extension(extension, critical=False)
    if isinstance(issuer_key, rsa.RSAPrivateKey):
        return builder.sign(issuer_key, hashes.SHA384(), rsa_padding=PSS)
    return builder.sign(issuer_key, hashes.SHA256())


def make_crl(
    issuer: x509.Certificate, issuer_key, *, revoked: tuple[int, ...] = (),
    this_update: dt.datetime | None = None, next_update: dt.datetime | None = None,
) -> bytes:
    """A DER CRL by `issuer`, valid from an hour ago for a week unless told otherwise."""
    builder = (
        x509.CertificateRevocationListBuilder().issuer_name(issuer.subject)
        .last_update(this_update or NOW - dt.timedelta(hours=1))
        .next_update(next_update or NOW + dt.timedelta(days=7))
    )
    for serial in revoked:
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(NOW - dt.timedelta(hours=2)).build()
        )
    if isinstance(issuer_key, rsa.RSAPrivateKey):
        return builder.sign(issuer_key, hashes.SHA384(), rsa_padding=PSS).public_bytes(DER)
    return builder.sign(issuer_key, hashes.SHA256()).public_bytes(DER)


def _amd_extension(suffix: str, value: bytes) -> x509.UnrecognizedExtension:
    return x509.UnrecognizedExtension(x509.ObjectIdentifier("1.3.6.1.4.1.3704.1." + suffix), value)


@dataclass(frozen=True)
class AmdHierarchy:
    """ARK → ASK → VCEK of one synthetic chip of one product line (Milan unless told)."""

    ark_key: rsa.RSAPrivateKey
    ark: x509.Certificate
    ask_key: rsa.RSAPrivateKey
    ask: x509.Certificate
    vcek_key: ec.EllipticCurvePrivateKey
    vcek: x509.Certificate
    chip_id: bytes
    tcb: bytes  # REPORTED_TCB bytes the VCEK certifies
    product: str

    @property
    def chain(self) -> tuple[bytes, bytes, bytes]:
        return tuple(cert.public_bytes(DER) for cert in (self.vcek, self.ask, self.ark))  # type: ignore[return-value]

    def crls(self, **options) -> tuple[bytes, ...]:
        return (make_crl(self.ark, self.ark_key, **options),)


# A VCEK's extensions per product line (AMD 57230, Tables 11-13), written out here rather than read from
# attestation.sev_snp: structVersion, the TCB_VERSION byte each SPL extension certifies, the hwID's size.
_FAMILY_19H_VCEK = (0, {"3.1": 0, "3.2": 1, "3.3": 6, "3.8": 7}, 64)  # Milan, Genoa
_TURIN_VCEK = (1, {"3.9": 0, "3.1": 1, "3.2": 2, "3.3": 3, "3.8": 7}, 8)  # FMC first; hwID the silicon id


def vcek_extensions(product: str, tcb: bytes, chip_id: bytes,
                    struct_version: int | None = None) -> tuple[x509.ExtensionType, ...]:
    """A VCEK's AMD extensions for `product` ("Milan-B0", "Turin-B0"), laid out as that product line's are."""
    version, spl_bytes, hwid_size = _TURIN_VCEK if product.startswith("Turin") else _FAMILY_19H_VCEK
    return (
        _amd_extension("1", bytes([2, 1, version if struct_version is None else struct_version])),
        _amd_extension("2", b"\x16" + bytes([len(product)]) + product.encode()),
        *(_amd_extension(oid, bytes([2, 1, tcb[offset]])) for oid, offset in spl_bytes.items()),
        _amd_extension("4", chip_id[:hwid_size]),
    )


# The synthetic chip per product line: its REPORTED_TCB (boot loader 3, TEE 0, SNP 8, microcode 115; Turin's
# FMC 1, in Turin's byte order) and its CHIP_ID (a Turin CHIP_ID is its 8-byte silicon id, then zeros).
_SYNTHETIC_TCBS = {"Turin": bytes([1, 3, 0, 8, 0, 0, 0, 115])}
_SYNTHETIC_CHIP_ID = hashlib.sha512(b"veil test chip").digest()
# The synthetic chip's CPUID_FAM_ID, CPUID_MOD_ID and CPUID_STEP, in a report of version 3 or later: each
# line's first model, as its CPUID(1).EAX names it (go-sev-guest kds.ProductLineCpuid, stepping 0:
# 0x00A00F10 Milan, 0x00A10F10 Genoa, 0x00B00F20 Turin), here stepping 1. A Turin report is version 3 or
# later; Milan's and Genoa's may be version 2, which their firmware wrote before ABI 1.55.
SYNTHETIC_CPUIDS = {"Milan": (0x19, 0x01, 1), "Genoa": (0x19, 0x11, 1), "Turin": (0x1A, 0x02, 1)}
_LOWEST_REPORT_VERSIONS = {"Turin": 3}


def synthetic_chip(product: str) -> tuple[bytes, bytes]:
    """(CHIP_ID, REPORTED_TCB) of the synthetic chip of `product`."""
    chip_id = _SYNTHETIC_CHIP_ID[:8] + bytes(56) if product == "Turin" else _SYNTHETIC_CHIP_ID
    return chip_id, _SYNTHETIC_TCBS.get(product, bytes([3, 0, 0, 0, 0, 0, 8, 115]))


def amd_hierarchy(product: str = "Milan") -> AmdHierarchy:
    """The synthetic hierarchy of `product`, one per product for the whole run."""
    return _amd_hierarchy(product)  # one cache key per product, however the caller spells the default


@functools.cache
def _amd_hierarchy(product: str) -> AmdHierarchy:
    ark_key = rsa.generate_private_key(65537, 2048)
    ark = issue_certificate(f"ARK-{product}", ark_key.public_key(), f"ARK-{product}", ark_key, ca=True, serial=1)
    ask_key = rsa.generate_private_key(65537, 2048)
    ask = issue_certificate(f"SEV-{product}", ask_key.public_key(), f"ARK-{product}", ark_key, ca=True, serial=2)
    vcek_key = ec.generate_private_key(ec.SECP384R1())
    chip_id, tcb = synthetic_chip(product)
    vcek = issue_certificate("SEV-VCEK", vcek_key.public_key(), f"SEV-{product}", ask_key, ca=False, serial=3,
                             extensions=vcek_extensions(f"{product}-B0", tcb, chip_id))
    return AmdHierarchy(ark_key, ark, ask_key, ask, vcek_key, vcek, chip_id, tcb, product)


@dataclass
class SnpFields:
    """What a synthetic SEV-SNP report says; defaults are a well-behaved production guest."""

    report_data: bytes = bytes(64)
    version: int | None = None  # None: the oldest the product's firmware writes (Turin 3, Milan and Genoa 2)
    cpuid: tuple[int, int, int] | None = None  # written from version 3 on; None: the synthetic chip's
    policy: int = (1 << 17) | (1 << 16)  # reserved bit 17 set, SMT allowed; no debug, no migration agent
    vmpl: int = 0
    measurement: bytes = SNP_MEASUREMENT
    host_data: bytes = bytes(32)
    id_key_digest: bytes = bytes(48)
    author_key_digest: bytes = bytes(48)
    reported_tcb: bytes | None = None  # None: the TCB the VCEK certifies
    chip_id: bytes | None = None  # None: the VCEK's hwID
    key_info: int = 0
    raw: dict[int, bytes] = field(default_factory=dict)  # offset -> bytes written last, before signing


def snp_report(hierarchy: AmdHierarchy, fields: SnpFields) -> bytes:
    """A report with `fields`, signed by the hierarchy's VCEK as the firmware signs it."""
    report = bytearray(0x4A0)
    version = _LOWEST_REPORT_VERSIONS.get(hierarchy.product, 2) if fields.version is None else fields.version
    struct.pack_into("<IIQ", report, 0, version, 0, fields.policy)
    struct.pack_into("<II", report, 0x30, fields.vmpl, 1)
    struct.pack_into("<I", report, 0x48, fields.key_info)
    report[0x50:0x90] = fields.report_data
    report[0x90:0xC0] = fields.measurement
    report[0xC0:0xE0] = fields.host_data
    report[0xE0:0x110] = fields.id_key_digest
    report[0x110:0x140] = fields.author_key_digest
    report[0x180:0x188] = hierarchy.tcb if fields.reported_tcb is None else fields.reported_tcb
    if version >= 3:
        report[0x188:0x18B] = bytes(fields.cpuid or SYNTHETIC_CPUIDS.get(hierarchy.product, (0, 0, 0)))
    report[0x1A0:0x1E0] = hierarchy.chip_id if fields.chip_id is None else fields.chip_id
    for offset, value in fields.raw.items():
        report[offset:offset + len(value)] = value
    r, s = utils.decode_dss_signature(hierarchy.vcek_key.sign(bytes(report[:0x2A0]), ec.ECDSA(hashes.SHA384())))
    report[0x2A0:0x2E8] = r.to_bytes(72, "little")
    report[0x2E8:0x330] = s.to_bytes(72, "little")
    return bytes(report)


# The synthetic platform is the genuine SPR quote's model and TCB: FMSPC, SGX component SVNs and PCESVN.
TDX_FMSPC = bytes.fromhex("50806f000000")
TDX_CPU_SVNS = (3, 3, 2, 2, 2, 1, 0, 2) + (0,) * 8
TDX_PCE_SVN = 11
TDX_TEE_TCB_SVN = bytes([3, 0, 5]) + bytes(13)
QE_ISVSVN = 4


def _der(tag: int, value: bytes) -> bytes:
    length = bytes([len(value)]) if len(value) < 0x80 else bytes([0x82]) + len(value).to_bytes(2, "big")
    return bytes([tag]) + length + value


def _sgx_pair(suffix: str, tag: int, value: bytes) -> bytes:
    """SEQUENCE(OID 1.2.840.113741.1.13.1.<suffix>, value); every suffix part is below 128 (one byte)."""
    oid = bytes.fromhex("2a864886f84d010d01") + bytes(int(part) for part in suffix.split("."))
    return _der(0x30, _der(0x06, oid) + _der(tag, value))


def sgx_extension(fmspc: bytes = TDX_FMSPC, cpu_svns: tuple[int, ...] = TDX_CPU_SVNS,
                  pce_svn: int = TDX_PCE_SVN) -> x509.UnrecognizedExtension:
    """Intel's SGX extension of a PCK certificate (PCK Certificate and CRL Profile), the fields Veil reads."""
    tcb = b"".join(_sgx_pair(f"2.{index + 1}", 0x02, bytes([svn])) for index, svn in enumerate(cpu_svns))
    tcb += _sgx_pair("2.17", 0x02, bytes([pce_svn])) + _sgx_pair("2.18", 0x04, bytes(cpu_svns))
    pairs = _sgx_pair("1", 0x04, bytes(16)) + _sgx_pair("2", 0x30, tcb) + _sgx_pair("3", 0x04, bytes(2))
    pairs += _sgx_pair("4", 0x04, fmspc)
    return x509.UnrecognizedExtension(x509.ObjectIdentifier("1.2.840.113741.1.13.1"), _der(0x30, pairs))


@dataclass(frozen=True)
class IntelHierarchy:
    """Intel SGX Root CA → PCK Platform CA → PCK of one synthetic platform, and the root's TCB Signing
    certificate, which signs synthetic TCB Info and QE Identity."""

    root_key: ec.EllipticCurvePrivateKey
    root: x509.Certificate
    platform_key: ec.EllipticCurvePrivateKey
    platform: x509.Certificate
    pck_key: ec.EllipticCurvePrivateKey
    pck: x509.Certificate
    signing_key: ec.EllipticCurvePrivateKey
    signing: x509.Certificate

    def pem_chain(self) -> bytes:
        return b"".join(cert.public_bytes(serialization.Encoding.PEM) for cert in (self.pck, self.platform, self.root))

    def crls(self, *, pck: dict | None = None, root: dict | None = None) -> tuple[bytes, bytes]:
        return (make_crl(self.platform, self.platform_key, **(pck or {})), make_crl(self.root, self.root_key, **(root or {})))


@functools.cache
def intel_hierarchy() -> IntelHierarchy:
    root_key = ec.generate_private_key(ec.SECP256R1())
    root = issue_certificate("Intel SGX Root CA", root_key.public_key(), "Intel SGX Root CA", root_key, ca=True, serial=10)
    platform_key = ec.generate_private_key(ec.SECP256R1())
    platform = issue_certificate("Intel SGX PCK Platform CA", platform_key.public_key(), "Intel SGX Root CA", root_key,
                                 ca=True, serial=11)
    pck_key = ec.generate_private_key(ec.SECP256R1())
    pck = issue_certificate("Intel SGX PCK Certificate", pck_key.public_key(), "Intel SGX PCK Platform CA",
                            platform_key, ca=False, serial=12, extensions=(sgx_extension(),))
    signing_key = ec.generate_private_key(ec.SECP256R1())
    signing = issue_certificate("Intel SGX TCB Signing", signing_key.public_key(), "Intel SGX Root CA", root_key,
                                ca=False, serial=13)
    return IntelHierarchy(root_key, root, platform_key, platform, pck_key, pck, signing_key, signing)


@dataclass
class TdxFields:
    """What a synthetic TDX quote says; defaults are a well-behaved production TD."""

    report_data: bytes = bytes(64)
    version: int = 4
    td_attributes: int = 1 << 28  # SEPT_VE_DISABLE, no debug
    seam_attributes: int = 0  # a production TDX module
    mrsigner_seam: bytes = bytes(48)  # Intel's TDX module
    xfam: int = 0x0006_00E7  # x87, SSE, AVX, AVX-512 and AMX state, as in the genuine GCP quote
    mrtd: bytes = TDX_MRTD
    rtmrs: tuple[bytes, ...] = TDX_RTMRS
    qe_mrsigner: bytes = INTEL_QE_MRSIGNER
    qe_auth_data: bytes = bytes(range(32))
    tee_tcb_svn: bytes = TDX_TEE_TCB_SVN
    mrseam: bytes = bytes(range(48))
    mr_config_id: bytes = bytes(48)
    mr_owner: bytes = bytes(48)
    mr_owner_config: bytes = bytes(48)
    qe_isvsvn: int = QE_ISVSVN
    certify_other_key: bool = False  # the QE report binds a key other than the one that signs
    pem_chain: bytes | None = None  # None: the hierarchy's chain
    attestation_key: ec.EllipticCurvePrivateKey = field(default_factory=lambda: ec.generate_private_key(ec.SECP256R1()))


def _raw_p256(key: ec.EllipticCurvePrivateKey, data: bytes) -> bytes:
    r, s = utils.decode_dss_signature(key.sign(data, ec.ECDSA(hashes.SHA256())))
    return r.to_bytes(32, "big") + s.to_bytes(32, "big")


def tdx_quote(hierarchy: IntelHierarchy, fields: TdxFields) -> bytes:
    """A version-4-layout quote with `fields`, signed as Intel's QE and PCE sign it."""
    header = struct.pack("<HHIHH", fields.version, 2, 0x81, 0, 0) + INTEL_QE_VENDOR_ID + bytes(20)
    body = bytearray(584)
    body[0:16] = fields.tee_tcb_svn
    body[0x040 - 0x30:0x070 - 0x30] = fields.mrseam
    for offset, value in ((0x0E8, fields.mr_config_id), (0x118, fields.mr_owner), (0x148, fields.mr_owner_config)):
        body[offset - 0x30:offset - 0x30 + 48] = value
    struct.pack_into("<QQQ", body, 0x0A0 - 0x30, fields.seam_attributes, fields.td_attributes, fields.xfam)
    body[0x070 - 0x30:0x0A0 - 0x30] = fields.mrsigner_seam
    body[0x0B8 - 0x30:0x0E8 - 0x30] = fields.mrtd
    for index, rtmr in enumerate(fields.rtmrs):
        start = 0x178 + 48 * index - 0x30
        body[start:start + 48] = rtmr
    body[0x238 - 0x30:] = fields.report_data
    signed = header + bytes(body)
    point = fields.attestation_key.public_key().public_bytes(serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint)[1:]
    bound_key = bytes(64) if fields.certify_other_key else point
    qe_report = bytearray(384)
    qe_report[48:64] = bytes.fromhex("1500000000000000e700000000000000")  # the genuine QEs' ATTRIBUTES
    qe_report[128:160] = fields.qe_mrsigner
    struct.pack_into("<HH", qe_report, 256, 2, fields.qe_isvsvn)  # ISVPRODID 2: Intel's TD QE
    qe_report[320:352] = hashlib.sha256(bound_key + fields.qe_auth_data).digest()
    chain = hierarchy.pem_chain() if fields.pem_chain is None else fields.pem_chain
    inner = struct.pack("<HI", 5, len(chain)) + chain
    qe_data = (bytes(qe_report) + _raw_p256(hierarchy.pck_key, bytes(qe_report))
               + struct.pack("<H", len(fields.qe_auth_data)) + fields.qe_auth_data + inner)
    signature_data = _raw_p256(fields.attestation_key, signed) + point + struct.pack("<HI", 6, len(qe_data)) + qe_data
    return signed + struct.pack("<I", len(signature_data)) + signature_data


# ----- Intel collateral (TCB Info v3, TD_QE Identity v2) -----------------------------------------

def pcs_time(moment: dt.datetime) -> str:
    """`moment` as Intel PCS writes issueDate and nextUpdate."""
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def _components(svns) -> list[dict]:
    return [{"svn": svn} for svn in svns]


def tcb_level(status: str = "UpToDate", *, sgx=TDX_CPU_SVNS, pce: int = TDX_PCE_SVN, tdx=tuple(TDX_TEE_TCB_SVN),
              advisories: tuple[str, ...] = ()) -> dict:
    level = {"tcb": {"sgxtcbcomponents": _components(sgx), "pcesvn": pce, "tdxtcbcomponents": _components(tdx)},
             "tcbDate": "2024-11-13T00:00:00Z", "tcbStatus": status}
    if advisories:
        level["advisoryIDs"] = list(advisories)
    return level


def tcb_info_document(levels: list[dict] | None = None, **overrides) -> dict:
    """A TDX TCB Info v3 for the synthetic platform, issued an hour ago, rating it UpToDate unless told."""
    document = {
        "id": "TDX", "version": 3, "issueDate": pcs_time(NOW - dt.timedelta(hours=1)),
        "nextUpdate": pcs_time(NOW + dt.timedelta(days=29)), "fmspc": TDX_FMSPC.hex(), "pceId": "0000", "tcbType": 0,
        "tcbEvaluationDataNumber": 18,
        "tdxModule": {"mrsigner": "00" * 48, "attributes": "0000000000000000", "attributesMask": "FFFFFFFFFFFFFFFF"},
        "tcbLevels": levels if levels is not None else [tcb_level()],
    }
    return {**document, **overrides}


def qe_identity_document(**overrides) -> dict:
    """A TD_QE Identity v2 as Intel publishes it (MRSIGNER, ISVPRODID, masks), issued an hour ago."""
    document = {
        "id": "TD_QE", "version": 2, "issueDate": pcs_time(NOW - dt.timedelta(hours=1)),
        "nextUpdate": pcs_time(NOW + dt.timedelta(days=29)), "tcbEvaluationDataNumber": 18, "miscselect": "00000000",
        "miscselectMask": "FFFFFFFF", "attributes": "11000000000000000000000000000000",
        "attributesMask": "FBFFFFFFFFFFFFFF0000000000000000", "mrsigner": INTEL_QE_MRSIGNER.hex().upper(),
        "isvprodid": 2, "tcbLevels": [{"tcb": {"isvsvn": QE_ISVSVN}, "tcbDate": "2024-11-13T00:00:00Z",
                                       "tcbStatus": "UpToDate"}],
    }
    return {**document, **overrides}


def signed_collateral(outer: str, document: dict, key: ec.EllipticCurvePrivateKey | None = None) -> bytes:
    """Intel PCS's response body: the inner object's exact bytes, signed (raw r ‖ s hex) by the TCB Signing key."""
    inner = json.dumps(document, separators=(",", ":")).encode()
    signature = _raw_p256(key or intel_hierarchy().signing_key, inner)
    return b'{"' + outer.encode() + b'":' + inner + b',"signature":"' + signature.hex().encode() + b'"}'


def tdx_collateral(tcb_info: dict | None = None, qe_identity: dict | None = None,
                   issuer_chain: tuple[bytes, ...] | None = None) -> TdxCollateral:
    """Synthetic collateral for the synthetic platform, signed under the test hierarchy's TCB Signing key."""
    hierarchy = intel_hierarchy()
    return TdxCollateral(
        signed_collateral("tcbInfo", tcb_info or tcb_info_document()),
        signed_collateral("enclaveIdentity", qe_identity or qe_identity_document()),
        issuer_chain if issuer_chain is not None else (hierarchy.signing.public_bytes(DER), hierarchy.root.public_bytes(DER)),
    )


# ----- policies and bundles ---------------------------------------------------------------------

def cpu_policy(**options):
    """`cpu_policy_text(**options)`, loaded."""
    return parse_policy(cpu_policy_text(**options))


def cpu_policy_text(*, roots: tuple[str, ...] = (), launch: str = "", extra: str = "", max_crl_age_s: int = 86_400,
                    max_root_crl_age_s: int = 86_400, modes: str = '["cpu"]', snp_min_tcb: str = SYNTHETIC_SNP_MINIMUM,
                    snp_pins: dict[str, str] | None = None, tdx_settings: dict[str, str] | None = None) -> str:
    """`strict` (filled in: tests/policy_support.py) for CPU-only evidence: the synthetic roots pinned, the test code and model digests listed with
    the synthetic images' launch measurements (or `launch`, TOML inline tables), the SEV-SNP minimum TCB
    `snp_min_tcb` (TOML inline tables, in place of strict's) and `snp_pins` (policy key -> hex values);
    `tdx_settings` sets `tdx_*` keys (policy key -> TOML value)."""
    pins = roots or (fingerprint(amd_hierarchy().ark), fingerprint(intel_hierarchy().root))
    launch = launch or (
        f'{{ tee = "sev-snp", code = "{CODE_DIGEST}", measurement = "{SNP_MEASUREMENT.hex()}" }}, '
        f'{{ tee = "tdx", code = "{CODE_DIGEST}", mrtd = "{TDX_MRTD.hex()}", rtmr0 = "{TDX_RTMRS[0].hex()}" }}'
    )
    text = filled_strict_text()
    replacements = {
        'required_confidential_mode = ["cpu", "gpu"]': f"required_confidential_mode = {modes}",
        "allowed_code_digests = []": f'allowed_code_digests = ["{CODE_DIGEST}"{extra}]',
        "allowed_model_digests = []": f'allowed_model_digests = ["{MODEL_DIGEST}"]',
        "launch_measurements = []": f"launch_measurements = [{launch}]",
        "max_crl_age_s = 2592000": f"max_crl_age_s = {max_crl_age_s}",
        "max_root_crl_age_s = 34560000": f"max_root_crl_age_s = {max_root_crl_age_s}",
        **{f"{key} = []": f"{key} = [\"{value}\"]" for key, value in (snp_pins or {}).items()},
    }
    for old, new in replacements.items():
        assert old in text, old
        text = text.replace(old, new)
    for key, value in (tdx_settings or {}).items():
        text, count = re.subn(f"(?m)^{key} = .*$", f"{key} = {value}", text)
        assert count == 1, key
    text = _replace_list(text, "sev_snp_min_tcb", snp_min_tcb)
    return _replace_list(text, "pinned_roots", ", ".join(f'"{pin}"' for pin in pins))


def _replace_list(text: str, key: str, items: str) -> str:
    """`text` with the list `key` (on one line, or over several closed by a "]" line) set to `items`."""
    start = text.index(f"{key} = [")
    closing = "\n]" if text[start:].startswith(f"{key} = [\n") else "]"
    end = text.index(closing, start) + len(closing)
    return text[:start] + f"{key} = [{items}]" + text[end:]


@dataclass(frozen=True)
class Binding:
    """What a node binds: its key configuration, measurement, nonce and time, and the resulting report_data."""

    key_config: bytes
    measurement: Measurement
    timestamp: int
    report_data: bytes
    nonce: bytes = NONCE


def binding_for(policy, code_digest: str = CODE_DIGEST, *, nonce: bytes = NONCE, timestamp: int | None = None,
                config: bytes | None = None) -> Binding:
    """What a node binds: `config` (a fresh key configuration by default), `nonce` at `timestamp` (now)."""
    measurement = Measurement(bytes.fromhex(code_digest), policy.digest, bytes.fromhex(MODEL_DIGEST))
    config = key_config() if config is None else config
    timestamp = int(time.time()) if timestamp is None else timestamp
    return Binding(config, measurement, timestamp, bind(config, RECEIPT_KEY, measurement, nonce, timestamp, b""), nonce)


def tsm_bundle(binding: Binding, cpu: CpuEvidence) -> EvidenceBundle:
    return EvidenceBundle(backend="tsm", key_config=binding.key_config, receipt_key=RECEIPT_KEY,
                          measurement=binding.measurement, nonce=binding.nonce, timestamp=binding.timestamp,
                          report_data=binding.report_data, cpu=cpu, gpu=None)


def snp_evidence(policy, fields: SnpFields | None = None, *, crls: tuple[bytes, ...] | None = None,
                 chain: tuple[bytes, ...] | None = None, code_digest: str = CODE_DIGEST, nonce: bytes = NONCE,
                 timestamp: int | None = None, config: bytes | None = None, product: str = "Milan") -> EvidenceBundle:
    """A tsm bundle with a synthetic SEV-SNP report of a `product` chip over the bundle's own binding
    (`binding_for`), unless `fields` says otherwise."""
    hierarchy = amd_hierarchy(product)
    binding = binding_for(policy, code_digest, nonce=nonce, timestamp=timestamp, config=config)
    fields = fields or SnpFields()
    if fields.report_data == bytes(64):
        fields.report_data = binding.report_data
    cpu = CpuEvidence("sev-snp", snp_report(hierarchy, fields), hierarchy.chain if chain is None else chain,
                      hierarchy.crls() if crls is None else crls)
    return tsm_bundle(binding, cpu)


def tdx_evidence(policy, fields: TdxFields | None = None, *, crls: tuple[bytes, ...] | None = None,
                 code_digest: str = CODE_DIGEST, collateral: TdxCollateral | None = None, nonce: bytes = NONCE,
                 timestamp: int | None = None, config: bytes | None = None) -> EvidenceBundle:
    """A tsm bundle with a synthetic TDX quote over the bundle's own binding (`binding_for`), unless `fields`
    says otherwise."""
    hierarchy = intel_hierarchy()
    binding = binding_for(policy, code_digest, nonce=nonce, timestamp=timestamp, config=config)
    fields = fields or TdxFields()
    if fields.report_data == bytes(64):
        fields.report_data = binding.report_data
    cpu = CpuEvidence("tdx", tdx_quote(hierarchy, fields), (), hierarchy.crls() if crls is None else crls,
                      collateral or tdx_collateral())
    return tsm_bundle(binding, cpu)


def assert_refused_by(bundle: EvidenceBundle, policy, error_type: type, check: str) -> None:
    """The verifier refuses `bundle` with exactly `error_type`, at `check`, after every earlier check passed."""
    outcome = verify_with_report(bundle, policy)
    assert type(outcome.error) is error_type, outcome.error
    assert [result.name for result in outcome.checks if result.passed is False] == [check]
