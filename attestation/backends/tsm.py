"""CPU TEE quotes through Linux configfs-tsm (Intel TDX, AMD SEV-SNP guests).

Protocol: make a report entry under /sys/kernel/config/tsm/report, read its
`generation`, write exactly 64 bytes of report_data to `inblob`, read the quote
from `outblob`, then check that `generation` advanced by exactly one, so that
no other writer changed the request between our write and our read. The
vendor's certificates and CRLs the operator fetched are stapled to the quote
(:mod:`attestation.backends.collateral`).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from attestation.backends.base import bind, check_nonce, now_seconds
from attestation.backends.collateral import collateral_dir, load_collateral, load_tdx_collateral
from attestation.binding import REPORT_DATA_SIZE
from attestation.bundle import CpuEvidence, EvidenceBundle
from attestation.errors import BackendError, TsmUnavailableError
from attestation.measurement import Measurement

TSM_REPORT_ROOT = Path("/sys/kernel/config/tsm/report")
_PROVIDER_KINDS = {"tdx_guest": "tdx", "sev_guest": "sev-snp"}


def tsm_available(root: Path = TSM_REPORT_ROOT) -> bool:
    """Whether configfs-tsm report entries can be made here."""
    return root.is_dir()


def tsm_quote(report_data: bytes, root: Path = TSM_REPORT_ROOT) -> tuple[str, bytes]:
    """(kind, quote) for `report_data` from the CPU TEE behind configfs-tsm."""
    if len(report_data) != REPORT_DATA_SIZE:
        raise BackendError(f"configfs-tsm takes exactly {REPORT_DATA_SIZE} bytes of report_data")
    if not tsm_available(root):
        raise TsmUnavailableError(
            f"configfs-tsm is not available ({root} is missing): this is not a TDX or SEV-SNP guest, "
            "or configfs is not mounted; use --attestation nvml or sim"
        )
    entry = root / f"veil-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        entry.mkdir()
    except OSError as error:
        raise TsmUnavailableError(f"cannot create a configfs-tsm report entry: {error.strerror}") from None
    try:
        return _request(entry, report_data)
    finally:
        entry.rmdir()


def tsm_evidence(report_data: bytes, root: Path = TSM_REPORT_ROOT, collateral: Path | None = None) -> CpuEvidence:
    """The CPU TEE's quote over `report_data`, with the certificates and CRLs stapled from `collateral`."""
    kind, quote = tsm_quote(report_data, root)
    folder = collateral_dir() if collateral is None else collateral
    chain, crls = load_collateral(kind, folder)
    return CpuEvidence(kind, quote, chain, crls, load_tdx_collateral(folder) if kind == "tdx" else None)


def _request(entry: Path, report_data: bytes) -> tuple[str, bytes]:
    if not (entry / "inblob").exists():
        raise TsmUnavailableError(f"{entry.parent} is not a configfs-tsm report directory (no inblob appeared)")
    before = _generation(entry)
    (entry / "inblob").write_bytes(report_data)
    quote = (entry / "outblob").read_bytes()
    if _generation(entry) != before + 1:
        raise BackendError("another writer used the configfs-tsm entry during the request; collect again")
    provider = (entry / "provider").read_text().strip()
    if provider not in _PROVIDER_KINDS:
        raise TsmUnavailableError(f"configfs-tsm provider {provider!r} is not supported (tdx_guest, sev_guest)")
    return _PROVIDER_KINDS[provider], quote


def _generation(entry: Path) -> int:
    return int((entry / "generation").read_text().strip())


class TsmBackend:
    """CPU-only evidence: a TDX quote or SEV-SNP report binding the key configuration."""

    name = "tsm"

    def __init__(self, root: Path = TSM_REPORT_ROOT, collateral: Path | None = None) -> None:
        if not tsm_available(root):
            tsm_quote(bytes(REPORT_DATA_SIZE), root)  # raises the explanatory TsmUnavailableError
        self._root = root
        self._collateral = collateral

    def collect(self, key_config: bytes, measurement: Measurement, nonce: bytes, receipt_key: bytes) -> EvidenceBundle:
        check_nonce(nonce)
        timestamp = now_seconds()
        bound = bind(key_config, receipt_key, measurement, nonce, timestamp, b"")
        return EvidenceBundle(
            backend=self.name, key_config=bytes(key_config), receipt_key=bytes(receipt_key), measurement=measurement,
            nonce=bytes(nonce), timestamp=timestamp, report_data=bound,
            cpu=tsm_evidence(bound, self._root, self._collateral), gpu=None,
        )
