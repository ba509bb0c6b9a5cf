"""CPU TEE reports: the fields the verifier uses, whatever the format.

- Intel TDX quote, version 4 (:mod:`attestation.tdx`): REPORTDATA, TDATTRIBUTES
  (bits 0-7: TD under debug), MRTD and RTMR0-3.
- AMD SEV-SNP attestation report (:mod:`attestation.sev_snp`): REPORT_DATA,
  POLICY (bit 19 DEBUG, bit 18 MIGRATE_MA), VMPL and MEASUREMENT.
- Veil's simulated CPU report: magic ``VSIMCPU1``, attributes (uint64 LE; bit 0
  debug, bit 63 simulated), report_data (64), ECDSA P-384 signature r ‖ s (96)
  over everything before it, by the leaf of its simulated chain.

Parsing checks layout only; :mod:`attestation.cpu_evidence` verifies the
signatures and chains of hardware reports.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

from attestation.errors import CpuReportFormatError
from attestation.sev_snp import SnpPlatform, SnpReport, parse_snp_report
from attestation.tdx import TdxQuote, parse_tdx_quote

SIM_MAGIC = b"VSIMCPU1"
SIM_REPORT_SIZE = 8 + 8 + 64 + 96
SIM_DEBUG = 1 << 0
SIM_SIMULATED = 1 << 63


@dataclass(frozen=True, slots=True)
class LaunchMeasurement:
    """What the CPU TEE measured when it launched the VM: SEV-SNP MEASUREMENT, or TDX MRTD and RTMR0-3."""

    tee: str
    measurement: bytes  # SEV-SNP MEASUREMENT or TDX MRTD (48 bytes)
    rtmrs: tuple[bytes, ...] = ()  # TDX RTMR0-3; empty for SEV-SNP


@dataclass(frozen=True, slots=True)
class CpuReport:
    """The fields the verifier uses from any CPU TEE report."""

    kind: str
    report_data: bytes
    debug: bool
    simulated: bool
    signed_part: bytes
    signature: bytes  # raw r ‖ s for the simulated format; hardware formats are verified by their modules
    migration_agent: bool = False  # a migration agent may export the guest's memory (SNP MIGRATE_MA, TDX MIGRATABLE)
    vendor_module: bool = True  # TDX: the TDX module is Intel's (SEV-SNP's firmware is certified by its VCEK)
    vmpl: int = 0  # SEV-SNP: the VM privilege level that asked for the report
    launch: LaunchMeasurement | None = None  # None for simulated reports
    chip_id: str | None = None  # the CPU's identity, set once its certificate chain is verified
    snp: SnpPlatform | None = None  # SEV-SNP: TCB, HOST_DATA and ID block digests, once the VCEK certifies them


def parse_cpu_report(kind: str, report: bytes) -> CpuReport:
    """Parse a report of `kind` ("sim", "tdx", "sev-snp")."""
    parsers = {"sim": _parse_sim, "tdx": _parse_tdx, "sev-snp": _parse_snp}
    if kind not in parsers:
        raise CpuReportFormatError("unknown CPU report kind")
    return parsers[kind](report)


def build_sim_report(report_data: bytes, *, debug: bool, sign: Callable[[bytes], bytes]) -> bytes:
    """A signed simulated CPU report (always marked simulated)."""
    attributes = SIM_SIMULATED | (SIM_DEBUG if debug else 0)
    body = SIM_MAGIC + struct.pack("<Q", attributes) + report_data
    return body + sign(body)


def _parse_sim(report: bytes) -> CpuReport:
    if len(report) != SIM_REPORT_SIZE or report[:8] != SIM_MAGIC:
        raise CpuReportFormatError("simulated CPU report has the wrong size or magic")
    (attributes,) = struct.unpack_from("<Q", report, 8)
    return CpuReport("sim", report[16:80], bool(attributes & SIM_DEBUG), bool(attributes & SIM_SIMULATED),
                     report[:-96], report[-96:])


def tdx_cpu_report(quote: TdxQuote) -> CpuReport:
    """The verifier's view of a parsed TDX quote."""
    return CpuReport("tdx", quote.report_data, quote.debug or quote.debug_module, False, quote.signed, quote.signature,
                     migration_agent=quote.migratable, vendor_module=quote.intel_module,
                     launch=LaunchMeasurement("tdx", quote.mrtd, quote.rtmrs))


def snp_cpu_report(report: SnpReport) -> CpuReport:
    """The verifier's view of a parsed SEV-SNP report."""
    return CpuReport("sev-snp", report.report_data, report.debug, False, report.signed, b"",
                     migration_agent=report.migration_agent, vmpl=report.vmpl,
                     launch=LaunchMeasurement("sev-snp", report.measurement))


def _parse_tdx(quote: bytes) -> CpuReport:
    return tdx_cpu_report(parse_tdx_quote(quote))


def _parse_snp(report: bytes) -> CpuReport:
    return snp_cpu_report(parse_snp_report(report))
