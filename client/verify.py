"""Verifying candidates the client's own way: the gateway's word counts for nothing.

Each candidate's evidence bundle is parsed and run through
`attestation.verifier.verify` under the client's policy. The result must also
name the same node, key configuration and chip the directory listed, otherwise
the directory lied. Verified records are cached (by the exact evidence text) until
they expire, so a steady stream of requests does not re-verify every time.

A candidate's evidence, whatever its bytes, can only get that candidate refused:
anything verifying it raises, even an exception the verifier should have turned
into an AttestationError, makes a failed record (its type named, its message,
which could quote the evidence, dropped), and the request is sealed to the others.
A verified node must then pass the policy's transparency check (`client.transparency`).
"""

from __future__ import annotations

import hashlib
import hmac
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from attestation.bundle import EvidenceBundle
from attestation.errors import AttestationError
from attestation.verifier import VerifiedNode, verify
from client.directory import DirectoryEntry
from client.transparency import TransparencyCheck
from client.types import CandidateRecord
from policy import Policy

MAX_CACHED = 1024


@dataclass(frozen=True, slots=True)
class _Cached:
    node: VerifiedNode


class CandidateVerifier:
    """Verifies directory entries under one policy, caching successes until their evidence expires."""

    def __init__(self, policy: Policy, clock: Callable[[], float] = time.time) -> None:
        self.policy = policy
        self._clock = clock
        self.transparency = TransparencyCheck(policy)  # run on every check: proofs are refreshed, evidence cached
        self._lock = threading.Lock()
        self._cache: dict[bytes, _Cached] = {}

    def check(self, entry: DirectoryEntry) -> CandidateRecord:
        """The candidate's record: verified, or the check that failed and why."""
        record = _record(entry, lambda: self._verified(entry))
        return self.transparency.check(record, entry.transparency, self._clock())

    def check_fresh(self, entry: DirectoryEntry, evidence: str, nonce: bytes) -> CandidateRecord:
        """A record from evidence the node produced over the client's own `nonce` (never cached)."""
        record = _record(entry, lambda: verify(EvidenceBundle.from_json(evidence), self.policy, expected_nonce=nonce,
                                               now=self._clock()))
        return self.transparency.check(record, entry.transparency, self._clock())

    def _verified(self, entry: DirectoryEntry) -> VerifiedNode:
        key = hashlib.sha256(entry.evidence.encode("utf-8", "surrogatepass")).digest()
        now = self._clock()
        with self._lock:
            cached = self._cache.get(key)
        if cached is not None and cached.node.expires_at > now:
            node = cached.node
        else:
            node = verify(EvidenceBundle.from_json(entry.evidence), self.policy, now=now)
            self._remember(key, node)
        return node

    def _remember(self, key: bytes, node: VerifiedNode) -> None:
        with self._lock:
            if len(self._cache) >= MAX_CACHED:
                now = self._clock()
                self._cache = {k: v for k, v in self._cache.items() if v.node.expires_at > now}
                if len(self._cache) >= MAX_CACHED:
                    self._cache.clear()
            self._cache[key] = _Cached(node)


def _record(entry: DirectoryEntry, verified: Callable[[], VerifiedNode]) -> CandidateRecord:
    """The record of `entry` whose evidence `verified()` verifies: the node, or what failed."""
    try:
        node = verified()
    except AttestationError as error:
        return CandidateRecord(entry.node_id, entry.capacity, None, error.check, str(error))
    except Exception as error:  # the candidate's bytes made the verifier fail: that candidate is refused
        return CandidateRecord(entry.node_id, entry.capacity, None, "format",
                               f"the evidence could not be verified: the verifier raised {type(error).__name__} on it")
    mismatch = _listing_mismatch(entry, node)
    if mismatch is not None:
        return CandidateRecord(entry.node_id, entry.capacity, None, "directory", mismatch)
    return CandidateRecord(entry.node_id, entry.capacity, node)


def one_per_chip(records: Sequence[CandidateRecord]) -> list[CandidateRecord]:
    """The records with every verified node after the first on one chip turned into a failure.

    A request is sealed to each chip at most once, whatever node ids its evidence came under.
    """
    seen: set[str] = set()
    kept = []
    for record in records:
        if record.verified is not None and record.verified.hardware_id in seen:
            record = CandidateRecord(record.node_id, record.capacity, None, "directory",
                                     "another candidate of this request attests from the same chip")
        elif record.verified is not None:
            seen.add(record.verified.hardware_id)
        kept.append(record)
    return kept


def _listing_mismatch(entry: DirectoryEntry, node: VerifiedNode) -> str | None:
    """Why the directory's listing disagrees with what the evidence proves, or None."""
    if not hmac.compare_digest(entry.node_id.encode(), node.node_id.encode()):
        return "the directory lists this evidence under another node id; the gateway's listing is wrong"
    if not hmac.compare_digest(entry.key_config, node.key_config):
        return "the directory's key configuration is not the one bound into the evidence"
    if entry.hardware_id != node.hardware_id:
        # Only fresh evidence can differ from the listing's: the node must attest from the chip listed.
        return "the node attests from another chip than the directory's evidence names"
    return None
