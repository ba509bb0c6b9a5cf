"""Prometheus metrics made only of the audit events' typed fields, and a few gauges of counts.

Apple PCC's rule, which the audit schema already follows, holds here too: only pre-specified,
structured metrics leave a process. Every metric Veil exports is listed in `METRICS` with its
labels, and a label's values are members of the audit schema's enums or its bucket labels, never
anything a request wrote: no node id, no gateway id, no address, no key id, no exact size or time.
Counters move when an audit event is emitted (`MetricsSink` sits in front of a process's audit
sink), so a scrape tells nothing the audit stream does not already hold, and less: no identifier
at all. Gauges are counts (requests in flight, nodes admitted, capacity) read at scrape time.

Each process owns its own registry: nothing of Prometheus' default registry (process and platform
collectors that list command lines or file descriptors) is exported.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    disable_created_metrics,
    generate_latest,
)

from audit.events import (
    AuditEvent,
    BlocksZeroed,
    EvidenceRefreshed,
    NodeAdmitted,
    NodeEvicted,
    NodeStopped,
    ProofsRefreshed,
    RequestFinished,
    RouteDecision,
    TokenDecisions,
)
from audit.sink import AuditSink

CONTENT_TYPE = CONTENT_TYPE_LATEST
# prometheus-client exports, beside each labelled counter, a `_created` series: the exact time its
# labels were first seen, which would date a request (the first with that status and bucket) to
# the microsecond. Veil's metrics carry no time but the scrape's.
disable_created_metrics()


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One exported metric: Prometheus type, label names (whose values are the schema's enums or buckets), help."""

    kind: str  # "counter" or "gauge"
    labels: tuple[str, ...]
    help: str


# The complete set, listed in SECURITY.md and fixed by tests/test_ops_metrics.py. Counter names are
# given without Prometheus' `_total` suffix, which the exposition adds.
METRICS: dict[str, MetricSpec] = {
    # a node
    "veil_node_requests": MetricSpec("counter", ("status", "latency_bucket"), "requests ended, by status and latency bucket"),
    "veil_node_prompt_tokens": MetricSpec("counter", ("bucket",), "requests ended, by their prompt's token bucket"),
    "veil_node_output_tokens": MetricSpec("counter", ("bucket",), "requests ended, by their output's token bucket"),
    "veil_node_blocks_zeroed": MetricSpec("counter", (), "freed KV blocks zeroed"),
    "veil_node_residue_blocks": MetricSpec("counter", (), "zeroed blocks a residue check found not all-zero (a red line)"),
    "veil_node_evidence_refreshes": MetricSpec("counter", ("outcome",), "evidence collections, by outcome"),
    "veil_node_stops": MetricSpec("counter", ("reason",), "node stops (engine core lost, shutdown), by reason"),
    "veil_node_proof_refreshes": MetricSpec("counter", ("outcome", "proofs"), "transparency proof refreshes, by "
                                            "outcome and the stapled proofs' freshness after it (alert on aging)"),
    "veil_node_in_flight": MetricSpec("gauge", (), "requests in flight on this node (its queue depth)"),
    "veil_node_capacity": MetricSpec("gauge", (), "concurrent requests this node serves"),
    # a gateway
    "veil_gateway_routes": MetricSpec("counter", ("outcome", "latency_bucket"), "requests routed, by outcome and latency bucket"),
    "veil_gateway_admissions": MetricSpec("counter", (), "node admissions (first and after a key rotation)"),
    "veil_gateway_evictions": MetricSpec("counter", ("reason",), "node evictions, by reason"),
    "veil_gateway_token_decisions": MetricSpec("counter", ("decision",), "Privacy Pass tokens accepted or refused, by reason"),
    "veil_gateway_nodes": MetricSpec("gauge", (), "nodes admitted to the directory"),
    "veil_gateway_in_flight": MetricSpec("gauge", (), "requests in flight through this gateway"),
    # a relay
    "veil_relay_requests": MetricSpec("counter", ("route", "status_class"), "requests forwarded, by route and status class"),
    "veil_relay_in_flight": MetricSpec("gauge", (), "requests in flight through this relay"),
    # an issuer
    "veil_issuer_token_requests": MetricSpec("counter", ("outcome",), "token requests, by outcome"),
    # every process with an audit sink
    "veil_audit_events_dropped": MetricSpec("gauge", (), "audit events a full sink queue dropped since it opened"),
}


class Metrics:
    """One process's registry of the metrics in `METRICS` (created on first use), and its exposition."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._made: dict[str, Counter | Gauge] = {}

    def counter(self, name: str) -> Counter:
        return self._metric(name, "counter")  # type: ignore[return-value]

    def gauge(self, name: str, read: Callable[[], float]) -> None:
        """Export `name` as a gauge whose value `read` gives at each scrape."""
        gauge = self._metric(name, "gauge")
        gauge.set_function(read)  # type: ignore[union-attr]

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def _metric(self, name: str, kind: str) -> Counter | Gauge:
        spec = METRICS[name]  # a KeyError here is a programming error: only listed metrics exist
        if spec.kind != kind:
            raise TypeError(f"{name} is a {spec.kind}")
        metric = self._made.get(name)
        if metric is None:
            cls = Counter if kind == "counter" else Gauge
            metric = self._made[name] = cls(name, spec.help, spec.labels, registry=self.registry)
        return metric

    def observe(self, event: AuditEvent) -> None:
        """Count one audit event (its enum and bucket fields only)."""
        observer = _OBSERVERS.get(type(event))
        if observer is not None:
            observer(self, event)


def _request(metrics: Metrics, event: RequestFinished) -> None:
    metrics.counter("veil_node_requests").labels(event.status.value, event.latency_bucket).inc()
    metrics.counter("veil_node_prompt_tokens").labels(event.prompt_tokens_bucket).inc()
    metrics.counter("veil_node_output_tokens").labels(event.output_tokens_bucket).inc()


def _zeroed(metrics: Metrics, event: BlocksZeroed) -> None:
    metrics.counter("veil_node_blocks_zeroed").inc(event.blocks)
    metrics.counter("veil_node_residue_blocks").inc(event.residue_blocks)


def _token_decisions(metrics: Metrics, event: TokenDecisions) -> None:
    decisions = metrics.counter("veil_gateway_token_decisions")
    if event.accepted:
        decisions.labels("accepted").inc(event.accepted)
    for reason, count in event.refused.items():
        if count:
            decisions.labels(str(reason)).inc(count)


_OBSERVERS: dict[type, Callable[[Metrics, AuditEvent], None]] = {
    RequestFinished: _request,  # type: ignore[dict-item]
    BlocksZeroed: _zeroed,  # type: ignore[dict-item]
    EvidenceRefreshed: lambda m, e: m.counter("veil_node_evidence_refreshes").labels(e.outcome.value).inc(),
    NodeStopped: lambda m, e: m.counter("veil_node_stops").labels(e.reason.value).inc(),
    ProofsRefreshed: lambda m, e: m.counter("veil_node_proof_refreshes").labels(e.outcome.value, e.proofs.value).inc(),
    RouteDecision: lambda m, e: m.counter("veil_gateway_routes").labels(e.outcome.value, e.latency_bucket).inc(),
    NodeAdmitted: lambda m, e: m.counter("veil_gateway_admissions").inc(),
    NodeEvicted: lambda m, e: m.counter("veil_gateway_evictions").labels(e.reason.value).inc(),
    TokenDecisions: _token_decisions,  # type: ignore[dict-item]
}


class MetricsSink:
    """An audit sink that counts each event into `metrics`, then passes it to `inner`."""

    def __init__(self, inner: AuditSink, metrics: Metrics) -> None:
        self.inner = inner
        self.metrics = metrics
        # A JSON lines sink counts what its full queue dropped (its EventsDropped never passes through emit).
        metrics.gauge("veil_audit_events_dropped", lambda: getattr(inner, "dropped", 0))

    def emit(self, event: AuditEvent) -> None:
        self.inner.emit(event)  # validates it: an event that fails validation is never counted
        self.metrics.observe(event)

    def flush(self) -> None:
        self.inner.flush()

    def close(self) -> None:
        self.inner.close()


class MetricsServer:
    """`/metrics` on a port of its own (a node's: off unless asked for), served from a daemon thread."""

    def __init__(self, metrics: Metrics, host: str, port: int) -> None:
        from prometheus_client import start_wsgi_server

        # prometheus-client's handler logs nothing; its server answers the exposition on every path.
        self._server, self._thread = start_wsgi_server(port, addr=host, registry=metrics.registry)
        self.port: int = self._server.server_port

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


def serve_metrics(metrics: Metrics, listen: str) -> MetricsServer:
    """A `MetricsServer` for `metrics` on `listen` (`--metrics-listen` HOST:PORT, port 0 picks a free one);
    OSError saying what to change when the address is malformed or cannot be bound."""
    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit() or int(port) > 65535:
        raise OSError("--metrics-listen must look like HOST:PORT (for example 127.0.0.1:9400)")
    try:
        return MetricsServer(metrics, host.strip("[]"), int(port))
    except OSError as error:
        raise OSError(f"cannot serve metrics on {listen} ({error.strerror}); choose another address") from None
