"""Which of a request's candidates the gateway forwards to: uniformly at random, nothing else.

The client already chose its K candidates (capacity-weighted) and verified
them. The gateway's only choice is among those that are healthy in its pool,
and it makes it uniformly at random with the operating system's randomness,
so that neither the requester nor anything about it (address, headers, time,
order of candidates) can steer a request to a chosen node. Failover (a node
that fails or is full before its first byte) follows a second uniformly random
order over the same candidates (the rest of the same permutation), so it can only reach nodes the client
itself chose and verified.
"""

from __future__ import annotations

import random
import secrets
from collections.abc import Callable, Sequence

_SYSTEM_RANDOM = secrets.SystemRandom()


def failover_order(
    candidate_ids: Sequence[str],
    is_healthy: Callable[[str], bool],
    rng: random.Random | None = None,
) -> list[int]:
    """Indices of the healthy candidates in a uniformly random order.

    The first index is the chosen candidate; each healthy candidate is first
    with probability 1/h. The rest are the order in which to fail over if the
    chosen node fails before its first byte. `rng` exists for seeded tests.
    """
    healthy = [index for index, node_id in enumerate(candidate_ids) if is_healthy(node_id)]
    (rng or _SYSTEM_RANDOM).shuffle(healthy)
    return healthy
