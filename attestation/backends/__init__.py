"""Evidence backends behind one interface: `sim`, `nvml`, `tsm`, chosen by name or by probing."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Literal

from attestation.backends.base import AttestationBackend
from attestation.errors import BackendError, BackendUnavailableError

if TYPE_CHECKING:
    from policy import Policy

BackendName = Literal["sim", "nvml", "tsm"]
BACKEND_NAMES: tuple[str, ...] = ("sim", "nvml", "tsm")


class SimulatedAttestationWarning(UserWarning):
    """Emitted whenever probing falls back to the simulated backend."""


def get_backend(name: BackendName | None, *, policy: Policy | None = None, **kwargs: Any) -> AttestationBackend:
    """The backend `name`, or, for None, the first that works here: nvml, then tsm, then sim
    only when `policy` accepts simulated evidence (with a SimulatedAttestationWarning)."""
    if name is not None:
        return _construct(name, kwargs)
    reasons = []
    for candidate in ("nvml", "tsm"):
        try:
            return _construct(candidate, {})
        except BackendUnavailableError as error:
            reasons.append(f"{candidate}: {error}")
    if policy is not None and policy.attestation.allow_simulated:
        warnings.warn(
            f"no NVIDIA GPU or CPU TEE found; using SIMULATED attestation because policy "
            f"{policy.name!r} accepts it. This node protects nothing.",
            SimulatedAttestationWarning,
            stacklevel=2,
        )
        return _construct("sim", kwargs)
    raise BackendUnavailableError("no attestation backend works here; " + "; ".join(reasons))


def _construct(name: str, kwargs: dict[str, Any]) -> AttestationBackend:
    if name == "sim":
        from attestation.backends.sim import SimBackend

        return SimBackend(**kwargs)
    if name == "nvml":
        from attestation.backends.nvml import NvmlBackend

        return NvmlBackend(**kwargs)
    if name == "tsm":
        from attestation.backends.tsm import TsmBackend

        return TsmBackend(**kwargs)
    raise BackendError(f"unknown attestation backend {name!r}; choose one of {list(BACKEND_NAMES)}")


__all__ = ["BACKEND_NAMES", "AttestationBackend", "BackendName", "SimulatedAttestationWarning", "get_backend"]
