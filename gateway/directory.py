"""The published directory: rendered once per pool change, served identically to every caller."""

from __future__ import annotations

import base64
import json
import threading

from gateway.pool import NodePool, PoolEntry

DIRECTORY_VERSION = 1


class DirectoryCache:
    """The directory's JSON bytes for the pool's current version."""

    def __init__(self, pool: NodePool) -> None:
        self._pool = pool
        self._lock = threading.Lock()
        self._version = -1
        self._rendered = b""

    def render(self) -> bytes:
        """The directory as JSON bytes; nothing about the caller goes into it."""
        with self._lock:
            version = self._pool.version
            if version != self._version:
                self._rendered = _render(self._pool.entries(), self._pool.policy.digest.hex())
                self._version = version
            return self._rendered


def _render(entries: tuple[PoolEntry, ...], policy_digest: str) -> bytes:
    nodes = [
        {
            "node_id": entry.node_id,
            "key_config": base64.b64encode(entry.key_config).decode("ascii"),
            "evidence": entry.evidence,
            "capacity": entry.capacity,
            "attestation_result": entry.attestation_result,
        }
        for entry in entries
    ]
    directory = {"version": DIRECTORY_VERSION, "nodes": nodes, "policy_digest": policy_digest}
    return json.dumps(directory, separators=(",", ":")).encode("utf-8")
