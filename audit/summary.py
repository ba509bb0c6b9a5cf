"""`veil audit summary`: a one-screen overview of a fleet's audit files."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from audit.events import (
    BlocksZeroed,
    EventsDropped,
    EvidenceRefreshed,
    NodeAdmitted,
    NodeEvicted,
    NodeStarted,
    NodeStopped,
    RequestFinished,
    RouteDecision,
    TokenDecisions,
)
from audit.records import AuditLog


@dataclass(slots=True)
class FleetSummary:
    """Counts over a set of audit files; nothing in it refers to a user."""

    files: int = 0
    truncated_tails: int = 0
    first_ts: int | None = None
    last_ts: int | None = None
    kinds: Counter[str] = field(default_factory=Counter)
    nodes_started: set[str] = field(default_factory=set)
    stop_reasons: Counter[str] = field(default_factory=Counter)
    evidence: Counter[str] = field(default_factory=Counter)
    request_statuses: Counter[str] = field(default_factory=Counter)
    route_outcomes: Counter[str] = field(default_factory=Counter)
    gateways: set[str] = field(default_factory=set)
    admitted: set[str] = field(default_factory=set)
    eviction_reasons: Counter[str] = field(default_factory=Counter)
    zeroing_batches: int = 0
    blocks_zeroed: int = 0
    residue_blocks: int = 0
    dropped_events: int = 0
    tokens_accepted: Counter[str] = field(default_factory=Counter)  # by issuer key id
    tokens_refused: Counter[str] = field(default_factory=Counter)  # by reason


def summarize(log: AuditLog) -> FleetSummary:
    """Count events by kind, outcome and reason."""
    summary = FleetSummary(files=log.files, truncated_tails=log.truncated_tails)
    for record in log.records:
        summary.first_ts = record.ts if summary.first_ts is None else min(summary.first_ts, record.ts)
        summary.last_ts = record.ts if summary.last_ts is None else max(summary.last_ts, record.ts)
        summary.kinds[record.event.kind] += 1
        _count(summary, record.event)
    return summary


def _count(summary: FleetSummary, event: object) -> None:
    match event:
        case NodeStarted(node_id=node_id):
            summary.nodes_started.add(node_id)
        case NodeStopped(reason=reason):
            summary.stop_reasons[reason.value] += 1
        case EvidenceRefreshed(outcome=outcome):
            summary.evidence[outcome.value] += 1
        case RequestFinished(status=status):
            summary.request_statuses[status.value] += 1
        case RouteDecision(gateway_id=gateway_id, outcome=outcome):
            summary.gateways.add(gateway_id)
            summary.route_outcomes[outcome.value] += 1
        case NodeAdmitted(node_id=node_id):
            summary.admitted.add(node_id)
        case NodeEvicted(reason=reason):
            summary.eviction_reasons[reason.value] += 1
        case BlocksZeroed(blocks=blocks, residue_blocks=residue):
            summary.zeroing_batches += 1
            summary.blocks_zeroed += blocks
            summary.residue_blocks += residue
        case TokenDecisions(key_id=key_id, accepted=accepted, refused=refused):
            if accepted:
                summary.tokens_accepted[f"key {key_id[:12]}"] += accepted
            summary.tokens_refused.update({reason: count for reason, count in refused.items() if count})
        case EventsDropped(dropped=dropped):
            summary.dropped_events += dropped


def _breakdown(counts: Counter[str]) -> str:
    if not counts:
        return "0"
    detail = ", ".join(f"{name} {count}" for name, count in sorted(counts.items()))
    return f"{sum(counts.values())} ({detail})"


def format_summary(summary: FleetSummary) -> str:
    """The summary as a short block of text, one topic per line."""
    span = ("no events" if summary.first_ts is None else
            f"ts {summary.first_ts}–{summary.last_ts} ({summary.last_ts - summary.first_ts} s)")
    residue = "none" if summary.residue_blocks == 0 else f"{summary.residue_blocks} blocks  <-- RED LINE"
    lines = [
        f"Veil audit summary: {summary.files} file(s), {sum(summary.kinds.values())} events, {span}",
        "events by kind: " + (", ".join(f"{k} {n}" for k, n in sorted(summary.kinds.items())) or "none"),
        f"nodes: {len(summary.nodes_started)} started; stops: {_breakdown(summary.stop_reasons)}",
        f"evidence refreshes: {_breakdown(summary.evidence)}",
        f"requests: {_breakdown(summary.request_statuses)}",
        f"routes: {_breakdown(summary.route_outcomes)} by {len(summary.gateways)} gateway(s)",
        f"directory: {len(summary.admitted)} node(s) admitted; evictions: {_breakdown(summary.eviction_reasons)}",
        f"KV scrubbing: {summary.zeroing_batches} batches, {summary.blocks_zeroed} blocks zeroed, residue: {residue}",
        f"tokens: accepted {_breakdown(summary.tokens_accepted)}; refused {_breakdown(summary.tokens_refused)}",
        f"dropped events: {summary.dropped_events}; files cut by a crash: {summary.truncated_tails}",
    ]
    return "\n".join(lines) + "\n"
