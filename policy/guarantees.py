"""Protections no policy may switch off, each tied to the requirement it serves."""

from __future__ import annotations

from policy.errors import WeakenedGuaranteeError
from policy.forbidden import NO_PRIVILEGED_ACCESS
from policy.model import Policy


def check_guarantees(policy: Policy) -> None:
    """Refuse a policy that lets a node run outside confidential mode or with debugging on."""
    attestation = policy.attestation
    if not attestation.debug_forbidden:
        raise WeakenedGuaranteeError(
            "attestation.debug_forbidden = false would admit nodes with CPU debug or GPU developer "
            f"tools on, which breaks {NO_PRIVILEGED_ACCESS}; set it to true",
            requirement=NO_PRIVILEGED_ACCESS,
        )
    if not attestation.required_confidential_mode:
        raise WeakenedGuaranteeError(
            "attestation.required_confidential_mode is empty: nodes outside a TEE could read user "
            f"data, which breaks {NO_PRIVILEGED_ACCESS}; require at least \"cpu\" or \"gpu\"",
            requirement=NO_PRIVILEGED_ACCESS,
        )
