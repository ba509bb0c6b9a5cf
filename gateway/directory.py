"""The published directory: rendered once per pool change, served identically to every caller.

A large pool is published as a uniformly random sample of `size` nodes, redrawn every epoch
(ARCHITECTURE.md: "for large fleets, a uniformly random sample"). Within an epoch every caller gets
the same sample, and a node stays in it while other nodes come and go. Nodes are ranked by an HMAC
of their id under a secret drawn for the epoch, so no node can grind a key configuration that ranks
it in every sample: the seed is unknown until the epoch starts and never published.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import threading
import time
from collections.abc import Callable, Sequence

from gateway.pool import NodePool, PoolEntry
from protocol.constants import DIRECTORY_VERSION


class DirectoryCache:
    """The directory's JSON bytes for the pool's current version and the current epoch."""

    def __init__(self, pool: NodePool, size: int, epoch_s: float, clock: Callable[[], float] = time.time) -> None:
        self._pool = pool
        self._size = size
        self._epoch_s = epoch_s
        self._clock = clock
        self._lock = threading.Lock()
        self._key: tuple[int, int] | None = None
        self._epoch = -1
        self._seed = b""
        self._rendered = b""

    def render(self) -> bytes:
        """The directory as JSON bytes; nothing about the caller goes into it."""
        with self._lock:
            epoch = int(self._clock() // self._epoch_s)
            if epoch != self._epoch:
                self._epoch, self._seed = epoch, secrets.token_bytes(32)
            key = (self._pool.version, epoch)
            if key != self._key:
                listed = sample(self._pool.entries(), self._size, self._seed)
                self._rendered = _render(listed, self._pool.policy.digest.hex())
                self._key = key
            return self._rendered


def sample(entries: Sequence[PoolEntry], size: int, seed: bytes) -> list[PoolEntry]:
    """All entries if there are at most `size`; else the `size` ranked first under `seed`, in their order."""
    if len(entries) <= size:
        return list(entries)
    chosen = set(sorted(range(len(entries)), key=lambda index: _rank(seed, entries[index].node_id))[:size])
    return [entry for index, entry in enumerate(entries) if index in chosen]


def _rank(seed: bytes, node_id: str) -> bytes:
    return hmac.new(seed, node_id.encode("ascii"), hashlib.sha256).digest()


def _render(entries: Sequence[PoolEntry], policy_digest: str) -> bytes:
    nodes = [
        {
            "node_id": entry.node_id,
            "key_config": base64.b64encode(entry.key_config).decode("ascii"),
            "evidence": entry.evidence,
            "capacity": entry.capacity,
            "attestation_result": entry.attestation_result,
            "models": list(entry.models),
            "task": entry.task,
            "transparency": entry.transparency,
        }
        for entry in entries
    ]
    directory = {"version": DIRECTORY_VERSION, "nodes": nodes, "policy_digest": policy_digest}
    return json.dumps(directory, separators=(",", ":")).encode("utf-8")
