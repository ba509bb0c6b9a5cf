"""The SDK's transparency check: a verified node passes only if its release and key are in the witnessed log.

After a candidate's evidence verifies, its stapled proofs (from the directory, unsigned: they prove
themselves) are checked offline with `attestation.transparency.client_check.check_node` against the
identity the evidence proved: code, policy and model digests, measurement and served key
configuration. No request goes to the log or a witness. One CheckpointMemory per client sees every
node's checkpoints, so a log showing two trees of one size to this client is caught across nodes and
requests; from then on that log is forked for this client, which says so once (an error in this logger)
and refuses every node proven from it, those of the view it saw first and those already checked for the
same request too (`refuse_if_forked`).
A policy that does not require transparency is said out loud (a warning in this logger), never silently.
"""

from __future__ import annotations

import logging
import threading

from attestation.transparency.client_check import CheckpointMemory, NodeIdentity, check_node, parse_bundle
from attestation.transparency.errors import (
    CheckpointAgeError,
    ForkError,
    NotLoggedError,
    TransparencyError,
    WitnessQuorumError,
    WrongEntryError,
)
from attestation.transparency.requirement import transparency_requirement
from attestation.verifier import VerifiedNode
from client.types import CandidateRecord
from policy import Policy

_log = logging.getLogger("veil.client")

# The failed check each refusal is recorded under (CandidateRecord.failed_check), one per cause.
_CHECKS: tuple[tuple[type[TransparencyError], str], ...] = (
    (NotLoggedError, "transparency/not-logged"), (WrongEntryError, "transparency/wrong-entry"),
    (WitnessQuorumError, "transparency/witness-quorum"), (CheckpointAgeError, "transparency/checkpoint-age"),
    (ForkError, "transparency/fork"), (TransparencyError, "transparency/proof"),
)


def without_transparency_warning(policy: Policy) -> str | None:
    """What to say when `policy` accepts nodes without logged releases and keys; None if it requires them."""
    if policy.transparency.required:
        return None
    return (f"policy {policy.name!r} does not require transparency: nodes are accepted without proof that "
            "their release and key are in a public, witnessed log")


class TransparencyCheck:
    """Checks verified candidates' stapled proofs under one policy (thread-safe)."""

    def __init__(self, policy: Policy) -> None:
        self._refusal: TransparencyError | None = None
        try:
            self.requirement = transparency_requirement(policy.transparency)
        except NotLoggedError as error:  # required, no log named yet: every node is refused with this
            self.requirement, self._refusal = None, error
        self.required = policy.transparency.required
        self.memory = CheckpointMemory()
        self._lock = threading.Lock()
        self._said_forked = False
        if (warning := without_transparency_warning(policy)) is not None:
            _log.warning("veil client: %s", warning)

    def check(self, record: CandidateRecord, proofs: str | None, now: float) -> CandidateRecord:
        """`record` if its node is not verified, or its proofs pass; else the record of the refusal."""
        node = record.verified
        if node is None or not self.required:
            return record
        try:
            if self._refusal is not None:
                raise self._refusal
            bundle = None if proofs is None else parse_bundle(proofs)
            with self._lock:  # the memory is shared by every candidate of every request
                check_node(bundle, identity(node), self.requirement, now, self.memory)  # type: ignore[arg-type]
        except ForkError as error:
            self._say_forked(error)
            return _refused(record, error)
        except TransparencyError as error:
            return _refused(record, error)
        except Exception as error:  # the candidate's bytes made a parser fail: that candidate is refused
            return CandidateRecord(record.node_id, record.capacity, None, "transparency/proof",
                                   f"the stapled proofs could not be checked: {type(error).__name__} on them")
        return record

    def refuse_if_forked(self, records: list[CandidateRecord]) -> list[CandidateRecord]:
        """`records` (one request's candidates, checked) with every verified one refused if the log is forked.

        A fork found by a later candidate condemns the earlier ones too: their proofs come from the same
        log, and which of its views is the honest one cannot be told."""
        error = self.fork()
        if error is None:
            return records
        return [record if record.verified is None else _refused(record, error) for record in records]

    def fork(self) -> ForkError | None:
        """The policy's log's ForkError once this client has seen it show two trees of one size, else None."""
        if self.requirement is None:
            return None
        with self._lock:
            return self.memory.fork(self.requirement.policy.log.name)

    def _say_forked(self, error: ForkError) -> None:
        """Say once, out loud, that the log is forked: every later refusal is this one."""
        with self._lock:
            said, self._said_forked = self._said_forked, True
        if not said:
            _log.error("veil client: %s", error)


def _refused(record: CandidateRecord, error: TransparencyError) -> CandidateRecord:
    check = next(name for kind, name in _CHECKS if isinstance(error, kind))
    return CandidateRecord(record.node_id, record.capacity, None, check, str(error))


def identity(node: VerifiedNode) -> NodeIdentity:
    """What the verified evidence says about the node, as the log's statements name it."""
    measurement = node.measurement
    return NodeIdentity(measurement.code_digest.hex(), measurement.policy_digest.hex(),
                        measurement.model_digest.hex(), measurement.digest().hex(), node.key_config,
                        node.receipt_key)
