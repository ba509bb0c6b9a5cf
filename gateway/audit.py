"""The gateway's audit events: route decisions, admissions and evictions, through `audit`.

A route event holds the candidates' node ids, the chosen node, the outcome
and a coarse latency bucket. Nothing about the requester exists at this layer
to be recorded: no address, no header, no size, no exact time.
"""

from __future__ import annotations

import time

from audit import NodeAdmitted, NodeEvicted, RouteDecision, RouteOutcome, bucket_latency_ms
from audit.sink import AuditSink
from gateway.pool import Admission, Eviction


class GatewayAuditor:
    """Emits this gateway's events to one sink."""

    def __init__(self, sink: AuditSink, gateway_id: str) -> None:
        self.sink = sink
        self.gateway_id = gateway_id

    def route(self, candidates: tuple[str, ...], chosen: str | None, outcome: RouteOutcome, started: float) -> None:
        """One request routed (or refused); `started` is its `time.monotonic()` at arrival."""
        latency_ms = max(0.0, (time.monotonic() - started) * 1000.0)
        self.sink.emit(RouteDecision(
            gateway_id=self.gateway_id,
            candidates=candidates,
            chosen=chosen,
            outcome=outcome,
            latency_bucket=bucket_latency_ms(latency_ms),
        ))

    def admitted(self, admission: Admission) -> None:
        self.sink.emit(NodeAdmitted(
            gateway_id=self.gateway_id, node_id=admission.entry.node_id, capacity=admission.entry.capacity,
        ))

    def evicted(self, eviction: Eviction) -> None:
        self.sink.emit(NodeEvicted(gateway_id=self.gateway_id, node_id=eviction.node_id, reason=eviction.reason))

    def close(self) -> None:
        self.sink.close()
