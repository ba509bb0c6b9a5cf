"""The gateway's audit events: route decisions, admissions, evictions and token tallies, through `audit`.

A route event holds the candidates' node ids, the chosen node, the outcome
and a coarse latency bucket. Nothing about the requester exists at this layer
to be recorded: no address, no header, no size, no exact time. Token
decisions are reported as tallies per listed issuer key, every
`TOKEN_TALLY_INTERVAL_S` and when the gateway stops, never one per request:
an event per token would date each request to the second.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable

from audit import NodeAdmitted, NodeEvicted, RouteDecision, RouteOutcome, TokenDecisions, bucket_latency_ms
from audit.sink import AuditSink
from gateway.auth import KeyTally, TokenDecisionCounts
from gateway.pool import Admission, Eviction

TOKEN_TALLY_INTERVAL_S = 60.0


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

    def token_decisions(self, tally: KeyTally, period_s: int) -> None:
        self.sink.emit(TokenDecisions(gateway_id=self.gateway_id, key_id=tally.key_id, period_s=period_s,
                                      accepted=tally.accepted, refused=tally.refused))

    def close(self) -> None:
        self.sink.close()


class TokenTallyReporter:
    """Emits a gateway's token decisions as tallies: every `interval_s` while it runs, and once when it stops.

    Each tally covers the whole seconds since the previous report; a period without decisions emits nothing.
    """

    def __init__(self, decisions: TokenDecisionCounts, auditor: GatewayAuditor,
                 interval_s: float = TOKEN_TALLY_INTERVAL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.decisions = decisions
        self.auditor = auditor
        self.interval_s = interval_s
        self._clock = clock
        self._since = clock()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Stop reporting on the timer and report what was counted since the last tally."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self.report()

    def report(self) -> None:
        now = self._clock()
        period_s = max(1, math.ceil(now - self._since))
        self._since = now
        for tally in self.decisions.take():
            self.auditor.token_decisions(tally, period_s)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self.report()
