"""Intel TDX quotes, version 4: the TD report, its signature, and the PCK chain that certifies it.

Layout (integers little-endian):

    0x000 header: version u16, attestation key type u16 (2: ECDSA P-256), TEE type u32 (0x81),
          ..., QE vendor id (16) at 0x00C
    0x030 TD report body: TEE_TCB_SVN, MRSEAM, MRSIGNERSEAM (48) at 0x070 (zero: the TDX module is
          Intel's), SEAMATTRIBUTES u64 at 0x0A0 (zero: a production module, not a debug one),
          TDATTRIBUTES u64 at 0x0A8 (bits 0-7: TD under
          debug), XFAM u64 at 0x0B0 (both with reserved bits that must be zero), MRTD at 0x0B8,
          RTMR0-3 at 0x178/0x1A8/0x1D8/0x208, REPORTDATA at 0x238-0x277
    0x278 signature data length u32, then: quote signature r ‖ s (64, big-endian, ECDSA P-256
          over 0x000-0x277), attestation key x ‖ y (64), certification data type 6 (u16) and
          size (u32): the QE report (384), its signature by the PCK (64), QE auth data (u16
          length, data), then certification data type 5 (u16) and size (u32): the PCK chain,
          PEM, leaf first. The three sizes each run to the end of the quote; a size that
          disagrees with the bytes present is a format error.

Trust runs Intel SGX Root CA → PCK Platform (or Processor) CA → PCK leaf → QE report, which
binds SHA-256(attestation key ‖ QE auth data) in its report data → the quote signature.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, utils

from attestation.certs import pem_chain_to_der
from attestation.errors import ChainError, CpuReportFormatError, QuotingEnclaveError, SignatureError

QUOTE_VERSION = 4
ATTESTATION_KEY_ECDSA_P256 = 2
TEE_TYPE_TDX = 0x81
INTEL_QE_VENDOR_ID = bytes.fromhex("939a7233f79c4ca9940a0db3957f0607")
# MRSIGNER of Intel's quoting enclave: only Intel's QE certifies TDX attestation keys.
INTEL_QE_MRSIGNER = bytes.fromhex("dc9e2a7c6f948f17474e34a7fc43ed030f7c1563f1babddf6340c82e0e54a8c5")
TD_UNDER_DEBUG_MASK = 0xFF
# TDATTRIBUTES.MIGRATABLE: the TD may be migrated by a migration TD (MigTD), which exports its memory.
TD_MIGRATABLE = 1 << 29
# TDATTRIBUTES, Intel TDX Module ABI Specification (348551), TD_PARAMS "ATTRIBUTES" definition table (the bits
# Linux names in arch/x86/include/asm/shared/tdx.h): TUD group 0 DEBUG, 4 HGS_PLUS_PROF, 5 PERF_PROF, 6 PMT_PROF;
# SEC group 16 ICSSD, 27 LASS, 28 SEPT_VE_DISABLE, 29 MIGRATABLE, 30 PKS, 31 KL; OTHER group 62 TPA, 63 PERFMON.
# Every other bit (1-3, 7-15, 17-26, 32-61) is reserved and must be zero.
TD_ATTRIBUTES_DEFINED = sum(1 << bit for bit in (0, 4, 5, 6, 16, 27, 28, 29, 30, 31, 62, 63))
# XFAM (the XSAVE features a TD may use, XCR0 | IA32_XSS layout), constrained by the module's XFAM_FIXED1 and
# XFAM_FIXED0 (same spec, TDX module global metadata): x87 and SSE (bits 0, 1) must be set; only bits 0-2, 5-9,
# 11, 12, 14, 15, 17 and 18 may be set (MPX, PASID, HDC, HWP and bits 19-63 are not supported).
XFAM_FIXED1 = 0x0000_0003
XFAM_FIXED0 = 0x0006_DBE7
SIGNED_SIZE = 0x278
QE_REPORT_SIZE = 384
CERT_DATA_QE_REPORT = 6
CERT_DATA_PCK_CHAIN = 5
RTMR_OFFSETS = (0x178, 0x1A8, 0x1D8, 0x208)


class TdxQuoteFormatError(CpuReportFormatError):
    """A TDX quote does not have the version 4 layout, or is truncated."""


@dataclass(frozen=True, slots=True)
class TdxQuote:
    """The fields Veil checks in a TDX quote."""

    td_attributes: int
    tee_tcb_svn: bytes  # 16 SVNs: [0] TDX module SVN, [1] its major version, then per-platform components
    mrseam: bytes  # the TDX module's measurement
    mr_config_id: bytes
    mr_owner: bytes
    mr_owner_config: bytes
    qe_vendor_id: bytes
    seam_attributes: int  # the TDX module's own: non-zero only for a debug module
    mrsigner_seam: bytes  # the TDX module's signer: all zero for Intel's
    mrtd: bytes
    rtmrs: tuple[bytes, bytes, bytes, bytes]
    report_data: bytes
    signed: bytes
    signature: bytes  # r ‖ s, big-endian
    attestation_key: bytes  # x ‖ y
    qe_report: bytes
    qe_report_signature: bytes
    qe_auth_data: bytes
    pck_chain: tuple[bytes, ...]  # DER, leaf first

    @property
    def debug(self) -> bool:
        return bool(self.td_attributes & TD_UNDER_DEBUG_MASK)

    @property
    def migratable(self) -> bool:
        return bool(self.td_attributes & TD_MIGRATABLE)

    @property
    def debug_module(self) -> bool:
        """The TDX module itself runs with debug attributes: the host can read what it protects."""
        return self.seam_attributes != 0

    @property
    def intel_module(self) -> bool:
        """The TDX module is Intel's (MRSIGNERSEAM all zero, as Intel's TCB info requires of it)."""
        return not any(self.mrsigner_seam)


class _Reader:
    """Reads fields in order and names the one a truncated quote lacks."""

    def __init__(self, data: bytes, offset: int) -> None:
        self.data, self.offset = data, offset

    def take(self, size: int, what: str) -> bytes:
        if self.offset + size > len(self.data):
            raise TdxQuoteFormatError(f"the TDX quote is truncated: it ends inside the {what}")
        field = self.data[self.offset:self.offset + size]
        self.offset += size
        return field

    def integer(self, fmt: str, what: str) -> int:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]


def parse_tdx_quote(quote: bytes) -> TdxQuote:
    """Parse a version 4 TDX quote with its embedded PCK chain; raise TdxQuoteFormatError otherwise."""
    header = _Reader(quote, 0)
    version, key_type, tee_type = struct.unpack("<HHI", header.take(8, "header"))
    if version != QUOTE_VERSION:
        raise TdxQuoteFormatError(
            f"TDX quote version {version} is not supported: Veil verifies version 4 quotes; "
            "configure the quote generation library to produce version 4"
        )
    if key_type != ATTESTATION_KEY_ECDSA_P256 or tee_type != TEE_TYPE_TDX:
        raise TdxQuoteFormatError("not a TDX quote with an ECDSA P-256 attestation key (key type 2, TEE type 0x81)")
    if header.take(24, "header")[4:20] != INTEL_QE_VENDOR_ID:
        raise TdxQuoteFormatError("the TDX quote was not produced by Intel's quoting enclave (QE vendor id)")
    reader = _Reader(quote, header.offset)
    reader.take(SIGNED_SIZE - header.offset, "TD report body")
    seam_attributes, td_attributes, xfam = struct.unpack_from("<QQQ", quote, 0x0A0)
    _check_reserved_bits(td_attributes, xfam)
    signed = quote[:SIGNED_SIZE]
    signature_data = _Declared("signature data", reader.integer("<I", "signature data length"), reader.offset)
    signature = reader.take(64, "quote signature")
    attestation_key = reader.take(64, "attestation key")
    qe_data_size = _expect_cert_type(reader, CERT_DATA_QE_REPORT, "QE report certification data")
    qe_data = _Declared("QE report certification data", qe_data_size, reader.offset)
    qe_report = reader.take(QE_REPORT_SIZE, "QE report")
    qe_report_signature = reader.take(64, "QE report signature")
    qe_auth_data = reader.take(reader.integer("<H", "QE auth data length"), "QE auth data")
    size = _expect_cert_type(reader, CERT_DATA_PCK_CHAIN, "PCK certificate chain")
    pem = reader.take(size, "PCK certificate chain")
    _check_declared_sizes(len(quote), reader.offset, (signature_data, qe_data))
    pck_chain = pem_chain_to_der(pem)
    rtmrs = tuple(quote[offset:offset + 48] for offset in RTMR_OFFSETS)
    return TdxQuote(
        td_attributes=td_attributes, tee_tcb_svn=quote[0x030:0x040], mrseam=quote[0x040:0x070],
        mr_config_id=quote[0x0E8:0x118], mr_owner=quote[0x118:0x148], mr_owner_config=quote[0x148:0x178],
        qe_vendor_id=quote[0x00C:0x01C], seam_attributes=seam_attributes, mrsigner_seam=quote[0x070:0x0A0],
        mrtd=quote[0x0B8:0x0E8], rtmrs=rtmrs,  # type: ignore[arg-type]
        report_data=quote[0x238:0x278], signed=signed, signature=signature, attestation_key=attestation_key,
        qe_report=qe_report, qe_report_signature=qe_report_signature, qe_auth_data=qe_auth_data, pck_chain=pck_chain,
    )


def _check_reserved_bits(td_attributes: int, xfam: int) -> None:
    """The TDX module refuses to build a TD with reserved TDATTRIBUTES or XFAM bits: a quote carrying them
    was not made by it."""
    if td_attributes & ~TD_ATTRIBUTES_DEFINED:
        raise TdxQuoteFormatError("the TDX quote's TDATTRIBUTES sets bits Intel's TDX module reserves (must be zero)")
    if xfam & XFAM_FIXED1 != XFAM_FIXED1 or xfam & ~XFAM_FIXED0:
        raise TdxQuoteFormatError(
            "the TDX quote's XFAM is not one the TDX module allows (x87 and SSE set, reserved features clear)"
        )


@dataclass(frozen=True, slots=True)
class _Declared:
    """A section whose size the quote declares: it must run from `start` to the end of the quote."""

    what: str
    size: int
    start: int


def _check_declared_sizes(quote_size: int, end: int, sections: tuple[_Declared, ...]) -> None:
    """Every declared size must agree with the bytes present: the signature data and the QE report certification
    data both end where the PCK chain (whose size was used to read it) ends, which is the end of the quote."""
    if end != quote_size:
        raise TdxQuoteFormatError(
            "the TDX quote has bytes after its PCK certificate chain (its sizes disagree with its length)"
        )
    for section in sections:
        if section.start + section.size != quote_size:
            raise TdxQuoteFormatError(
                f"the TDX quote's {section.what} size disagrees with the bytes present (corrupted or padded quote)"
            )


def _expect_cert_type(reader: _Reader, expected: int, what: str) -> int:
    kind = reader.integer("<H", what)
    size = reader.integer("<I", what)
    if kind != expected:
        raise TdxQuoteFormatError(
            f"the TDX quote carries certification data type {kind} where its {what} (type {expected}) belongs; "
            "the node must embed the PCK chain in its quotes"
        )
    return size


def verify_qe_report(quote: TdxQuote, pck: x509.Certificate) -> None:
    """The QE report is signed by the PCK, comes from Intel's QE, and certifies the attestation key."""
    _verify_p256(pck.public_key(), quote.qe_report, quote.qe_report_signature, "QE report", "PCK certificate")
    if quote.qe_report[128:160] != INTEL_QE_MRSIGNER:
        raise QuotingEnclaveError("the TDX quote's QE report is not from Intel's quoting enclave (MRSIGNER)")
    expected = hashlib.sha256(quote.attestation_key + quote.qe_auth_data).digest() + bytes(32)
    if not hmac.compare_digest(quote.qe_report[320:384], expected):
        raise QuotingEnclaveError(
            "the TDX quote's QE report does not certify its attestation key "
            "(report data must be SHA-256(attestation key ‖ QE auth data))"
        )


def verify_quote_signature(quote: TdxQuote) -> None:
    """The header and TD report body are signed by the attestation key the QE certified."""
    try:
        key = ec.EllipticCurvePublicKey.from_encoded_point(ec.SECP256R1(), b"\x04" + quote.attestation_key)
    except ValueError:
        raise SignatureError("the TDX quote's attestation key is not a P-256 point") from None
    _verify_p256(key, quote.signed, quote.signature, "quote", "attestation key")


def check_pck_chain_length(quote: TdxQuote) -> None:
    if len(quote.pck_chain) != 3:
        raise ChainError(
            "the TDX quote's PCK chain must hold the PCK certificate, its Platform or Processor CA and "
            f"the Intel SGX Root CA; it holds {len(quote.pck_chain)}"
        )


def _verify_p256(key: object, signed: bytes, signature: bytes, what: str, signer: str) -> None:
    if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name != "secp256r1":
        raise SignatureError(f"the TDX {signer} does not hold an ECDSA P-256 key")
    der = utils.encode_dss_signature(int.from_bytes(signature[:32], "big"), int.from_bytes(signature[32:], "big"))
    try:
        key.verify(der, signed, ec.ECDSA(hashes.SHA256()))
    except InvalidSignature:
        raise SignatureError(f"the TDX {what} signature does not verify under its {signer}") from None
