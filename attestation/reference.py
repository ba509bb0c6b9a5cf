"""A GPU report against NVIDIA's reference values: the driver RIM and the VBIOS RIM, both signed.

The report's opaque data names the driver version (field 3, text) and the
VBIOS version (field 6, eight bytes); each must be the version its RIM
describes. Every index a RIM marks active must then have a measurement block
(RIM index i is SPDM block i + 1) equal to one of that index's alternatives.
An index active in both RIMs is refused as ambiguous. Mismatches are reported
together, by RIM index, so an operator sees every firmware part that differs.
"""

from __future__ import annotations

import datetime as dt
import hmac
from collections.abc import Collection
from dataclasses import dataclass

from attestation import spdm
from attestation.errors import FirmwareVersionError, MeasurementMismatchError, RimFormatError
from attestation.rim import Rim, verify_rim

OPAQUE_VBIOS_VERSION = 6
VBIOS_VERSION_SIZE = 8


@dataclass(frozen=True, slots=True)
class ReferenceResult:
    """What matched: the versions, how many golden values were compared, and the verified RIMs."""

    driver_version: str
    vbios_version: str
    compared: int
    driver: Rim
    vbios: Rim


def verify_reference_measurements(
    report: spdm.SpdmReport,
    driver_xml: bytes,
    vbios_xml: bytes,
    pinned_rim_roots: Collection[str],
    *,
    at_time: dt.datetime,
) -> ReferenceResult:
    """Verify both RIMs to a pinned RIM root, then match versions and every active measurement."""
    driver = verify_rim(driver_xml, pinned_rim_roots, what="driver RIM", at_time=at_time)
    vbios = verify_rim(vbios_xml, pinned_rim_roots, what="VBIOS RIM", at_time=at_time)
    driver_version, vbios_version = report_driver_version(report), report_vbios_version(report)
    _same_version(driver_version, driver.version, "driver")
    _same_version(vbios_version, vbios.version, "VBIOS")
    compared = compare_measurements(report, (driver, vbios))
    return ReferenceResult(driver_version, vbios_version, compared, driver, vbios)


def compare_measurements(report: spdm.SpdmReport, rims: tuple[Rim, ...]) -> int:
    """Check every active golden value against the report's blocks; return how many were compared."""
    golden = _golden_by_index(rims)
    blocks = {block.index: block.value for block in report.blocks}
    differing = tuple(
        index for index, alternatives in sorted(golden.items())
        if not any(hmac.compare_digest(blocks.get(index + 1, b""), value) for value in alternatives)
    )
    if differing:
        raise MeasurementMismatchError(
            f"the GPU's measurements differ from NVIDIA's reference values at RIM index(es) "
            f"{', '.join(map(str, differing))}: its firmware is not the firmware the RIMs describe",
            differing,
        )
    return len(golden)


def report_driver_version(report: spdm.SpdmReport) -> str:
    """The driver version the report's opaque data states, e.g. '545.00'."""
    value = report.opaque_value(spdm.OPAQUE_DRIVER_VERSION)
    text = (value or b"").split(b"\x00", 1)[0]
    if not text or not text.isascii():
        raise FirmwareVersionError("the GPU report states no driver version in its opaque data")
    return text.decode("ascii")


def report_vbios_version(report: spdm.SpdmReport) -> str:
    """The VBIOS version the report's opaque data states, formatted as NVIDIA writes it: 96.00.5E.00.01."""
    value = report.opaque_value(OPAQUE_VBIOS_VERSION)
    if value is None or len(value) != VBIOS_VERSION_SIZE:
        raise FirmwareVersionError("the GPU report states no VBIOS version in its opaque data")
    number = int.from_bytes(value, "little")
    low = f"{number & 0xFFFFFFFF:08X}"
    return ".".join(low[at : at + 2] for at in range(0, 8, 2)) + f".{(number >> 32) & 0xFF:02X}"


def encode_vbios_version(version: str) -> bytes:
    """The opaque-data bytes of a VBIOS version string (the inverse of report_vbios_version)."""
    parts = version.split(".")
    low = int("".join(parts[:4]), 16)
    return (low | int(parts[4], 16) << 32).to_bytes(VBIOS_VERSION_SIZE, "little")


def _same_version(reported: str, described: str, part: str) -> None:
    if reported.upper() != described.upper():
        raise FirmwareVersionError(
            f"the GPU runs {part} {reported} but the {part} RIM describes {described}; "
            f"fetch the RIM for the {part} this node runs"
        )


def _golden_by_index(rims: tuple[Rim, ...]) -> dict[int, tuple[bytes, ...]]:
    golden: dict[int, tuple[bytes, ...]] = {}
    for rim in rims:
        for measurement in rim.measurements:
            if measurement.index in golden:
                raise RimFormatError(f"RIM index {measurement.index} is active in more than one RIM")
            golden[measurement.index] = measurement.alternatives
    return golden
