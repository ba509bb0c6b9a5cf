"""AMD SEV-SNP: the attestation report (ABI version 2 and later) and the VCEK that signs it.

Report layout (0x4A0 bytes, integers little-endian):

    0x000 VERSION u32        0x008 POLICY u64 (bit 17 must be one, 18 MIGRATE_MA, 19 DEBUG, 26-63 zero)
    0x030 VMPL u32           0x034 SIGNATURE_ALGO u32 (1: ECDSA P-384 with SHA-384)
    0x038 CURRENT_TCB (8)    0x040 PLATFORM_INFO u64 (bits 8-63 zero)
    0x048 KEY_INFO u32 (bits 2-4 SIGNING_KEY: 0 VCEK)
    0x050 REPORT_DATA (64)   0x090 MEASUREMENT (48)   0x0C0 HOST_DATA (32)
    0x0E0 ID_KEY_DIGEST (48) 0x110 AUTHOR_KEY_DIGEST (48) 0x180 REPORTED_TCB (8)
    0x188 CPUID_FAM_ID, 0x189 CPUID_MOD_ID, 0x18A CPUID_STEP (version 3 on; reserved in version 2)
    0x1A0 CHIP_ID (64)       0x1E0 COMMITTED_TCB (8)  0x1F0 LAUNCH_TCB (8)
    0x1F8 LAUNCH_MIT_VECTOR, 0x200 CURRENT_MIT_VECTOR (version 5; reserved before)
    0x2A0 signature r ‖ s, 72 bytes each, little-endian, over bytes 0x000-0x29F
    Reserved bytes, which must be zero in the versions that reserve them: see RESERVED_BYTES; the
    reserved bytes inside each TCB_VERSION, which depend on the product: see TCB_VERSION_FIELDS.

The VCEK (chip key, one per chip and TCB) is certified by the ASK, the ASK by
the ARK of its product line (RSA-PSS, SHA-384). The VCEK's extensions name
the product and certify the TCB's security patch levels and the chip's hwID,
which must equal the report's REPORTED_TCB and CHIP_ID: a key certified for
another chip or another TCB does not vouch for this report. Turin (family 1Ah)
lays both out differently from Milan and Genoa (family 19h): see PRODUCT_FORMATS.
From version 3 on, the report names the chip's CPUID family and model, which
must be of the VCEK's product: see CPUID_PRODUCTS.
"""

from __future__ import annotations

import struct
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

from cryptography import utils as crypto_utils
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, utils

from attestation.certs import parse_certificate
from attestation.errors import (
    CertifiedTcbError,
    ChainError,
    ChipIdError,
    CpuReportFormatError,
    SignatureError,
    SnpProductError,
)

REPORT_SIZE = 0x4A0
SIGNED_SIZE = 0x2A0
SIGNATURE_END = 0x330  # r and s, 72 bytes each
MIN_VERSION = 2
MAX_VERSION = 5
POLICY_MIGRATE_MA = 1 << 18
POLICY_DEBUG = 1 << 19
# Guest POLICY, AMD SEV-SNP Firmware ABI Specification (publication 56860), section 4.3, Table 9 "Guest Policy
# Structure": 7:0 ABI_MINOR, 15:8 ABI_MAJOR, 16 SMT, 17 reserved and must be one, 18 MIGRATE_MA, 19 DEBUG,
# 20 SINGLE_SOCKET, 21 CXL_ALLOW, 22 MEM_AES_256_XTS, 23 RAPL_DIS, 24 CIPHERTEXT_HIDING, 25 PAGE_SWAP_DISABLE;
# 63:26 reserved and must be zero. The firmware refuses to launch a guest with any other policy, so a report
# carrying one was not made by it.
POLICY_MUST_BE_ONE = 1 << 17
POLICY_DEFINED = (1 << 26) - 1
SIGNATURE_ALGO_ECDSA_P384 = 1
SIGNING_KEY_VCEK = 0
_AMD_OID = "1.3.6.1.4.1.3704.1."
STRUCT_VERSION_OID = _AMD_OID + "1"
PRODUCT_NAME_OID = _AMD_OID + "2"
HWID_OID = _AMD_OID + "4"
CHIP_ID_SIZE = 64
# ATTESTATION_REPORT version 3 (AMD 56860 rev. 1.55+, section 7.3, "ATTESTATION_REPORT Structure") turns
# reserved bytes after REPORTED_TCB into CPUID_FAM_ID (0x188, extended family plus family), CPUID_MOD_ID
# (0x189, extended model << 4 | model) and CPUID_STEP (0x18A); go-sev-guest (abi.ReportToProto, 0x188-0x18A
# from version 3) and virtee/sev (AttestationReport's decoder, CPUID_FAMILY_ID_BYTES 0x188) read them there.
CPUID_VERSION = 3
CPUID_FAMILY_OFFSET = 0x188
CPUID_MODEL_OFFSET = 0x189
# KEY_INFO (0x48): 0 AUTHOR_KEY_EN, 1 MASK_CHIP_KEY, 4:2 SIGNING_KEY; 31:5 reserved, must be zero (AMD 56860,
# ATTESTATION_REPORT; go-sev-guest's abi.ParseSignerInfo refuses them so).
KEY_INFO_DEFINED = (1 << 5) - 1
# PLATFORM_INFO (0x40): 0 SMT_EN, 1 TSME_EN, 2 ECC_EN, 3 RAPL_DIS, 4 CIPHERTEXT_HIDING_EN, 5 ALIAS_CHECK_COMPLETE,
# 7 TIO_EN (AMD 56860 rev. 1.58, as virtee/sev dcaa068 and go-sev-guest f732359 transcribe it: go-sev-guest's
# abi.ParseSnpPlatformInfo, maxPlatformInfoBit 7; virtee/sev's PlatformInfo, "Bits 8-63 are reserved").
# Each ABI revision has defined more of them, but none has defined any of 8-63, so a report setting one is
# not the firmware's. Bit 6 is not judged: the published ABI and upstream go-sev-guest call it reserved, but
# Turin verifiers (tinfoilsh's go-sev-guest fork raised maxPlatformInfoBit to 6; tinfoil-go reads it as
# IOMMU_WRITE_SAFE) accept it, so genuine reports may set it.
PLATFORM_INFO_DEFINED = (1 << 8) - 1


@dataclass(frozen=True, slots=True)
class ReservedBytes:
    """A range of ATTESTATION_REPORT bytes that AMD's ABI reserves (must be zero) in some report versions."""

    start: int
    end: int  # exclusive
    versions: range  # the report versions whose layout reserves them
    where: str  # the fields around them, for the refusal


_EVERY_VERSION = range(MIN_VERSION, MAX_VERSION + 1)
# The reserved ranges of each ATTESTATION_REPORT layout: AMD 56860 (rev. 1.55 for version 3, 1.58 for version 5),
# "ATTESTATION_REPORT Structure", as go-sev-guest's abi.ReportToProto checks them with its mbz helper and
# virtee/sev's AttestationReport decoder skips them (ReportVariant V2, V3 for versions 3 and 4, V5).
# Version 3 made 0x188-0x18A the CPUID; version 5 made 0x1F8-0x207 LAUNCH_MIT_VECTOR and CURRENT_MIT_VECTOR.
# Version 4, written by SEV firmware 1.55.31 on (go-sev-guest b8d75ce; virtee/sev PR 307, a Google Cloud
# Milan host), is under AMD embargo (virtee/sev PR 312): virtee/sev reads it as version 3, go-sev-guest reads
# the mitigation vectors in every version. So 0x1F8-0x207 is checked only where a published layout reserves
# it (versions 2 and 3); every other range is reserved in all of them. PLATFORM_INFO's reserved bits are
# judged by PLATFORM_INFO_DEFINED, the reserved bytes inside a TCB_VERSION by its product's layout
# (check_tcb_reserved_bytes: Turin's FMC, TEE and SNP sit in bytes Milan reserves).
RESERVED_BYTES: tuple[ReservedBytes, ...] = (
    ReservedBytes(0x04C, 0x050, _EVERY_VERSION, "after KEY_INFO"),
    ReservedBytes(0x188, 0x1A0, range(MIN_VERSION, CPUID_VERSION), "between REPORTED_TCB and CHIP_ID"),
    ReservedBytes(0x18B, 0x1A0, range(CPUID_VERSION, MAX_VERSION + 1), "between CPUID_STEP and CHIP_ID"),
    ReservedBytes(0x1EB, 0x1EC, _EVERY_VERSION, "after CURRENT_MAJOR"),
    ReservedBytes(0x1EF, 0x1F0, _EVERY_VERSION, "after COMMITTED_MAJOR"),
    ReservedBytes(0x1F8, 0x208, range(MIN_VERSION, 4), "after LAUNCH_TCB"),  # versions 2 and 3
    ReservedBytes(0x208, SIGNED_SIZE, _EVERY_VERSION, "before the signature"),
    # The signature covers none of these: set, they came from something other than the firmware, and would
    # let identical evidence travel as different bytes.
    ReservedBytes(SIGNATURE_END, REPORT_SIZE, _EVERY_VERSION, "after the signature"),
)


@dataclass(frozen=True, slots=True)
class SnpProductFormat:
    """How one product line's VCEK and report encode the TCB and the chip's identity."""

    struct_version: int  # the VCEK's structVersion extension, which names the layout below
    hwid_size: int  # bytes of the VCEK's hwID; the report's CHIP_ID is them, then zeros
    tcb: tuple[tuple[str, int], ...]  # (component, byte of TCB_VERSION)
    min_report_version: int  # the oldest ATTESTATION_REPORT version accepted from the product's chips


# AMD SEV-SNP Firmware ABI Specification (56860) rev. 1.57+, "TCB_VERSION Structure", and the VCEK
# Certificate and KDS Interface Specification (57230), Tables 11-13: one security patch level (SPL) per
# byte of TCB_VERSION, placed by processor family. Family 19h (Milan, Genoa; VCEK structVersion 0):
# 0 BOOT_LOADER, 1 TEE, 2-5 reserved, 6 SNP, 7 MICROCODE, hwID the whole 64-byte CHIP_ID. Family 1Ah
# (Turin; structVersion 1): 0 FMC, 1 BOOT_LOADER, 2 TEE, 3 SNP, 4-6 reserved, 7 MICROCODE, hwID the
# 8-byte silicon id that fills the first 8 bytes of CHIP_ID (the other 56 are zero). virtee/sev
# (TcbVersion::from_turin_bytes) and virtee/snpguest (PR #159) read them so. Chosen by the product the
# verified VCEK names and checked against its structVersion, never taken from a field of the report.
# Milan and Genoa firmware wrote version 2 reports, which carry no CPUID, and still may. A Turin report must
# carry its CPUID: virtee/snpguest's verify refuses a Turin report below version 3 ("Turin Attestation is not
# supported in version 2 of the report", src/verify.rs), and without it nothing signed ties the report to Turin.
_FAMILY_19H = SnpProductFormat(0, CHIP_ID_SIZE, (("boot_loader", 0), ("tee", 1), ("snp", 6), ("microcode", 7)), 2)
PRODUCT_FORMATS: dict[str, SnpProductFormat] = {
    "Milan": _FAMILY_19H,
    "Genoa": _FAMILY_19H,
    "Turin": SnpProductFormat(1, 8, (("fmc", 0), ("boot_loader", 1), ("tee", 2), ("snp", 3), ("microcode", 7)), 3),
}
# The product line whose VCEK signs for each CPUID family and range of models, as virtee/sev's
# Generation::identify_cpu (src/lib.rs) and virtee/snpguest's get_processor_model (src/fetch.rs) map them:
# family 19h models 00h-0Fh Milan, 10h-1Fh and A0h-AFh Genoa; family 1Ah models 00h-11h Turin (its models
# 50h-57h, 90h-AFh and C0h-C7h are Venice, whose VCEK layout Veil does not know). go-sev-guest's
# SevProductFromCpuid1Eax (abi/abi.go) names only each line's first model (19h/01h, 19h/11h, 1Ah/02h), which
# these ranges hold. CPUID_STEP is not compared with the VCEK productName's stepping suffix ("Milan-B0"): AMD's
# KDS specification maps the suffix to no CPUID stepping, and KDS has named stepping-1 Milan chips' VCEKs
# "Milan-B0" (go-sev-guest issue 115; its verify compares the suffix only with a stepping its caller names,
# behind a flag to skip even that, workaround_kds_productname) and Genoa VCEKs "Genoa" with no suffix
# (go-sev-guest PR 152). The VCEK binds the report to one chip (CHIP_ID) already.
CPUID_PRODUCTS: tuple[tuple[int, range, str], ...] = (
    (0x19, range(0x00, 0x10), "Milan"),
    (0x19, range(0x10, 0x20), "Genoa"),
    (0x19, range(0xA0, 0xB0), "Genoa"),
    (0x1A, range(0x00, 0x12), "Turin"),
)
# The report's four TCB_VERSIONs (AMD 56860, ATTESTATION_REPORT): each is laid out as its product lays it out,
# and each byte the layout gives no component is reserved: 2-5 on family 19h, 4-6 on Turin (56860 rev. 1.57+,
# "TCB_VERSION Structure"; virtee/sev's to_legacy_bytes and to_turin_bytes write them zero, Microsoft CCF's
# TcbVersionMilanGenoa and TcbVersionTurin name them reserved). go-sev-guest keeps them as the KDS
# specification's spl4-spl7, which no KDS request can set (a VCEK URL names blSPL, teeSPL, snpSPL, ucodeSPL
# and fmcSPL only), and they are no component a floor could judge: set, the report is refused by name.
TCB_VERSION_FIELDS: tuple[tuple[str, int], ...] = (
    ("CURRENT_TCB", 0x038), ("REPORTED_TCB", 0x180), ("COMMITTED_TCB", 0x1E0), ("LAUNCH_TCB", 0x1F0),
)
TCB_VERSION_SIZE = 8
# Each component's VCEK extension (AMD KDS specification, 57230: blSPL, teeSPL, snpSPL, ucodeSPL, fmcSPL).
TCB_EXTENSION_OIDS: dict[str, str] = {
    "boot_loader": _AMD_OID + "3.1", "tee": _AMD_OID + "3.2", "snp": _AMD_OID + "3.3",
    "microcode": _AMD_OID + "3.8", "fmc": _AMD_OID + "3.9",
}
TCB_COMPONENT_NAMES: dict[str, str] = {
    "boot_loader": "boot loader", "tee": "TEE", "snp": "SNP firmware", "microcode": "microcode", "fmc": "FMC",
}


class SnpReportFormatError(CpuReportFormatError):
    """An SEV-SNP report does not have the layout of a supported ABI version."""


@dataclass(frozen=True, slots=True)
class SnpReport:
    """The fields Veil checks in an SEV-SNP attestation report."""

    version: int
    policy: int
    vmpl: int
    signing_key: int
    report_data: bytes
    measurement: bytes
    host_data: bytes  # 32 bytes the host chose at launch
    id_key_digest: bytes  # SHA-384 of the ID block's signing key; zero without an ID block
    author_key_digest: bytes  # SHA-384 of the key that signed the ID key; zero without one
    reported_tcb: bytes
    cpuid_family: int | None  # CPUID_FAM_ID; None in a version 2 report
    cpuid_model: int | None  # CPUID_MOD_ID; None in a version 2 report
    chip_id: bytes
    signed: bytes
    signature_r: int
    signature_s: int

    @property
    def debug(self) -> bool:
        return bool(self.policy & POLICY_DEBUG)

    @property
    def migration_agent(self) -> bool:
        return bool(self.policy & POLICY_MIGRATE_MA)


@dataclass(frozen=True, slots=True)
class SnpPlatform:
    """What a verified SEV-SNP report says of its platform and launch, for the policy's floor and pins."""

    product: str  # the product line the VCEK names (Milan, Genoa, Turin)
    tcb: tuple[tuple[str, int], ...]  # (component, security patch level) of REPORTED_TCB, certified by the VCEK
    host_data: bytes
    id_key_digest: bytes
    author_key_digest: bytes


def parse_snp_report(report: bytes) -> SnpReport:
    """Parse a report of a supported version signed with ECDSA P-384; raise SnpReportFormatError otherwise."""
    if len(report) != REPORT_SIZE:
        raise SnpReportFormatError(f"an SEV-SNP attestation report is {REPORT_SIZE:#x} bytes (truncated or padded)")
    (version,) = struct.unpack_from("<I", report, 0x00)
    if not MIN_VERSION <= version <= MAX_VERSION:
        raise SnpReportFormatError(f"SEV-SNP report version {version} is not supported ({MIN_VERSION} to {MAX_VERSION})")
    (policy,) = struct.unpack_from("<Q", report, 0x08)
    vmpl, algorithm = struct.unpack_from("<II", report, 0x30)
    platform_info, key_info = struct.unpack_from("<QI", report, 0x40)
    if algorithm != SIGNATURE_ALGO_ECDSA_P384:
        raise SnpReportFormatError("the SEV-SNP report is not signed with ECDSA P-384")
    check_reserved_bytes(report, version)
    if platform_info & ~PLATFORM_INFO_DEFINED:
        raise SnpReportFormatError("the SEV-SNP report's PLATFORM_INFO sets bits AMD's ABI reserves (8 to 63, "
                                   "must be zero)")
    if key_info & ~KEY_INFO_DEFINED:
        raise SnpReportFormatError("the SEV-SNP report's KEY_INFO sets bits AMD's ABI reserves (5 to 31, must be 0)")
    _check_policy(policy)
    has_cpuid = version >= CPUID_VERSION
    return SnpReport(
        version=version, policy=policy, vmpl=vmpl, signing_key=(key_info >> 2) & 0x7,
        report_data=report[0x50:0x90], measurement=report[0x90:0xC0], host_data=report[0xC0:0xE0],
        id_key_digest=report[0xE0:0x110], author_key_digest=report[0x110:0x140], reported_tcb=report[0x180:0x188],
        cpuid_family=report[CPUID_FAMILY_OFFSET] if has_cpuid else None,
        cpuid_model=report[CPUID_MODEL_OFFSET] if has_cpuid else None, chip_id=report[0x1A0:0x1E0],
        signed=report[:SIGNED_SIZE],
        signature_r=int.from_bytes(report[SIGNED_SIZE:0x2E8], "little"),
        signature_s=int.from_bytes(report[0x2E8:SIGNATURE_END], "little"),
    )


def check_reserved_bytes(report: bytes, version: int) -> None:
    """Every range a version `version` report reserves must be zero: the firmware writes none of them, so a report
    setting one is not a report AMD's ABI defines, whatever signs it."""
    for reserved in RESERVED_BYTES:
        if version in reserved.versions and any(report[reserved.start:reserved.end]):
            last = reserved.end - 1
            span = f"byte {last:#x}" if reserved.start == last else f"bytes {reserved.start:#x} to {last:#x}"
            raise SnpReportFormatError(f"the SEV-SNP report sets reserved {span} ({reserved.where}), which AMD's "
                                       f"ABI requires zero in a version {version} report")


def _check_policy(policy: int) -> None:
    if not policy & POLICY_MUST_BE_ONE:
        raise SnpReportFormatError("the SEV-SNP guest POLICY has bit 17 clear, which AMD's ABI requires set")
    if policy & ~POLICY_DEFINED:
        raise SnpReportFormatError("the SEV-SNP guest POLICY sets bits AMD's ABI reserves (26 to 63, must be zero)")


def load_vcek_chain(chain: Sequence[bytes]) -> tuple[x509.Certificate, ...]:
    """The bundle's VCEK, ASK and ARK (DER, in that order), parsed."""
    if len(chain) != 3:
        raise ChainError(
            "SEV-SNP evidence must carry the VCEK, ASK and ARK certificates (from AMD KDS); "
            f"it carries {len(chain)} certificate(s)"
        )
    message = "the SEV-SNP certificate chain holds a malformed certificate (VCEK, ASK or ARK)"
    with warnings.catch_warnings():
        # AMD issues VCEKs with serial number 0, which RFC 5280 disallows and cryptography warns about.
        warnings.simplefilter("ignore", crypto_utils.CryptographyDeprecationWarning)
        return tuple(parse_certificate(der, ChainError, message) for der in chain)


def check_product_line(chain: Sequence[x509.Certificate]) -> str:
    """The VCEK's product (e.g. Milan); its ASK and ARK must be that product's (SEV-<product>, ARK-<product>).

    Run on a verified chain only: the VCEK's extensions are the word of whoever signed it."""
    vcek, ask, ark = chain
    product = _extension_ia5(vcek, PRODUCT_NAME_OID).split("-", 1)[0]
    expected = (f"SEV-{product}", f"ARK-{product}")
    if (_common_name(ask), _common_name(ark)) != expected:
        raise ChainError(f"the SEV-SNP VCEK is for {product!r} but its chain is not that product's ASK and ARK")
    product_format = _product_format(product)  # a product whose TCB Veil cannot read has no verifiable TCB
    if _extension_small_int(vcek, STRUCT_VERSION_OID) != product_format.struct_version:
        raise ChainError(f"the SEV-SNP VCEK is for {product!r} but its structVersion is not "
                         f"{product_format.struct_version}, the one whose TCB and hwID layout {product} uses")
    return product


def verify_report_signature(report: SnpReport, vcek: x509.Certificate) -> None:
    """Check the report's signature under the VCEK's P-384 key."""
    key = vcek.public_key()
    if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name != "secp384r1":
        raise SignatureError("the SEV-SNP VCEK does not hold an ECDSA P-384 key")
    if report.signing_key != SIGNING_KEY_VCEK:
        raise SignatureError("the SEV-SNP report is not signed by the chip's VCEK (VLEK or no key); Veil verifies VCEK reports")
    try:
        key.verify(utils.encode_dss_signature(report.signature_r, report.signature_s), report.signed, ec.ECDSA(hashes.SHA384()))
    except InvalidSignature:
        raise SignatureError("the SEV-SNP report's signature does not verify under its VCEK") from None


def check_tcb_reserved_bytes(report: SnpReport, product: str) -> None:
    """Each of the report's TCB_VERSIONs must leave zero the bytes that `product`'s layout reserves."""
    components = {offset for _, offset in _product_format(product).tcb}
    reserved = [byte for byte in range(TCB_VERSION_SIZE) if byte not in components]
    for field, start in TCB_VERSION_FIELDS:
        byte = next((byte for byte in reserved if report.signed[start + byte]), None)
        if byte is not None:
            raise SnpReportFormatError(f"the SEV-SNP report's {field} sets byte {byte} of its TCB_VERSION, which "
                                       f"{product}'s layout reserves (bytes {', '.join(map(str, reserved))}); "
                                       "AMD's ABI requires them zero")


def tcb_levels(tcb_version: bytes, product: str) -> dict[str, int]:
    """Each component's security patch level in an 8-byte TCB_VERSION, laid out as `product` lays it out."""
    return {component: tcb_version[offset] for component, offset in _product_format(product).tcb}


def check_vcek_certifies(report: SnpReport, vcek: x509.Certificate, product: str) -> dict[str, int]:
    """The report must be of the VCEK's product and the VCEK must certify its REPORTED_TCB and CHIP_ID; returns
    the certified patch levels."""
    check_report_product(report, product)
    levels = tcb_levels(report.reported_tcb, product)
    for component, level in levels.items():
        if _extension_small_int(vcek, TCB_EXTENSION_OIDS[component]) != level:
            raise CertifiedTcbError(
                f"the SEV-SNP report's {TCB_COMPONENT_NAMES[component]} security patch level (REPORTED_TCB) "
                "differs from the one its VCEK certifies; fetch the VCEK for the reported TCB"
            )
    check_chip_id(report.chip_id, _extension_raw(vcek, HWID_OID), product)
    return levels


def check_report_product(report: SnpReport, product: str) -> None:
    """The report's version must be one Veil accepts from `product`'s chips and, from version 3 on, its CPUID
    family and model must be a `product` chip's: the product whose TCB layout and floor are applied to it."""
    minimum = _product_format(product).min_report_version
    if report.version < minimum:
        raise SnpProductError(
            f"the SEV-SNP report is version {report.version}, but its VCEK is for {product}, whose reports must be "
            f"version {minimum} or later (they carry CPUID_FAM_ID and CPUID_MOD_ID); update the host's SEV firmware")
    if report.cpuid_family is None or report.cpuid_model is None:
        return  # a version 2 report of Milan or Genoa: no CPUID to compare
    named = cpuid_product(report.cpuid_family, report.cpuid_model)
    if named is None:
        raise SnpProductError("the SEV-SNP report's CPUID_FAM_ID and CPUID_MOD_ID name no processor whose VCEK "
                              f"Veil reads ({', '.join(PRODUCT_FORMATS)})")
    if named != product:
        raise SnpProductError(f"the SEV-SNP report's CPUID_FAM_ID and CPUID_MOD_ID name a {named} chip, but its "
                              f"VCEK is for {product}")


def cpuid_product(family: int, model: int) -> str | None:
    """The product line of a chip of CPUID `family` and `model`, or None for one Veil does not know."""
    return next((name for known, models, name in CPUID_PRODUCTS if family == known and model in models), None)


def check_chip_id(chip_id: bytes, hwid: bytes, product: str) -> None:
    """CHIP_ID must be the VCEK's hwID, of the product's size, followed by zeros up to 64 bytes."""
    size = _product_format(product).hwid_size
    if len(hwid) != size:
        raise ChainError(f"the SEV-SNP VCEK's hwID is {len(hwid)} bytes; a {product} VCEK's is {size}")
    if chip_id != hwid + bytes(CHIP_ID_SIZE - size):
        raise ChipIdError("the SEV-SNP report's CHIP_ID differs from its VCEK's hwID: the VCEK is another chip's")


def _product_format(product: str) -> SnpProductFormat:
    product_format = PRODUCT_FORMATS.get(product)
    if product_format is None:
        raise ChainError(f"the SEV-SNP VCEK is for {product!r}, whose TCB layout Veil does not know "
                         f"(it reads {', '.join(PRODUCT_FORMATS)})")
    return product_format


def _extension_raw(certificate: x509.Certificate, oid: str) -> bytes:
    try:
        extension = certificate.extensions.get_extension_for_oid(x509.ObjectIdentifier(oid))
    except x509.ExtensionNotFound:
        raise ChainError(f"the SEV-SNP VCEK lacks AMD's extension {oid}; it is not a VCEK") from None
    value = extension.value
    if not isinstance(value, x509.UnrecognizedExtension):
        raise ChainError(f"the SEV-SNP VCEK's extension {oid} is malformed")
    return value.value


def _extension_small_int(certificate: x509.Certificate, oid: str) -> int:
    raw = _extension_raw(certificate, oid)  # DER INTEGER 0..255: 02 01 xx, or 02 02 00 xx above 127
    if len(raw) == 3 and raw[:2] == b"\x02\x01" and raw[2] < 0x80:
        return raw[2]
    if len(raw) == 4 and raw[:3] == b"\x02\x02\x00" and raw[3] >= 0x80:
        return raw[3]
    raise ChainError(f"the SEV-SNP VCEK's extension {oid} is not a patch level from 0 to 255")


def _extension_ia5(certificate: x509.Certificate, oid: str) -> str:
    raw = _extension_raw(certificate, oid)
    if len(raw) < 2 or raw[0] != 0x16 or raw[1] != len(raw) - 2:
        raise ChainError(f"the SEV-SNP VCEK's extension {oid} is not a product name")
    return raw[2:].decode("ascii", errors="replace")


def _common_name(certificate: x509.Certificate) -> str:
    names = certificate.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)
    return str(names[0].value) if names else ""
