"""The gateway's directory of attested nodes: fetching, brief caching, and candidate sampling.

The directory is the same for every caller, so fetching it reveals nothing
about a request. Candidates are drawn by the client, never by the gateway:
K distinct nodes, each included with probability proportional to its capacity,
from the operating system's randomness (`secrets.SystemRandom`), so nobody can
predict or steer which nodes a given request may reach (see `sample_candidates`).

That share holds per node, and a node is one chip: a directory that lists one node
twice, under the same id or under several ids whose evidence names the same chip
(`attestation.hardware`), would multiply that node's chances. An honest gateway
admits each chip once, so such a directory is refused whole (`repeated_listing`).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import functools
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from random import Random
from typing import Any

import httpx

from attestation.bundle import EvidenceBundle
from attestation.hardware import hardware_id
from client.errors import GatewayError, ModelNotFoundError, ModelTaskError
from protocol.constants import DIRECTORY_PATH, DIRECTORY_VERSION, MAX_DIRECTORY_NODES, TASK_EMBED, TASK_GENERATE

MAX_CACHED_CLAIMS = 1024
EMBEDDINGS_PATH = "/v1/embeddings"  # the one request an "embed" node serves
REPEATED_NODE = "repeated_node"


@dataclass(frozen=True, slots=True)
class DirectoryEntry:
    """One node as the gateway lists it; nothing here is trusted before verification."""

    node_id: str
    key_config: bytes
    evidence: str
    capacity: int
    models: tuple[str, ...] | None = None  # the model names it serves; None where the directory does not say
    transparency: str | None = None  # the node's stapled log proofs (JSON, unverified); None: it staples none
    task: str = TASK_GENERATE  # what its models do ("generate" or "embed"), as it states it; absent: generate

    @property
    def hardware_id(self) -> str | None:
        """The chip this entry's evidence names (`claimed_hardware_id`): unverified, None if unreadable."""
        return claimed_hardware_id(self.evidence)


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
    if not isinstance(nodes, list) or len(nodes) > MAX_DIRECTORY_NODES:
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
    models = node.get("models")
    if models is not None and not (isinstance(models, list) and all(isinstance(m, str) for m in models)):
        raise ValueError("a directory entry's models are not a list of names")
    transparency = node.get("transparency") or None
    if transparency is not None and not isinstance(transparency, str):
        raise ValueError("a directory entry's transparency proofs are not a string")
    task = node.get("task") or TASK_GENERATE
    if not isinstance(task, str):
        raise ValueError("a directory entry's task is not a string")
    try:
        config = base64.b64decode(key_config, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("a directory entry's key configuration is not base64") from None
    return DirectoryEntry(node_id, config, evidence, capacity, None if models is None else tuple(models), transparency,
                          task)


def serving(entries: Sequence[DirectoryEntry], model: str | None, task: str | None = None) -> list[DirectoryEntry]:
    """The entries that may serve `model` for `task` (None: any task): those listing it for that task, and
    those that list nothing (the node then decides). Candidates are drawn from these alone, so a request
    only ever competes within its model's pool."""
    if model is None:
        return list(entries)
    return [entry for entry in entries
            if entry.models is None or (model in entry.models and task in (None, entry.task))]


def model_pool(entries: Sequence[DirectoryEntry], model: str | None, task: str | None) -> list[DirectoryEntry]:
    """`serving(entries, model, task)`; raises ModelNotFoundError where the directory lists nodes but none for
    `model`, and ModelTaskError where it lists `model` only for another task: refused before anything is sent."""
    pool = serving(entries, model, task)
    if entries and not pool:
        if task is not None and serving(entries, model):
            raise ModelTaskError(task)
        raise ModelNotFoundError()
    return pool


def request_task(method: str, path: str) -> str | None:
    """The task a request needs its model to do: "embed" for embeddings, "generate" for any other POST
    (chat, completions, responses); None for a listing, which any node answers."""
    if method.upper() != "POST":
        return None
    return TASK_EMBED if path == EMBEDDINGS_PATH else TASK_GENERATE


def listed_models(entries: Sequence[DirectoryEntry]) -> list[str]:
    """Every model name the directory lists, sorted."""
    return sorted({model for entry in entries for model in entry.models or ()})


@functools.lru_cache(maxsize=MAX_CACHED_CLAIMS)
def claimed_hardware_id(evidence: str) -> str | None:
    """The hardware identity the evidence names, read without verifying it; None if it names none.

    Cheap (no signature is checked), so the whole directory can be read before sampling. The verifier
    proves the same identity from the same evidence before anything is sealed to the node
    (`client.verify`); evidence that names none can never verify. Whatever reading it raises, it is
    evidence that names no chip, never a reason to refuse the whole directory.
    """
    try:
        return hardware_id(EvidenceBundle.from_json(evidence))
    except Exception:  # noqa: BLE001 - AttestationError or a parser's own: verifying the candidate refuses it
        return None


def repeated_listing(entries: Sequence[DirectoryEntry]) -> str | None:
    """What repeats in the directory, if one node is listed more than once; None if none is."""
    node_ids = [entry.node_id for entry in entries]
    if len(set(node_ids)) != len(node_ids):
        return "a node id appears more than once"
    chips = [entry.hardware_id for entry in entries if entry.hardware_id is not None]
    if len(set(chips)) != len(chips):
        return "several node ids attest from one chip (the same hardware identity)"
    return None


def capped(entries: Sequence[DirectoryEntry], max_capacity: int) -> list[DirectoryEntry]:
    """The entries with every capacity above the policy's `max_node_capacity` counted as that maximum.

    Capacities come from the gateway, unsigned. Honest nodes refuse to start above the maximum, so
    a larger figure is an inflated claim, made to draw more users to one node: it counts for no more.
    """
    return [entry if entry.capacity <= max_capacity else dataclasses.replace(entry, capacity=max_capacity)
            for entry in entries]


def sample_candidates(
    entries: Sequence[DirectoryEntry], k: int, rng: Random | None = None
) -> list[DirectoryEntry]:
    """Up to `k` distinct entries, each included with probability k * capacity / total capacity.

    The gateway then picks uniformly among the candidates, so a node serves a request with probability
    (k * C_i / sum C) / k = C_i / sum C: exactly its capacity share, the bound an attacker holding
    nodes cannot beat. Drawing one weighted node after another would not do this: it includes small
    nodes too often. Here inclusion is exact, by systematic sampling over a random order with integer
    arithmetic. A node whose share exceeds 1/k is always included (probability 1 is the most it can
    have), and the remaining slots are shared by the others in proportion to their capacity.
    Nodes with zero capacity are never drawn. `rng` defaults to the system's cryptographic randomness;
    tests pass a seeded `random.Random`. Entries must be distinct nodes: a repeated node id is refused.
    """
    if k < 1:
        raise ValueError("at least one candidate is needed")
    if len({entry.node_id for entry in entries}) != len(entries):
        raise ValueError("a node id appears more than once; each node is sampled once, by its capacity")
    rng = rng or secrets.SystemRandom()
    pool = [entry for entry in entries if entry.capacity > 0]
    rng.shuffle(pool)  # a random order, so which nodes end up together is itself random
    certain, rest, slots = _split_certain(pool, min(k, len(pool)))
    return certain + _systematic(rest, slots, rng)


def _split_certain(pool: list[DirectoryEntry], slots: int) -> tuple[list, list, int]:
    """Takes out the nodes whose inclusion probability would reach 1, until none would."""
    certain: list[DirectoryEntry] = []
    rest = list(pool)
    while slots and rest:
        total = sum(entry.capacity for entry in rest)
        over = [entry for entry in rest if slots * entry.capacity >= total]
        if not over:
            break
        certain += over[:slots]
        slots -= len(over[:slots])
        rest = [entry for entry in rest if entry not in over]
    return certain, rest, slots


def _systematic(rest: list[DirectoryEntry], slots: int, rng: Random) -> list[DirectoryEntry]:
    """`slots` entries of `rest`, entry i with probability slots * C_i / sum C (< 1 for each here)."""
    if not slots or not rest:
        return []
    total = sum(entry.capacity for entry in rest)
    # Entry i owns [slots * (C_0 + ... + C_{i-1}), slots * (C_0 + ... + C_i)); the points are u + j * total.
    start = rng.randrange(total)
    points = [start + j * total for j in range(slots)]
    chosen: list[DirectoryEntry] = []
    upper = 0
    for entry in rest:
        lower, upper = upper, upper + slots * entry.capacity
        if any(lower <= point < upper for point in points):
            chosen.append(entry)
    return chosen


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
            directory = parse_directory(response.json(), self._clock())
        except ValueError as error:
            raise GatewayError(200, "bad_directory", f"the directory is malformed ({error})") from None
        repeated = repeated_listing(directory.entries)
        if repeated is not None:
            raise GatewayError(200, REPEATED_NODE, f"the directory lists one node more than once: {repeated}. "
                               "That would draw more requests to it than its capacity share, so nothing was "
                               "sent; use another gateway")
        return directory


def _error_code(response: httpx.Response) -> str:
    try:
        error = response.json().get("error", {})
        return error.get("code", "unknown") if isinstance(error, dict) else "unknown"
    except (ValueError, AttributeError):
        return "unknown"
