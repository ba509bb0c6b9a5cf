"""Offline verification of an NVIDIA Hopper (H100/H200) GPU attestation report.

The chain (leaf first) must lead to a pinned root, the SPDM transcript's
signature must verify under the leaf's ECDSA P-384 key, and the request nonce
(offset 4) must be the expected one. The verifier then compares the
measurement blocks with NVIDIA's signed RIMs (attestation.reference) and checks
the stapled OCSP responses (attestation.ocsp).

Certificate validity is checked at `at_time` (default: now). Recorded vectors
whose chain has since expired are verified by passing the time at which they
were produced; production callers never pass it.
"""

from __future__ import annotations

import datetime as dt
import hmac
from collections.abc import Collection, Sequence

from attestation import spdm
from attestation.certs import load_der_chain, verify_chain
from attestation.errors import BindingError


def verify_gpu_report(
    report: bytes,
    chain: Sequence[bytes],
    pinned_roots: Collection[str],
    *,
    expected_nonce: bytes,
    at_time: dt.datetime | None = None,
) -> spdm.SpdmReport:
    """Verify chain, signature and nonce of a GPU report; return the parsed report or raise."""
    when = at_time or dt.datetime.now(dt.timezone.utc)
    leaf = verify_chain(load_der_chain(chain, "GPU"), pinned_roots, what="GPU", at_time=when)
    parsed = spdm.parse_report(report)
    spdm.verify_report_signature(parsed, leaf)
    if not hmac.compare_digest(parsed.request_nonce, expected_nonce):
        raise BindingError("the GPU report answers a different nonce than the one expected")
    return parsed
