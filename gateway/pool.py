"""The attested node pool: which nodes the gateway routes to, and why.

Pure bookkeeping, no network: the keeper (`gateway.keeper`) asks the pool for
a fresh nonce, calls the node, and hands the answer back here. A node joins
only when its evidence answers that exact nonce and passes
`attestation.verifier.verify` under the gateway's policy; every nonce serves
once. A node leaves on a failed re-attestation, expired evidence, a failed
health check or an inference failure, and comes back only through a fresh
attestation. When a node rotates its key its id changes; the old id stays an
alias for the same node for the key grace period, so clients holding an older
directory keep reaching it.

One chip is one node: a node whose evidence names a chip (`VerifiedNode.hardware_id`) that a node
at another address already attests from is refused, however many keys it presents, so the
directory never lists one GPU twice. A re-attestation at the same address (a rotated key) keeps it.
"""

from __future__ import annotations

import enum
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from attestation.binding import NONCE_SIZE
from attestation.bundle import EvidenceBundle
from attestation.errors import AttestationError, PolicyMismatchError
from attestation.verifier import VerifiedNode, verify
from audit.events import EvictionReason
from gateway.errors import AdmissionError
from gateway.results import ResultSigner
from policy import Policy
from protocol.constants import MODEL_TASKS, TASK_GENERATE


@dataclass(frozen=True, slots=True)
class PoolEntry:
    """One admitted node: what the directory publishes, plus where to reach it (never published)."""

    node_id: str
    address: str
    key_config: bytes
    evidence: str
    capacity: int
    attested_at: float
    expires_at: float
    attestation_result: str
    models: tuple[str, ...] = ()  # the model names it serves, as the node states them (unsigned, like capacity)
    transparency: str = ""  # the node's stapled log proofs, published as they came (clients verify them)
    task: str = TASK_GENERATE  # what its models do, as the node states it ("generate" or "embed"; unsigned too)


@dataclass(frozen=True, slots=True)
class Admission:
    """A node admitted; `previous_id` is its former id when it re-attested under a new key."""

    entry: PoolEntry
    previous_id: str | None


@dataclass(frozen=True, slots=True)
class Eviction:
    """A node removed from the pool, and why."""

    node_id: str
    address: str
    reason: EvictionReason


@dataclass(frozen=True, slots=True)
class HealthReport:
    """A node's answer to `Node.Health`."""

    serving: bool
    in_flight: int
    capacity: int
    node_id: str


class HealthVerdict(enum.Enum):
    """What the keeper should do after a health check."""

    HEALTHY = "healthy"
    UNREACHABLE = "unreachable"
    DRAINED = "drained"
    KEY_ROTATED = "key_rotated"


@dataclass(frozen=True, slots=True)
class _Alias:
    address: str
    until: float


class NodePool:
    """The admitted nodes, their id aliases and the nonces awaiting an answer."""

    def __init__(
        self,
        policy: Policy,
        signer: ResultSigner,
        *,
        key_grace_s: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.policy = policy
        self._signer = signer
        self._key_grace_s = key_grace_s
        self._clock = clock
        self._lock = threading.Lock()
        self._by_address: dict[str, PoolEntry] = {}
        self._address_of: dict[str, str] = {}
        self._aliases: dict[str, _Alias] = {}
        self._chips: dict[str, str] = {}  # hardware id -> the address of the node attesting from it
        self._pending_nonces: dict[str, bytes] = {}
        self._version = 0

    @property
    def version(self) -> int:
        """Changes whenever the published directory would change."""
        return self._version

    def challenge(self, address: str) -> bytes:
        """A fresh 32-byte nonce for `address`; the next admission there must answer it."""
        nonce = secrets.token_bytes(NONCE_SIZE)
        with self._lock:
            self._pending_nonces[address] = nonce
        return nonce

    def admit(self, address: str, evidence_json: str, capacity: int, models: tuple[str, ...] = (),
              transparency: str = "", task: str = "") -> Admission:
        """Verify a node's answer to its pending nonce and (re)admit it, or raise AdmissionError."""
        with self._lock:
            nonce = self._pending_nonces.pop(address, None)
        if nonce is None:
            raise AdmissionError("no attestation was requested from this node; challenge it first", check="freshness")
        now = self._clock()
        verified = _verify(evidence_json, self.policy, nonce, now)
        _check_capacity(capacity, self.policy.routing.max_node_capacity)
        _check_models(models)
        entry = PoolEntry(
            node_id=verified.node_id,
            address=address,
            key_config=verified.key_config,
            evidence=evidence_json,
            capacity=capacity,
            attested_at=now,
            expires_at=verified.expires_at,
            attestation_result=self._signer.issue(verified, now=now),
            models=tuple(models),
            transparency=_bounded_proofs(transparency),
            task=_checked_task(task),
        )
        with self._lock:
            return self._install(entry, verified.hardware_id, now)

    def evict(self, address: str, reason: EvictionReason) -> Eviction | None:
        """Remove the node at `address` and its aliases; None if it was not in the pool."""
        with self._lock:
            entry = self._by_address.pop(address, None)
            if entry is None:
                return None
            del self._address_of[entry.node_id]
            self._drop_aliases_of(address)
            self._drop_chip_of(address)
            self._version += 1
        return Eviction(entry.node_id, address, reason)

    def expire(self) -> list[Eviction]:
        """Evict every node whose evidence has expired."""
        now = self._clock()
        expired = [entry.address for entry in self.entries() if entry.expires_at <= now]
        evictions = [self.evict(address, EvictionReason.EVIDENCE_EXPIRED) for address in expired]
        self._prune_aliases(now)
        return [eviction for eviction in evictions if eviction is not None]

    def lookup(self, node_id: str) -> PoolEntry | None:
        """The admitted node answering to `node_id`, directly or through a live alias."""
        with self._lock:
            address = self._address_of.get(node_id)
            if address is not None:
                return self._by_address[address]
            alias = self._aliases.get(node_id)
            if alias is None or alias.until <= self._clock():
                return None
            return self._by_address.get(alias.address)

    def entry_at(self, address: str) -> PoolEntry | None:
        with self._lock:
            return self._by_address.get(address)

    def entries(self) -> tuple[PoolEntry, ...]:
        """Every admitted node, in node-id order (the directory's order, the same for everyone)."""
        with self._lock:
            return tuple(sorted(self._by_address.values(), key=lambda entry: entry.node_id))

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_address)

    def reattestation_due(self, reattest_s: float, margin_s: float) -> list[str]:
        """Addresses of nodes to re-attest now: on the timer, or before their evidence expires."""
        now = self._clock()
        return [
            entry.address for entry in self.entries()
            if now >= min(entry.attested_at + reattest_s, entry.expires_at - margin_s)
        ]

    def judge_health(self, address: str, report: HealthReport | None) -> HealthVerdict:
        """What a health answer (None: no answer) means for the node at `address`."""
        entry = self.entry_at(address)
        if report is None:
            return HealthVerdict.UNREACHABLE
        if not report.serving:
            return HealthVerdict.DRAINED
        if entry is not None and report.node_id != entry.node_id:
            return HealthVerdict.KEY_ROTATED
        return HealthVerdict.HEALTHY

    def _install(self, entry: PoolEntry, hardware_id: str, now: float) -> Admission:
        if self._address_of.get(entry.node_id, entry.address) != entry.address:
            raise AdmissionError("another address already serves this node id; a node is admitted once", check="identity")
        if self._chips.get(hardware_id, entry.address) != entry.address:
            raise AdmissionError("a node at another address already attests from this chip (the same hardware "
                                 "identity); one chip is admitted once, whatever keys it presents", check="identity")
        self._drop_chip_of(entry.address)
        self._chips[hardware_id] = entry.address
        previous = self._by_address.get(entry.address)
        if previous is not None:
            del self._address_of[previous.node_id]
        previous_id = previous.node_id if previous is not None and previous.node_id != entry.node_id else None
        if previous_id is not None:
            # The node honours its previous key for the grace period: keep routing the old id to it.
            self._aliases[previous_id] = _Alias(entry.address, now + self._key_grace_s)
        self._aliases.pop(entry.node_id, None)
        self._by_address[entry.address] = entry
        self._address_of[entry.node_id] = entry.address
        self._version += 1  # fresh evidence and a fresh signed result: the directory changed
        return Admission(entry, previous_id)

    def _drop_aliases_of(self, address: str) -> None:
        for alias_id in [name for name, alias in self._aliases.items() if alias.address == address]:
            del self._aliases[alias_id]

    def _drop_chip_of(self, address: str) -> None:
        for chip in [chip for chip, held_at in self._chips.items() if held_at == address]:
            del self._chips[chip]

    def _prune_aliases(self, now: float) -> None:
        with self._lock:
            for alias_id in [name for name, alias in self._aliases.items() if alias.until <= now]:
                del self._aliases[alias_id]


def eviction_reason(error: AdmissionError) -> EvictionReason:
    """The audit reason for evicting a node whose re-attestation raised `error`."""
    return EvictionReason.POLICY_MISMATCH if error.check == "policy" else EvictionReason.ATTESTATION_FAILED


def _verify(evidence_json: str, policy: Policy, nonce: bytes, now: float) -> VerifiedNode:
    try:
        bundle = EvidenceBundle.from_json(evidence_json)
        return verify(bundle, policy, expected_nonce=nonce, now=now)
    except PolicyMismatchError as error:
        raise AdmissionError(f"the node's evidence failed verification: {error}", check="policy") from None
    except AttestationError as error:
        raise AdmissionError(f"the node's evidence failed verification: {error}", check=error.check) from None


def _bounded_proofs(transparency: str) -> str:
    # Published to every caller unread; bounded as a client bounds them (a larger bundle it refuses anyway).
    if len(transparency) > MAX_PROOFS_CHARS:
        raise AdmissionError("the node's stapled transparency proofs are larger than any bundle can be",
                             check="transparency")
    return transparency


MAX_PROOFS_CHARS = 256 * 1024
MAX_NODE_MODELS = 16
MAX_MODEL_NAME = 256


def _check_models(models: tuple[str, ...]) -> None:
    # What the directory publishes for every caller: bounded, printable, each name once.
    if len(models) > MAX_NODE_MODELS or len(set(models)) != len(models) or not all(
            0 < len(name) <= MAX_MODEL_NAME and name.isprintable() for name in models):
        raise AdmissionError(f"a node may list at most {MAX_NODE_MODELS} distinct model names of 1-{MAX_MODEL_NAME} "
                             "printable characters", check="models")


def _checked_task(task: str) -> str:
    # An older node states none, and serves generation only.
    if not task:
        return TASK_GENERATE
    if task not in MODEL_TASKS:
        raise AdmissionError(f"a node's task must be one of {', '.join(MODEL_TASKS)}", check="task")
    return task


def _check_capacity(capacity: int, most: int) -> None:
    # Above the policy's maximum a claim is inflated (honest nodes refuse to start so) and clients would
    # count it as the maximum: admitting it would make the directory and the route audit disagree.
    if not 1 <= capacity <= most:
        raise AdmissionError(f"a node must report a capacity between 1 and the policy's max_node_capacity, {most}",
                             check="capacity")
