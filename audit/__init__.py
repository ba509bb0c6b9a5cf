"""Veil's audit channel: typed events, sinks, and the reports built from them.

Audit events are the only data a node emits besides ciphertext. Every field is
a number, a bucket label, an enum member or an identifier of a node, gateway,
policy or release, and validation at construction and at emission rejects
anything else, so no event can carry a prompt, a completion or any free text.

Reports (`audit.reports`) need the `reports` extra (scipy, matplotlib); this
package itself needs neither.
"""

from audit.buckets import bucket_latency_ms, bucket_tokens
from audit.errors import AuditError, AuditReportError, AuditSchemaError, AuditSinkError
from audit.events import (
    SCHEMA_VERSION,
    AttestationBackend,
    AuditEvent,
    AuditRecord,
    BlocksZeroed,
    EventsDropped,
    EvictionReason,
    EvidenceOutcome,
    EvidenceRefreshed,
    NodeAdmitted,
    NodeEvicted,
    NodeStarted,
    NodeStopped,
    ProofFreshness,
    ProofRefreshOutcome,
    ProofsRefreshed,
    RequestFinished,
    RequestStatus,
    RouteDecision,
    RouteOutcome,
    StopReason,
    TokenDecisions,
    TokenRefusal,
)
from audit.sink import AuditSink, JsonLinesSink, MemorySink, NullSink, open_sink

__all__ = [
    "SCHEMA_VERSION",
    "AttestationBackend",
    "AuditError",
    "AuditEvent",
    "AuditRecord",
    "AuditReportError",
    "AuditSchemaError",
    "AuditSink",
    "AuditSinkError",
    "BlocksZeroed",
    "EventsDropped",
    "EvictionReason",
    "EvidenceOutcome",
    "EvidenceRefreshed",
    "JsonLinesSink",
    "MemorySink",
    "NodeAdmitted",
    "NodeEvicted",
    "NodeStarted",
    "NodeStopped",
    "NullSink",
    "ProofFreshness",
    "ProofRefreshOutcome",
    "ProofsRefreshed",
    "RequestFinished",
    "RequestStatus",
    "RouteDecision",
    "RouteOutcome",
    "StopReason",
    "TokenDecisions",
    "TokenRefusal",
    "bucket_latency_ms",
    "bucket_tokens",
    "open_sink",
]
