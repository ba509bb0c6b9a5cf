"""Bounded in-flight requests, per node and overall: overload is an immediate 503, never a queue.

A request holds one overall slot from the moment the gateway accepts it and
one slot of the node it is forwarded to while that node works on it. When a
bound is reached the request is refused at once with `Retry-After`; nothing
waits in a queue that could grow without bound or hold a request long enough
to correlate it with anything.
"""

from __future__ import annotations

import threading
from collections import Counter

from serving.errors import OverloadedError

_GATEWAY_FULL = "the gateway is at its bound of requests in flight; retry after the Retry-After delay"
_NODE_FULL = "the chosen node is at its bound of requests in flight; retry after the Retry-After delay"


class Permit:
    """One held slot; release it exactly once (it is also a context manager)."""

    __slots__ = ("_limiter", "_key", "_released")

    def __init__(self, limiter: InFlightLimiter, key: str | None) -> None:
        self._limiter = limiter
        self._key = key
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._limiter._release(self._key)

    def __enter__(self) -> Permit:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


class InFlightLimiter:
    """Counts requests in flight overall and per node, refusing any over the bounds."""

    def __init__(self, max_total: int, max_per_node: int, retry_after_s: int) -> None:
        self.max_total = max_total
        self.max_per_node = max_per_node
        self.retry_after_s = retry_after_s
        self._lock = threading.Lock()
        self._total = 0
        self._per_node: Counter[str] = Counter()

    @property
    def in_flight(self) -> int:
        return self._total

    def node_in_flight(self, node_key: str) -> int:
        with self._lock:
            return self._per_node[node_key]

    def admit_request(self) -> Permit:
        """Take an overall slot or raise OverloadedError."""
        with self._lock:
            if self._total >= self.max_total:
                raise OverloadedError(_GATEWAY_FULL, self.retry_after_s)
            self._total += 1
        return Permit(self, None)

    def admit_to_node(self, node_key: str) -> Permit:
        """Take a slot of node `node_key` (its address) or raise OverloadedError."""
        with self._lock:
            if self._per_node[node_key] >= self.max_per_node:
                raise OverloadedError(_NODE_FULL, self.retry_after_s)
            self._per_node[node_key] += 1
        return Permit(self, node_key)

    def _release(self, key: str | None) -> None:
        with self._lock:
            if key is None:
                self._total -= 1
                return
            self._per_node[key] -= 1
            if self._per_node[key] <= 0:
                del self._per_node[key]
