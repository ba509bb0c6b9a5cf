"""The gateway's directory of attested nodes: fetching, brief caching, and candidate sampling.

The directory is the same for every caller, so fetching it reveals nothing
about a request. Candidates are drawn by the client, never by the gateway:
K distinct nodes, each draw proportional to capacity among those not drawn
yet, from the operating system's randomness (`secrets.SystemRandom`), so
nobody can predict or steer which nodes a given request may reach.
"""

from __future__ import annotations

import base64
import binascii
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from random import Random
from typing import Any

import httpx

from client.errors import GatewayError

DIRECTORY_PATH = "/v1/nodes"
DIRECTORY_VERSION = 1
MAX_NODES = 4096


@dataclass(frozen=True, slots=True)
class DirectoryEntry:
    """One node as the gateway lists it; nothing here is trusted before verification."""

    node_id: str
    key_config: bytes
    evidence: str
    capacity: int


@dataclass(frozen=True, slots=True)
class Directory:
    entries: tuple[DirectoryEntry, ...]
    policy_digest: str
    fetched_at: float


def parse_directory(data: Any, fetched_at: float) -> Directory:
    """Parse `GET /v1/nodes`; raise ValueError on anything outside the contract."""
    if not isinstance(data, dict) or data.get("version") != DIRECTORY_VERSION:
        raise ValueError(f"the directory is not version {DIRECTORY_VERSION}")
    nodes = data.get("nodes")
    if not isinstance(nodes, list) or len(nodes) > MAX_NODES:
        raise ValueError("the directory's node list is missing or too long")
    digest = data.get("policy_digest", "")
    if not isinstance(digest, str):
        raise ValueError("the directory's policy digest is not a string")
    return Directory(tuple(_entry(node) for node in nodes), digest, fetched_at)


def _entry(node: Any) -> DirectoryEntry:
    if not isinstance(node, dict):
        raise ValueError("a directory entry is not an object")
    node_id, key_config, evidence, capacity = (node.get(k) for k in ("node_id", "key_config", "evidence", "capacity"))
    if not (isinstance(node_id, str) and isinstance(key_config, str) and isinstance(evidence, str)):
        raise ValueError("a directory entry lacks its node id, key configuration or evidence")
    if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 0:
        raise ValueError("a directory entry's capacity is not a non-negative integer")
    try:
        config = base64.b64decode(key_config, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("a directory entry's key configuration is not base64") from None
    return DirectoryEntry(node_id, config, evidence, capacity)


def sample_candidates(
    entries: Sequence[DirectoryEntry], k: int, rng: Random | None = None
) -> list[DirectoryEntry]:
    """Up to `k` distinct entries, each draw weighted by capacity among the entries left.

    Nodes with zero capacity are never drawn. `rng` defaults to the system's
    cryptographic randomness; tests pass a seeded `random.Random`.
    """
    if k < 1:
        raise ValueError("at least one candidate is needed")
    rng = rng or secrets.SystemRandom()
    pool = [entry for entry in entries if entry.capacity > 0]
    chosen: list[DirectoryEntry] = []
    while pool and len(chosen) < k:
        index = _weighted_index([entry.capacity for entry in pool], rng)
        chosen.append(pool.pop(index))
    return chosen


def _weighted_index(weights: list[int], rng: Random) -> int:
    point = rng.randrange(sum(weights))  # integer draw: exact proportions, no float rounding
    for index, weight in enumerate(weights):
        if point < weight:
            return index
        point -= weight
    raise AssertionError("unreachable: the point lies below the total weight")


class DirectoryCache:
    """Fetches the directory and keeps it for `ttl_s` seconds (thread-safe)."""

    def __init__(
        self, http: httpx.Client, ttl_s: float = 10.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._http = http
        self._ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._directory: Directory | None = None

    def get(self) -> Directory:
        """The cached directory, or a fresh one if it is older than the TTL."""
        with self._lock:
            directory = self._directory
            if directory is None or self._clock() - directory.fetched_at > self._ttl_s:
                directory = self._directory = self._fetch()
            return directory

    def invalidate(self) -> None:
        """Forget the cached directory (after the gateway said a candidate is gone)."""
        with self._lock:
            self._directory = None

    def _fetch(self) -> Directory:
        try:
            response = self._http.get(DIRECTORY_PATH)
        except httpx.HTTPError as error:
            raise GatewayError(0, "unreachable", f"cannot fetch the directory ({type(error).__name__}); "
                               "check the gateway URL and that the gateway runs") from None
        if response.status_code != 200:
            raise GatewayError(response.status_code, _error_code(response), "the directory could not be fetched")
        try:
            return parse_directory(response.json(), self._clock())
        except ValueError as error:
            raise GatewayError(200, "bad_directory", f"the directory is malformed ({error})") from None


def _error_code(response: httpx.Response) -> str:
    try:
        error = response.json().get("error", {})
        return error.get("code", "unknown") if isinstance(error, dict) else "unknown"
    except (ValueError, AttributeError):
        return "unknown"
