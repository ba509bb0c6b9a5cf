"""What an H100/H200 node staples beside its GPU report, read from a folder its operator keeps current.

The node never calls NVIDIA at request time. An operator job fetches, for the
firmware the GPU runs and the certificates it holds, the driver and VBIOS RIMs
from NVIDIA's RIM service and fresh OCSP responses from NVIDIA's responder,
and writes them to ``$VEIL_GPU_COLLATERAL_DIR``::

    driver.swidtag, vbios.swidtag      the RIMs
    device-ocsp-1.der, -2.der, ...     the device chain's certificates 1 .. n-2 (leaf and root have none)
    driver-ocsp-0.der, ...             each RIM's signing chain, leaf first, root excluded
    vbios-ocsp-0.der, ...

Files are read at every collection, so a refresh needs no restart. Missing
files leave the bundle without them; verifiers then refuse it, naming what is
missing.
"""

from __future__ import annotations

import os
from pathlib import Path

from attestation.bundle import GpuRims, StapledRim
from attestation.ocsp import GPU_DEVICE_FIRST_CHECKED, RIM_FIRST_CHECKED

COLLATERAL_ENV = "VEIL_GPU_COLLATERAL_DIR"
_MAX_RESPONSES = 8


def collateral_dir() -> Path | None:
    """The configured folder, if any."""
    configured = os.environ.get(COLLATERAL_ENV)
    return Path(configured) if configured else None


def read_collateral(directory: Path | None) -> tuple[tuple[bytes, ...], GpuRims | None]:
    """(device chain OCSP responses, RIMs) from `directory`; empty when it is not configured."""
    if directory is None:
        return (), None
    device = _responses(directory, "device", GPU_DEVICE_FIRST_CHECKED)
    rims = None
    if (directory / "driver.swidtag").is_file() and (directory / "vbios.swidtag").is_file():
        rims = GpuRims(_rim(directory, "driver"), _rim(directory, "vbios"))
    return device, rims


def _rim(directory: Path, part: str) -> StapledRim:
    return StapledRim((directory / f"{part}.swidtag").read_bytes(), _responses(directory, part, RIM_FIRST_CHECKED))


def _responses(directory: Path, prefix: str, first: int) -> tuple[bytes, ...]:
    found = []
    for position in range(first, first + _MAX_RESPONSES):
        path = directory / f"{prefix}-ocsp-{position}.der"
        if not path.is_file():
            break
        found.append(path.read_bytes())
    return tuple(found)
