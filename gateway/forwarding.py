"""Forwarding one request: pick a candidate, open the node's answer, relay its bytes, audit the route.

Until a node accepts the request the gateway may still change its mind: a
node that provably never took it (the call failed before the node sent
anything) or is at its in-flight bound is skipped for the next candidate in
the random failover order (a node that broke is also evicted). When no
candidate has room the answer is 503 with Retry-After; when every candidate
failed, 502. A node accepts right after decapsulating, before any work on the
request; from then on the answer is committed to that node, however long it
takes: the response head goes out at once, a slow answer is never a failure,
and a failure just ends the stream (the client's decryption reports the
truncation). Two answers end routing at once: a ciphertext the node cannot
decapsulate is a 400 (RFC 9458 section 5.2; the node is not at fault, and
sending the request again cannot help), and a node that neither refuses nor
accepts within the accept timeout may hold the request, so that is a 504 and
the request goes nowhere else. Neither evicts the node.
"""

from __future__ import annotations

import enum
import random
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from audit.events import RouteOutcome
from gateway.audit import GatewayAuditor
from gateway.errors import (
    FinalRefusalError,
    NoCandidateError,
    NodeBusyError,
    NodeFailedError,
    NodeUnreachableError,
)
from gateway.keeper import PoolKeeper
from gateway.models import RESPONSE_MEDIA_TYPES, Candidate
from gateway.node_client import InferStream
from gateway.routing import failover_order
from serving.backpressure import InFlightLimiter, Permit
from serving.errors import OverloadedError, ServingError

_NO_CANDIDATE = "none of the candidates is an admitted node; fetch /v1/nodes again and choose from it"
_ALL_FAILED = "every candidate node failed before answering; fetch /v1/nodes again and retry"
_NODES_BUSY = "the candidate nodes are at their bounds of requests in flight; retry after the Retry-After delay"


@dataclass(slots=True)
class OpenRoute:
    """A node that has started answering, and everything to release when its answer ends."""

    node_id: str
    address: str
    response_media_type: str
    stream: InferStream
    node_permit: Permit
    outcome: RouteOutcome
    finished: bool = False
    closed: bool = False


class Forwarder:
    """Routes requests through the pool, within the in-flight bounds, auditing each one."""

    def __init__(self, keeper: PoolKeeper, limiter: InFlightLimiter, auditor: GatewayAuditor,
                 accept_timeout_s: float, rng: random.Random | None = None) -> None:
        self.keeper = keeper
        self.rng = rng
        self.limiter = limiter
        self.auditor = auditor
        self.accept_timeout_s = accept_timeout_s

    async def open(self, candidates: Sequence[Candidate]) -> RelayedAnswer:
        """Route `candidates` and return the node's answer to relay, or raise a ServingError."""
        started = time.monotonic()
        ids = tuple(candidate.node_id for candidate in candidates)
        try:
            request_permit = self.limiter.admit_request()
        except OverloadedError:
            self.auditor.route(ids, None, RouteOutcome.OVERLOADED, started)
            raise
        try:
            route = await self._choose_and_open(candidates, ids, started)
        except BaseException:
            request_permit.release()
            raise
        return RelayedAnswer(self, route, request_permit, ids, started)

    async def _choose_and_open(self, candidates: Sequence[Candidate], ids: tuple[str, ...], started: float) -> OpenRoute:
        pool = self.keeper.pool
        order = failover_order(ids, lambda node_id: pool.lookup(node_id) is not None, self.rng)
        tried: list[str] = []
        busy = False
        failed_addresses: set[str] = set()
        for index in order:
            candidate = candidates[index]
            entry = pool.lookup(candidate.node_id)
            if entry is None or entry.address in failed_addresses:
                continue  # evicted meanwhile, or the same node under its other id
            tried.append(candidate.node_id)
            try:
                attempt = await self._try_node(candidate, entry.address, failed_over=len(tried) > 1)
            except FinalRefusalError:
                self.auditor.route(ids, candidate.node_id, RouteOutcome.NODE_ERROR, started)
                raise
            if isinstance(attempt, OpenRoute):
                return attempt
            busy = busy or attempt is _Attempt.BUSY
            failed_addresses.add(entry.address)
        raise self._refusal(ids, tried, busy, started)

    def _refusal(self, ids: tuple[str, ...], tried: list[str], busy: bool, started: float) -> ServingError:
        chosen = tried[-1] if tried else None
        if busy:
            self.auditor.route(ids, chosen, RouteOutcome.OVERLOADED, started)
            return OverloadedError(_NODES_BUSY, self.limiter.retry_after_s)
        if tried:
            self.auditor.route(ids, chosen, RouteOutcome.NODE_ERROR, started)
            return NodeFailedError(_ALL_FAILED)
        self.auditor.route(ids, None, RouteOutcome.NO_CANDIDATE, started)
        return NoCandidateError(_NO_CANDIDATE)

    async def _try_node(self, candidate: Candidate, address: str, *, failed_over: bool) -> OpenRoute | _Attempt:
        try:
            node_permit = self.limiter.admit_to_node(address)
        except OverloadedError:
            return _Attempt.BUSY
        try:
            stream = await self.keeper.client(address).open_infer(
                candidate.media_type, candidate.encapsulated, self.accept_timeout_s)
        except NodeBusyError:
            node_permit.release()
            return _Attempt.BUSY
        except NodeUnreachableError:
            node_permit.release()
            self.keeper.report_failure(address)
            return _Attempt.FAILED
        except BaseException:
            node_permit.release()
            raise
        media_type = RESPONSE_MEDIA_TYPES[candidate.media_type]
        outcome = RouteOutcome.FAILOVER if failed_over else RouteOutcome.OK
        return OpenRoute(candidate.node_id, address, media_type, stream, node_permit, outcome)


class _Attempt(enum.Enum):
    """Why one candidate did not start answering."""

    BUSY = "busy"
    FAILED = "failed"


class RelayedAnswer:
    """The chosen node's answer: iterate `chunks()`, and `close()` exactly once whatever happens."""

    def __init__(self, forwarder: Forwarder, route: OpenRoute, request_permit: Permit,
                 ids: tuple[str, ...], started: float) -> None:
        self.route = route
        self._forwarder = forwarder
        self._request_permit = request_permit
        self._ids = ids
        self._started = started

    async def chunks(self) -> AsyncIterator[bytes]:
        """The node's bytes as they come; a failure ends the stream early."""
        route = self.route
        try:
            async for chunk in route.stream.data():
                yield chunk
        except ServingError:
            # Nothing to fail over to once the node accepted: end the stream and evict the node.
            route.outcome = RouteOutcome.NODE_ERROR
            self._forwarder.keeper.report_failure(route.address)
            return
        route.finished = True

    def close(self) -> None:
        """Release the permits, stop the node's call if unfinished, and audit the route."""
        route = self.route
        if route.closed:
            return
        route.closed = True
        if not route.finished:
            route.stream.cancel()
        route.node_permit.release()
        self._request_permit.release()
        self._forwarder.auditor.route(self._ids, route.node_id, route.outcome, self._started)
