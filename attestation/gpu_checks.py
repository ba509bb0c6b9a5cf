"""The verifier's GPU checks that use what a node staples: NVIDIA's RIMs and OCSP responses.

`reference measurements` runs after the report's signature is verified: both
RIMs must verify to a pinned RIM root and describe exactly the report's
driver, VBIOS and active measurements. `revocation` runs after binding and
freshness (an OCSP nonce is compared with the GPU nonce the binding checked):
every certificate of the device chain and of each RIM's signing chain must
have a fresh, good status.
"""

from __future__ import annotations

import datetime as dt

from attestation.binding import gpu_nonce
from attestation.checks import Context, pinned_roots
from attestation.errors import ReferenceMeasurementError, RevocationError
from attestation.ocsp import GPU_DEVICE_FIRST_CHECKED, RIM_FIRST_CHECKED, Freshness, verify_chain_status
from attestation.reference import verify_reference_measurements


def check_reference_measurements(ctx: Context) -> str:
    gpu = ctx.bundle.gpu
    if gpu is None or ctx.gpu_report is None:
        return "no GPU report"
    if gpu.rims is None:
        raise ReferenceMeasurementError(
            "the GPU evidence carries no driver and VBIOS RIMs, so its measurements cannot be compared with "
            "NVIDIA's reference values; the node's operator must staple the RIMs of the firmware it runs"
        )
    result = verify_reference_measurements(
        ctx.gpu_report, gpu.rims.driver.xml, gpu.rims.vbios.xml,
        pinned_roots(ctx, ctx.policy.attestation.pinned_rim_roots), at_time=ctx.chain_time,
    )
    ctx.rim_chains.update({"driver RIM": result.driver.chain, "VBIOS RIM": result.vbios.chain})
    return (
        f"driver {result.driver_version} and VBIOS {result.vbios_version} match their signed RIMs "
        f"({result.compared} golden values)"
    )


def check_revocation(ctx: Context) -> str:
    gpu = ctx.bundle.gpu
    if gpu is None:
        return "no GPU certificates"
    attestation = ctx.policy.attestation
    freshness = Freshness(
        now=dt.datetime.fromtimestamp(ctx.now, dt.timezone.utc),
        max_age_s=attestation.max_ocsp_age_s,
        max_skew_s=attestation.max_clock_skew_s,
        nonce=gpu_nonce(ctx.bundle.report_data),
    )
    counted = verify_chain_status(ctx.gpu_chain, gpu.ocsp, first=GPU_DEVICE_FIRST_CHECKED,
                                  what="GPU device chain", freshness=freshness)
    if gpu.rims is None:
        raise RevocationError("the GPU evidence carries no RIMs, so their signing chains' status is unknown")
    for what, rim in (("driver RIM", gpu.rims.driver), ("VBIOS RIM", gpu.rims.vbios)):
        counted += verify_chain_status(ctx.rim_chains[what], rim.ocsp, first=RIM_FIRST_CHECKED,
                                       what=f"{what} signing chain", freshness=freshness)
    return f"{counted} certificate(s) good per stapled OCSP responses at most {attestation.max_ocsp_age_s} s old"
