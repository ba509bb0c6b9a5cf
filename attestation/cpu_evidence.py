"""Verifying hardware CPU TEE evidence: Intel TDX quotes and AMD SEV-SNP reports, offline.

Three steps, each a function the verifier's checks call in order (and tests call
directly on genuine reports, whose report_data is not a Veil binding):

- :func:`verify_cpu_chain`: the certificate chain ends at a root the policy
  pins. SEV-SNP: VCEK → ASK → ARK of the VCEK's product line (Milan, Genoa, Turin),
  carried in the bundle; TDX: PCK → PCK Platform/Processor CA → Intel SGX Root
  CA, embedded in the quote.
- :func:`check_cpu_revocation`: the stapled CRLs (:mod:`attestation.revocation`):
  the ARK's CRL for SEV-SNP; the PCK CA's and the root CA's CRLs for TDX.
- :func:`verify_cpu_report`: the report's signature under the chain's leaf and
  the fields the leaf certifies (SEV-SNP: REPORTED_TCB and CHIP_ID, after the
  reserved bytes of its four TCB_VERSIONs, laid out as the VCEK's product lays
  them out; TDX: the QE report certifying the attestation key that signs the quote).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
from collections.abc import Collection
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from attestation import sev_snp, tdx
from attestation.bundle import CpuEvidence
from attestation.certs import fingerprint, load_der_chain, verify_chain
from attestation.cpu_reports import CpuReport, snp_cpu_report, tdx_cpu_report
from attestation.errors import ChainError, CpuReportFormatError
from attestation.revocation import CrlAgeLimits, check_chain_not_revoked

HARDWARE_CPU_KINDS: tuple[str, ...] = ("tdx", "sev-snp")
# Chain positions whose CRL must be stapled: AMD's ARK revokes ASKs (VCEKs are
# retired by TCB, not by CRL); Intel's PCK CA revokes PCKs and its root revokes the PCK CAs.
CRL_ISSUERS: dict[str, tuple[int, ...]] = {"sev-snp": (2,), "tdx": (1, 2)}


@dataclass(frozen=True, slots=True)
class VerifiedCpuChain:
    """A CPU TEE certificate chain that ends at a pinned root; leaf first."""

    kind: str
    certificates: tuple[x509.Certificate, ...]
    detail: str
    tdx_quote: tdx.TdxQuote | None = None  # TDX: parsed here, since the quote carries the chain
    product: str = ""  # SEV-SNP: the product line the verified VCEK names, which lays out its TCB


def verify_cpu_chain(cpu: CpuEvidence, pinned_roots: Collection[str], at_time: dt.datetime) -> VerifiedCpuChain:
    """Check the chain of a TDX quote or SEV-SNP report up to a pinned root."""
    if not cpu.report:
        raise CpuReportFormatError(f"the {cpu.kind} evidence holds no report or quote")
    if cpu.kind == "sev-snp":
        return _verify_snp_chain(cpu, pinned_roots, at_time)
    if cpu.kind == "tdx":
        return _verify_tdx_chain(cpu, pinned_roots, at_time)
    raise CpuReportFormatError(f"{cpu.kind!r} is not a hardware CPU TEE")


def check_cpu_revocation(cpu: CpuEvidence, chain: VerifiedCpuChain, at_time: dt.datetime, limits: CrlAgeLimits) -> str:
    """Check the CRLs the node stapled against the verified chain (the root's CRL under the root's age limit)."""
    return check_chain_not_revoked(
        chain.certificates, cpu.crls, issuers=CRL_ISSUERS[chain.kind], at_time=at_time, limits=limits,
        what=f"{chain.kind} chain",
    )


def verify_cpu_report(cpu: CpuEvidence, chain: VerifiedCpuChain) -> CpuReport:
    """Check the report's signature and the fields its certificate certifies; return its verified fields."""
    leaf = chain.certificates[0]
    if chain.tdx_quote is not None:
        tdx.verify_qe_report(chain.tdx_quote, leaf)
        tdx.verify_quote_signature(chain.tdx_quote)
        return dataclasses.replace(tdx_cpu_report(chain.tdx_quote), chip_id="tdx-pck:" + _key_digest(leaf))
    report = sev_snp.parse_snp_report(cpu.report)
    sev_snp.check_tcb_reserved_bytes(report, chain.product)  # the verified VCEK's product lays the TCBs out
    sev_snp.verify_report_signature(report, leaf)
    levels = sev_snp.check_vcek_certifies(report, leaf, chain.product)
    platform = sev_snp.SnpPlatform(chain.product, tuple(levels.items()), report.host_data, report.id_key_digest,
                                   report.author_key_digest)
    return dataclasses.replace(snp_cpu_report(report), chip_id="sev-snp:" + report.chip_id.hex(), snp=platform)


def _verify_snp_chain(cpu: CpuEvidence, pinned_roots: Collection[str], at_time: dt.datetime) -> VerifiedCpuChain:
    certificates = sev_snp.load_vcek_chain(cpu.cert_chain)
    verify_chain(certificates, pinned_roots, what="SEV-SNP", at_time=at_time)
    product = sev_snp.check_product_line(certificates)
    detail = f"VCEK → SEV-{product} → ARK-{product} {fingerprint(certificates[-1])[:16]}… (pinned)"
    return VerifiedCpuChain("sev-snp", certificates, detail, product=product)


def _verify_tdx_chain(cpu: CpuEvidence, pinned_roots: Collection[str], at_time: dt.datetime) -> VerifiedCpuChain:
    if cpu.cert_chain:
        raise ChainError("a TDX quote embeds its PCK chain; the bundle's cpu.cert_chain must be empty")
    quote = tdx.parse_tdx_quote(cpu.report)
    tdx.check_pck_chain_length(quote)
    certificates = load_der_chain(quote.pck_chain, "TDX PCK")
    verify_chain(certificates, pinned_roots, what="TDX PCK", at_time=at_time)
    detail = f"PCK → PCK CA → Intel SGX Root CA {fingerprint(certificates[-1])[:16]}… (pinned)"
    return VerifiedCpuChain("tdx", certificates, detail, quote)


def _key_digest(certificate: x509.Certificate) -> str:
    spki = certificate.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(spki).hexdigest()
