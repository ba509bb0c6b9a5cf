"""Coarse buckets for token counts and latencies.

Exact counts and durations would fingerprint individual requests (a prompt's
length, one user's time to first token), so audit events only ever carry the
bucket a value falls in. Edges grow roughly fourfold, or 2-2.5-fold for
latencies: resolution in proportion to magnitude, enough to tell short from
long work, too coarse to single out one request.
"""

from __future__ import annotations

from audit.errors import AuditSchemaError

# Token-count buckets: label -> inclusive lower bound. The last bucket is open.
TOKEN_BUCKET_EDGES: tuple[tuple[str, int], ...] = (
    ("0", 0),
    ("1-15", 1),
    ("16-63", 16),
    ("64-255", 64),
    ("256-1023", 256),
    ("1024-4095", 1024),
    ("4096-16383", 4096),
    ("16384+", 16384),
)

# Latency buckets in milliseconds: label -> inclusive lower bound.
LATENCY_BUCKET_EDGES_MS: tuple[tuple[str, int], ...] = (
    ("0-9ms", 0),
    ("10-49ms", 10),
    ("50-99ms", 50),
    ("100-249ms", 100),
    ("250-499ms", 250),
    ("500-999ms", 500),
    ("1-2.4s", 1000),
    ("2.5-4.9s", 2500),
    ("5-9.9s", 5000),
    ("10-29s", 10000),
    ("30s+", 30000),
)

TOKEN_BUCKETS: tuple[str, ...] = tuple(label for label, _ in TOKEN_BUCKET_EDGES)
LATENCY_BUCKETS: tuple[str, ...] = tuple(label for label, _ in LATENCY_BUCKET_EDGES_MS)


def _bucket(value: float, edges: tuple[tuple[str, int], ...]) -> str:
    chosen = edges[0][0]
    for label, lower in edges:
        if value < lower:
            break
        chosen = label
    return chosen


def bucket_tokens(count: int) -> str:
    """The token bucket label for `count` tokens (see `TOKEN_BUCKET_EDGES`)."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise AuditSchemaError("a token count must be a non-negative int; pass the number of tokens")
    return _bucket(count, TOKEN_BUCKET_EDGES)


def bucket_latency_ms(milliseconds: float) -> str:
    """The latency bucket label for a duration in milliseconds (see `LATENCY_BUCKET_EDGES_MS`)."""
    if isinstance(milliseconds, bool) or not isinstance(milliseconds, (int, float)):
        raise AuditSchemaError("a latency must be a number of milliseconds")
    if not milliseconds >= 0 or milliseconds == float("inf"):
        raise AuditSchemaError("a latency must be a finite, non-negative number of milliseconds")
    return _bucket(milliseconds, LATENCY_BUCKET_EDGES_MS)


def token_bucket_lower_bound(label: str) -> int:
    """The smallest token count that falls in bucket `label`."""
    return dict(TOKEN_BUCKET_EDGES)[label]
