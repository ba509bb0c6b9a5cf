"""CPU TEE reports: where each format keeps REPORT_DATA and its debug flag.

- Intel TDX quote, version 4: 48-byte header (tee_type 0x81 at offset 4), then
  the TD report body; TDATTRIBUTES at 168 (bit 0: DEBUG), REPORTDATA at 568..632.
- AMD SEV-SNP attestation report: POLICY at 0x08 (bit 19: DEBUG allowed),
  REPORT_DATA at 0x50..0x90, signature algorithm at 0x34 (1: ECDSA P-384).
- Veil's simulated CPU report: magic ``VSIMCPU1``, attributes (uint64 LE; bit 0
  debug, bit 63 simulated), report_data (64), ECDSA P-384 signature r ‖ s (96)
  over everything before it, by the leaf of its simulated chain.

Intel's and AMD's quote signatures and certificate chains are not verified
yet: the verifier reports this as the `cpu-quote-signature` gap and accepts
such quotes only under a policy that names that gap.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

from attestation.errors import EvidenceFormatError

SIM_MAGIC = b"VSIMCPU1"
SIM_REPORT_SIZE = 8 + 8 + 64 + 96
SIM_DEBUG = 1 << 0
SIM_SIMULATED = 1 << 63
TDX_TEE_TYPE = 0x81
TDX_MIN_SIZE = 632
SNP_REPORT_SIZE = 0x4A0
SNP_DEBUG = 1 << 19


class CpuReportFormatError(EvidenceFormatError):
    """A CPU TEE report does not have its format's layout."""


@dataclass(frozen=True, slots=True)
class CpuReport:
    """The fields the verifier uses from any CPU TEE report."""

    kind: str
    report_data: bytes
    debug: bool
    simulated: bool
    signed_part: bytes
    signature: bytes  # raw r ‖ s for the simulated format; empty where not verified here


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


def _parse_tdx(quote: bytes) -> CpuReport:
    if len(quote) < TDX_MIN_SIZE:
        raise CpuReportFormatError("TDX quote is too short to hold a TD report body")
    version, _, tee_type = struct.unpack_from("<HHI", quote, 0)
    if version != 4 or tee_type != TDX_TEE_TYPE:
        raise CpuReportFormatError("not a TDX quote version 4 (tee_type 0x81)")
    (td_attributes,) = struct.unpack_from("<Q", quote, 168)
    return CpuReport("tdx", quote[568:632], bool(td_attributes & 1), False, quote[:632], b"")


def _parse_snp(report: bytes) -> CpuReport:
    if len(report) != SNP_REPORT_SIZE:
        raise CpuReportFormatError("SEV-SNP attestation report must be 0x4A0 bytes")
    (policy,) = struct.unpack_from("<Q", report, 0x08)
    (signature_algorithm,) = struct.unpack_from("<I", report, 0x34)
    if signature_algorithm != 1:
        raise CpuReportFormatError("SEV-SNP report is not signed with ECDSA P-384")
    return CpuReport("sev-snp", report[0x50:0x90], bool(policy & SNP_DEBUG), False, report[:0x2A0], b"")
