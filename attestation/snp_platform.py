"""The policy's floor and pins on an SEV-SNP platform, checked once its VCEK certifies the report.

- TCB floor (the verifier's `revocation` step): each component's security patch level in
  REPORTED_TCB (boot loader, TEE, SNP firmware, microcode; Turin also FMC) must meet the minimum the
  policy sets for the product line its VCEK names. AMD retires a flawed platform by a TCB recovery
  event, not by a CRL: VCEKs of the old TCB stay valid, so only a floor refuses them.
- Pins (the verifier's `measurement` step): HOST_DATA, and the ID block's ID-key and author-key
  digests, must each be one the policy lists, where it lists any.

Refusals name the field and the policy's value, never the evidence's bytes.
"""

from __future__ import annotations

from attestation.checks import Context
from attestation.errors import (
    AuthorKeyDigestError,
    HostDataError,
    IdKeyDigestError,
    MeasurementNotAllowedError,
    TcbBelowMinimumError,
    TcbMinimumMissingError,
)
from attestation.sev_snp import TCB_COMPONENT_NAMES, SnpPlatform
from policy.model import AttestationPolicy, SnpTcbMinimum

# Pin, the report's field it compares, the policy key listing the accepted values, and the refusal.
_PINS: tuple[tuple[str, str, str, type[MeasurementNotAllowedError]], ...] = (
    ("host_data", "HOST_DATA", "sev_snp_host_data", HostDataError),
    ("id_key_digest", "ID_KEY_DIGEST", "sev_snp_id_key_digests", IdKeyDigestError),
    ("author_key_digest", "AUTHOR_KEY_DIGEST", "sev_snp_author_key_digests", AuthorKeyDigestError),
)


def check_platform_tcb(ctx: Context) -> str:
    """The revocation step's SEV-SNP part; "" without an SEV-SNP report."""
    platform = _platform(ctx)
    return "" if platform is None else check_minimum_tcb(platform, ctx.policy.attestation.sev_snp_min_tcb)


def check_platform_pins(ctx: Context) -> str:
    """The measurement step's SEV-SNP part; "" without an SEV-SNP report."""
    platform = _platform(ctx)
    return "" if platform is None else check_pins(platform, ctx.policy.attestation)


def check_minimum_tcb(platform: SnpPlatform, minimums: tuple[SnpTcbMinimum, ...]) -> str:
    """Each patch level of `platform` must meet the minimum for its product; none listed compares nothing."""
    levels = ", ".join(f"{TCB_COMPONENT_NAMES[component]} {level}" for component, level in platform.tcb)
    if not minimums:
        return f"SEV-SNP {platform.product} TCB ({levels}): the policy sets no minimum"
    minimum = next((entry for entry in minimums if entry.product == platform.product), None)
    if minimum is None:
        raise TcbMinimumMissingError(
            f"the SEV-SNP VCEK is for {platform.product}, for which the policy sets no minimum TCB "
            f"(attestation.sev_snp_min_tcb lists {', '.join(entry.product for entry in minimums)})"
        )
    for component, level in platform.tcb:
        floor = getattr(minimum, component)
        if floor is not None and level < floor:
            raise TcbBelowMinimumError(
                f"the SEV-SNP platform's {TCB_COMPONENT_NAMES[component]} security patch level is below the "
                f"policy's minimum of {floor} for {platform.product} (attestation.sev_snp_min_tcb): AMD has "
                "published flaws in what it runs; update the host's firmware and microcode"
            )
    return f"SEV-SNP {platform.product} TCB ({levels}) meets the policy's minimum"


def check_pins(platform: SnpPlatform, policy: AttestationPolicy) -> str:
    """HOST_DATA and the ID block's key digests must be ones the policy pins, where it pins any."""
    pinned = []
    for attribute, field, key, error in _PINS:
        accepted = getattr(policy, key)
        if not accepted:
            continue
        if getattr(platform, attribute).hex() not in accepted:
            raise error(f"the SEV-SNP report's {field} is not one the policy pins (attestation.{key}); "
                        "the VM was not launched as a listed release launches")
        pinned.append(field)
    return f"SEV-SNP {', '.join(pinned)} pinned" if pinned else "no SEV-SNP HOST_DATA or ID block pinned"


def _platform(ctx: Context) -> SnpPlatform | None:
    return ctx.cpu_report.snp if ctx.cpu_report is not None else None
