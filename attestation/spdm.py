"""SPDM GET_MEASUREMENTS transcripts, the shape of an NVIDIA Hopper GPU attestation report.

    request  (37 bytes): version, 0xE0, param1 (bit 0: signature requested),
                         param2 (measurement selector), nonce (32), slot id
    response:            version, 0x60, param1, param2, number of blocks,
                         record length (3, little endian), measurement record,
                         responder nonce (32), opaque length (2), opaque data,
                         signature (96: ECDSA P-384 r ‖ s over everything before it)

Measurement blocks follow the DMTF format (index, specification, size, then
value type, value size, value). Opaque data is a list of (type u16, size u16,
value) fields; NVIDIA uses it for driver and VBIOS versions and similar, and
the simulated backend adds a `simulated` field in the vendor range.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, utils

from attestation.errors import EvidenceFormatError, SignatureError

REQUEST_SIZE = 37
NONCE_SIZE = 32
SIGNATURE_SIZE = 96
GET_MEASUREMENTS = 0xE0
MEASUREMENTS = 0x60
OPAQUE_DRIVER_VERSION = 3
OPAQUE_SIMULATED = 0xFE01  # Veil's vendor-range field: present only in simulated reports
SIMULATED_MARKER = b"veil-simulated"
_MIN_RESPONSE = 8 + NONCE_SIZE + 2 + SIGNATURE_SIZE


class ReportFormatError(EvidenceFormatError):
    """A GPU attestation report does not have the SPDM GET_MEASUREMENTS layout."""


@dataclass(frozen=True, slots=True)
class MeasurementBlock:
    index: int
    specification: int
    value_type: int
    value: bytes


@dataclass(frozen=True, slots=True)
class OpaqueField:
    field_type: int
    value: bytes


@dataclass(frozen=True, slots=True)
class SpdmReport:
    """A parsed GET_MEASUREMENTS transcript."""

    spdm_version: int
    request_nonce: bytes
    slot_id: int
    blocks: tuple[MeasurementBlock, ...]
    responder_nonce: bytes
    opaque: tuple[OpaqueField, ...]
    signed_part: bytes
    signature: bytes

    def opaque_value(self, field_type: int) -> bytes | None:
        """The value of the first opaque field of `field_type`, if present."""
        return next((field.value for field in self.opaque if field.field_type == field_type), None)

    @property
    def is_simulated(self) -> bool:
        return self.opaque_value(OPAQUE_SIMULATED) == SIMULATED_MARKER


def parse_report(report: bytes) -> SpdmReport:
    """Parse request and response; raise ReportFormatError on any inconsistency."""
    if len(report) < REQUEST_SIZE + _MIN_RESPONSE:
        raise ReportFormatError("GPU attestation report is too short for an SPDM GET_MEASUREMENTS transcript")
    request, response = report[:REQUEST_SIZE], report[REQUEST_SIZE:]
    if request[1] != GET_MEASUREMENTS or response[1] != MEASUREMENTS or request[0] != response[0]:
        raise ReportFormatError("GPU attestation report is not a GET_MEASUREMENTS request and MEASUREMENTS response")
    if not request[2] & 0x01:
        raise ReportFormatError("GPU attestation report was requested without a signature")
    record_length = int.from_bytes(response[5:8], "little")
    record_end = 8 + record_length
    if record_end + _MIN_RESPONSE - 8 > len(response):
        raise ReportFormatError("GPU report measurement record length runs past the report")
    blocks = _parse_blocks(response[8:record_end], response[4])
    at = record_end + NONCE_SIZE
    (opaque_length,) = struct.unpack_from("<H", response, at)
    opaque_end = at + 2 + opaque_length
    if len(response) - opaque_end != SIGNATURE_SIZE:
        raise ReportFormatError("GPU report opaque data length does not leave exactly a 96-byte signature")
    return SpdmReport(
        spdm_version=response[0],
        request_nonce=request[4:36],
        slot_id=request[36],
        blocks=blocks,
        responder_nonce=response[record_end:at],
        opaque=_parse_opaque(response[at + 2 : opaque_end]),
        signed_part=report[:-SIGNATURE_SIZE],
        signature=report[-SIGNATURE_SIZE:],
    )


def verify_report_signature(parsed: SpdmReport, leaf: x509.Certificate) -> None:
    """Check the ECDSA P-384 / SHA-384 signature with the chain's leaf key; raise SignatureError."""
    public_key = leaf.public_key()
    if not isinstance(public_key, ec.EllipticCurvePublicKey) or public_key.curve.name != "secp384r1":
        raise SignatureError("the GPU report's leaf certificate does not hold an ECDSA P-384 key")
    r = int.from_bytes(parsed.signature[:48], "big")
    s = int.from_bytes(parsed.signature[48:], "big")
    try:
        public_key.verify(utils.encode_dss_signature(r, s), parsed.signed_part, ec.ECDSA(hashes.SHA384()))
    except InvalidSignature:
        raise SignatureError("the GPU report's signature does not verify under its leaf certificate") from None


def build_report(
    request_nonce: bytes,
    measurements: Sequence[bytes],
    responder_nonce: bytes,
    opaque: Sequence[OpaqueField],
    sign: Callable[[bytes], bytes],
) -> bytes:
    """Assemble a signed transcript in the same layout (used by the simulated GPU)."""
    request = bytes([0x11, GET_MEASUREMENTS, 0x01, 0xFF]) + request_nonce + b"\x00"
    record = b"".join(_block(index + 1, value) for index, value in enumerate(measurements))
    opaque_data = b"".join(struct.pack("<HH", f.field_type, len(f.value)) + f.value for f in opaque)
    response = (
        bytes([0x11, MEASUREMENTS, 0x00, 0x00, len(measurements)])
        + len(record).to_bytes(3, "little") + record + responder_nonce
        + struct.pack("<H", len(opaque_data)) + opaque_data
    )
    signed = request + response
    return signed + sign(signed)


def _block(index: int, value: bytes) -> bytes:
    # DMTF measurement value: type 0x01 (mutable firmware digest), size, value.
    dmtf = struct.pack("<BH", 0x01, len(value)) + value
    return struct.pack("<BBH", index, 0x01, len(dmtf)) + dmtf


def _parse_blocks(record: bytes, count: int) -> tuple[MeasurementBlock, ...]:
    blocks, at = [], 0
    for _ in range(count):
        if at + 7 > len(record):
            raise ReportFormatError("GPU report measurement block is cut short")
        index, spec, size = struct.unpack_from("<BBH", record, at)
        value_type, value_size = struct.unpack_from("<BH", record, at + 4)
        if value_size + 3 != size or at + 4 + size > len(record):
            raise ReportFormatError("GPU report measurement block sizes are inconsistent")
        blocks.append(MeasurementBlock(index, spec, value_type, record[at + 7 : at + 4 + size]))
        at += 4 + size
    if at != len(record):
        raise ReportFormatError("GPU report measurement record does not match its block count")
    return tuple(blocks)


def _parse_opaque(data: bytes) -> tuple[OpaqueField, ...]:
    fields, at = [], 0
    while at < len(data):
        if at + 4 > len(data):
            raise ReportFormatError("GPU report opaque field header is cut short")
        field_type, size = struct.unpack_from("<HH", data, at)
        if at + 4 + size > len(data):
            raise ReportFormatError("GPU report opaque field runs past the opaque data")
        fields.append(OpaqueField(field_type, data[at + 4 : at + 4 + size]))
        at += 4 + size
    return tuple(fields)
