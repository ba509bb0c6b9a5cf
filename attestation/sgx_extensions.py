"""What an Intel PCK certificate certifies about its platform: the SGX extension (OID 1.2.840.113741.1.13.1).

The extension is a DER SEQUENCE of (OID, value) pairs (Intel SGX PCK Certificate and CRL Profile):

    .1  PPID (OCTET STRING)      .2  TCB: SEQUENCE of (.2.1-.2.16 INTEGER: SGX TCB component SVNs,
    .3  PCE-ID (OCTET STRING, 2)          .2.17 INTEGER: PCESVN, .2.18 OCTET STRING: CPUSVN)
    .4  FMSPC (OCTET STRING, 6)  .5-.7  SGX type, platform instance, configuration (not read here)

Only the fields TCB evaluation needs are read; a missing or malformed one is PckExtensionError.
The certificate is verified to the pinned Intel root before this runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from cryptography import x509

from attestation.errors import TdxCollateralFormatError

SGX_EXTENSION_OID = x509.ObjectIdentifier("1.2.840.113741.1.13.1")
_SEQUENCE, _INTEGER, _OCTET_STRING, _OID = 0x30, 0x02, 0x04, 0x06
SGX_COMPONENTS = 16


class PckExtensionError(TdxCollateralFormatError):
    """The PCK certificate lacks Intel's SGX extension or a field of it."""


@dataclass(frozen=True, slots=True)
class PckPlatform:
    """The platform a PCK certificate certifies: model (FMSPC), PCE and the SVNs of its TCB."""

    fmspc: bytes  # 6 bytes
    pce_id: bytes  # 2 bytes
    cpu_svns: tuple[int, ...]  # SGX TCB components 1-16
    pce_svn: int


def read_pck_platform(pck: x509.Certificate) -> PckPlatform:
    """Read FMSPC, PCE-ID, the SGX TCB component SVNs and PCESVN from a PCK certificate."""
    try:
        extension = pck.extensions.get_extension_for_oid(SGX_EXTENSION_OID).value
    except x509.ExtensionNotFound:
        raise PckExtensionError("the TDX quote's PCK certificate has no Intel SGX extension") from None
    fields = _pairs(_expect(extension.value, _SEQUENCE))  # type: ignore[attr-defined]
    tcb = _pairs(_field(fields, "2", _SEQUENCE))
    svns = tuple(_integer(_field(tcb, f"2.{index}", _INTEGER)) for index in range(1, SGX_COMPONENTS + 1))
    return PckPlatform(
        fmspc=_sized(_field(fields, "4", _OCTET_STRING), 6, "FMSPC"),
        pce_id=_sized(_field(fields, "3", _OCTET_STRING), 2, "PCE-ID"),
        cpu_svns=svns,
        pce_svn=_integer(_field(tcb, "2.17", _INTEGER)),
    )


def _read(data: bytes, offset: int) -> tuple[int, bytes, int]:
    """One DER TLV at `offset`: (tag, value, offset after it)."""
    if offset + 2 > len(data):
        raise PckExtensionError("the PCK certificate's SGX extension is truncated")
    tag, length, offset = data[offset], data[offset + 1], offset + 2
    if length & 0x80:
        count = length & 0x7F
        if count == 0 or count > 3 or offset + count > len(data):
            raise PckExtensionError("the PCK certificate's SGX extension has a malformed length")
        length, offset = int.from_bytes(data[offset:offset + count], "big"), offset + count
    if offset + length > len(data):
        raise PckExtensionError("the PCK certificate's SGX extension is truncated")
    return tag, data[offset:offset + length], offset + length


def _expect(data: bytes, tag: int) -> bytes:
    found, value, end = _read(data, 0)
    if found != tag or end != len(data):
        raise PckExtensionError("the PCK certificate's SGX extension is not the DER structure Intel specifies")
    return value


def _pairs(sequence: bytes) -> dict[str, tuple[int, bytes]]:
    """A SEQUENCE of SEQUENCE(OID, value) as {sub-identifier below the SGX OID: (tag, value)}."""
    pairs, offset = {}, 0
    while offset < len(sequence):
        tag, pair, offset = _read(sequence, offset)
        oid_tag, oid, after = _read(pair, 0) if tag == _SEQUENCE else (0, b"", 0)
        if oid_tag != _OID:
            raise PckExtensionError("the PCK certificate's SGX extension holds an entry that is not (OID, value)")
        value_tag, value, _ = _read(pair, after)
        pairs[_suffix(oid)] = (value_tag, value)
    return pairs


def _suffix(oid: bytes) -> str:
    """The dotted sub-identifiers after 1.2.840.113741.1.13.1, or the whole OID if it is not below it."""
    parts, value = [oid[0] // 40, oid[0] % 40] if oid else [], 0
    for byte in oid[1:]:
        value = (value << 7) | (byte & 0x7F)
        if not byte & 0x80:
            parts.append(value)
            value = 0
    dotted = ".".join(map(str, parts))
    prefix = SGX_EXTENSION_OID.dotted_string + "."
    return dotted[len(prefix):] if dotted.startswith(prefix) else dotted


def _field(pairs: dict[str, tuple[int, bytes]], name: str, tag: int) -> bytes:
    if name not in pairs or pairs[name][0] != tag:
        raise PckExtensionError(f"the PCK certificate's SGX extension lacks field {SGX_EXTENSION_OID.dotted_string}.{name}")
    return pairs[name][1]


def _integer(value: bytes) -> int:
    if not 1 <= len(value) <= 2:
        raise PckExtensionError("the PCK certificate's SGX extension holds an SVN out of range")
    return int.from_bytes(value, "big", signed=False)


def _sized(value: bytes, size: int, what: str) -> bytes:
    if len(value) != size:
        raise PckExtensionError(f"the PCK certificate's {what} is not {size} bytes")
    return value
