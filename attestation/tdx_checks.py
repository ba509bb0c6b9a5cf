"""The verifier's "tdx platform" check: Intel's stapled collateral vouches for the TDX platform, and the
policy's TDX pins match it. Evidence without a TDX quote has nothing to check here."""

from __future__ import annotations

from attestation.checks import Context, pinned_roots
from attestation.intel_collateral import CollateralLimits, verify_collateral
from attestation.revocation import CrlAgeLimits
from attestation.sgx_extensions import read_pck_platform
from attestation.tdx_tcb import check_pins, check_statuses, evaluate_tcb


def check_tdx_platform(ctx: Context) -> str:
    quote = ctx.cpu_chain.tdx_quote if ctx.cpu_chain is not None else None
    if quote is None or ctx.bundle.cpu is None:
        return "no TDX quote"
    attestation = ctx.policy.attestation
    platform = read_pck_platform(ctx.cpu_chain.certificates[0])  # type: ignore[union-attr]
    pins = check_pins(quote, platform, attestation)
    limits = CollateralLimits(attestation.tdx_max_collateral_age_s, attestation.tdx_min_tcb_evaluation_data_number,
                              CrlAgeLimits.of(attestation))
    collateral = verify_collateral(ctx.bundle.cpu.tdx_collateral, pinned_roots(ctx, attestation.pinned_roots),
                                   ctx.bundle.cpu.crls, ctx.chain_time, limits)
    statuses = check_statuses(evaluate_tcb(quote, platform, collateral), attestation)
    return (f"Intel TCB Info (evaluation data number {collateral.tcb_info.evaluation_number}) and QE Identity "
            f"verified: {statuses}; {pins}")
