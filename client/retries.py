"""When the SDK sends a request again, and why: every retry, its bound and its reason, in one place.

A request is sent again only after a refusal that proves no node read it, so it never runs twice.
Each time it is verified and sealed afresh (candidates drawn again, new HPKE contexts), so nothing
links the attempts but their timing. The retries, outermost first (`Reason`'s order):

- CLOCK, once: a node refused the request's `Date` as outside its replay window and sent its own
  (`NodeError` `date_out_of_window` with `node_time`). The node refused before reading anything;
  the client corrects its clock from the node's Date, as RFC 9458 section 6.5 allows, and keeps
  the correction for later requests.
- OVERLOADED, up to the client's `max_retries` (default 2): the gateway is at its bounds and said so
  before any node read anything (503 with Retry-After). The client waits Retry-After first; a wait
  longer than MAX_RETRY_AFTER_S is the caller's decision, so that `GatewayError` is raised with its
  `retry_after`.
- DIRECTORY, once: the gateway says a candidate left its pool (404 `no_candidate`), every tried node
  failed before accepting (502 `node_failed`), or the node no longer holds the key the request was
  sealed to (400 `unknown_key`). No node read anything; the client fetches the directory again.

Every other error is raised at once: a node that accepted a request may have run it, and a request
that failed verification or did not parse would fail the same way again. A retry for one reason gives
each reason after it its whole bound again, since the request is then sent as if for the first time:
one call sends at most 2 x (max_retries + 1) x 2 times.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import TypeVar

from client.errors import GatewayError, NodeError, VeilClientError
from protocol import codes

T = TypeVar("T")

# Waits longer than this are the caller's decision: the GatewayError carries retry_after.
MAX_RETRY_AFTER_S = 30.0
# The gateway's refusals that mean the client's directory is stale and that no node read the request.
_STALE_DIRECTORY = {(404, codes.NO_CANDIDATE), (502, codes.NODE_FAILED), (400, codes.UNKNOWN_KEY)}


class Reason(Enum):
    """Why a request is sent again, outermost first (the module's docstring says why each is safe)."""

    CLOCK = "the node refused this computer's clock"
    OVERLOADED = "the gateway is at its bounds"
    DIRECTORY = "the directory the request was sealed from is stale"


@dataclass(frozen=True, slots=True)
class Retry:
    """A refusal that allows sending again: its reason and what it says to do first."""

    reason: Reason
    wait_s: float = 0.0  # OVERLOADED: the gateway's Retry-After
    node_time: float = 0.0  # CLOCK: the node's clock, from its Date


def retry_for(error: VeilClientError) -> Retry | None:
    """The retry `error` allows, or None if it must be raised."""
    if isinstance(error, NodeError) and error.code == codes.DATE_OUT_OF_WINDOW and error.node_time is not None:
        return Retry(Reason.CLOCK, node_time=error.node_time)
    if not isinstance(error, GatewayError):
        return None
    if error.status == 503 and error.retry_after is not None and error.retry_after <= MAX_RETRY_AFTER_S:
        return Retry(Reason.OVERLOADED, wait_s=error.retry_after)
    if (error.status, error.code) in _STALE_DIRECTORY:
        return Retry(Reason.DIRECTORY)
    return None


class RetryBudget:
    """The retries one call has left for each reason."""

    def __init__(self, max_retries: int) -> None:
        self._bounds = {Reason.CLOCK: 1, Reason.OVERLOADED: max_retries, Reason.DIRECTORY: 1}
        self._left = dict(self._bounds)

    def take(self, reason: Reason) -> bool:
        """Spends one retry for `reason`; False if none is left. The reasons after it start afresh."""
        if self._left[reason] == 0:
            return False
        self._left[reason] -= 1
        order = list(Reason)
        for later in order[order.index(reason) + 1:]:
            self._left[later] = self._bounds[later]
        return True


def send_with_retries(send: Callable[[], T], max_retries: int, *, correct_clock: Callable[[float], None],
                      refetch_directory: Callable[[], None]) -> T:
    """`send()`, sent again after each refusal that allows it, within each reason's bound:

    - a node refused this computer's clock: once, after `correct_clock(node_time)`;
    - the gateway answered 503 with a Retry-After of at most MAX_RETRY_AFTER_S: up to `max_retries`
      times, after waiting that long;
    - the gateway answered 404 no_candidate, 502 node_failed or 400 unknown_key: once, after
      `refetch_directory()`.
    """
    budget = RetryBudget(max_retries)
    while True:
        try:
            return send()
        except VeilClientError as error:
            retry = retry_for(error)
            if retry is None or not budget.take(retry.reason):
                raise
        if retry.reason is Reason.CLOCK:
            correct_clock(retry.node_time)
        elif retry.reason is Reason.OVERLOADED:
            time.sleep(retry.wait_s)
        else:
            refetch_directory()
