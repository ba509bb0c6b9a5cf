"""The client's offline check of a node's transparency: its release and its key are in the witnessed log.

A node staples two entries with their tlog-proofs: the release statement of the code it runs and
the key statement of the OHTTP key configuration it serves. The client needs no request to the log
or the witnesses (a lookup would tell them who is about to send a request). It checks, each with its
own error: both proofs are there (NotLoggedError), each leads from its entry to a checkpoint signed
by the policy's log (WrongEntryError otherwise), the checkpoint carries the quorum of witness
cosignatures (WitnessQuorumError), recent enough (CheckpointAgeError), and the log has never shown
the client's memory two roots for one size (ForkError; from then on the log is forked and nothing of
it passes). Then the logged statements must be this node's: the attested code, policy and model
digests, the served key configuration and measurement, and the receipt key its evidence binds (so a
receipt checks against the log as against the evidence).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from dataclasses import dataclass, field

from attestation.transparency.checkpoint import Checkpoint, open_checkpoint
from attestation.transparency.errors import (
    CheckpointAgeError,
    ForkError,
    InclusionProofError,
    NotLoggedError,
    StatementFormatError,
    WitnessQuorumError,
    WrongEntryError,
)
from attestation.transparency.merkle import leaf_hash, verify_inclusion
from attestation.transparency.note import Note
from attestation.transparency.policy import TransparencyPolicy
from attestation.transparency.proof import parse_proof
from attestation.transparency.statements import NodeKeyStatement, ReleaseStatement, decode_statement

CLOCK_SKEW_S = 60  # a cosignature this far in the future is still taken as now
MAX_BUNDLE_BYTES = 256 * 1024


@dataclass(frozen=True, slots=True)
class TransparencyRequirement:
    """A policy's transparency section: whom to trust, and how old a checkpoint may be."""

    policy: TransparencyPolicy
    max_age_s: int


@dataclass(frozen=True, slots=True)
class StapledEntry:
    entry: bytes
    proof: bytes  # a tlog-proof


@dataclass(frozen=True, slots=True)
class ProofBundle:
    """What a node staples to its evidence: its release's and its key's entries, each with a tlog-proof."""

    release: StapledEntry | None
    node_key: StapledEntry | None

    def to_json(self) -> str:
        def one(stapled: StapledEntry | None) -> dict[str, str] | None:
            return None if stapled is None else {"entry": base64.b64encode(stapled.entry).decode(),
                                                 "proof": base64.b64encode(stapled.proof).decode()}
        return json.dumps({"release": one(self.release), "node_key": one(self.node_key)}, sort_keys=True)


def parse_bundle(data: bytes | str) -> ProofBundle:
    if len(data) > MAX_BUNDLE_BYTES:
        raise StatementFormatError("a transparency proof bundle is larger than 256 KiB")
    try:
        value = json.loads(data)
        return ProofBundle(*(_stapled(value.get(name)) for name in ("release", "node_key")))
    except (ValueError, KeyError, AttributeError, TypeError, binascii.Error, RecursionError):
        raise StatementFormatError("a transparency proof bundle is not JSON of base64 entries and proofs") from None


def _stapled(value: object) -> StapledEntry | None:
    if value is None:
        return None
    # Anything but an object of two base64 strings fails below with an error parse_bundle turns into its own.
    entry, proof = value["entry"], value["proof"]  # type: ignore[index]
    return StapledEntry(base64.b64decode(entry, validate=True), base64.b64decode(proof, validate=True))


@dataclass(slots=True)
class CheckpointMemory:
    """The roots a client has seen per log and size: two roots for one size is a fork, and the log stays forked.

    Which of two views is the honest one cannot be told, and the view shown first may well be the fork:
    once a log has shown two trees of one size, no checkpoint of it is accepted again (`forked` is never
    forgotten; it holds at most the logs whose keys the client trusts, whose signatures it checked).
    Bounded otherwise: a long-lived client sees a new size every time the log grows, and its memory must
    not grow with the log. The oldest sizes are forgotten first; a fork is caught among the last `limit`
    checkpoints seen, which covers every node a client draws from at one time.
    """

    roots: dict[tuple[str, int], bytes] = field(default_factory=dict)
    forked: dict[str, int] = field(default_factory=dict)  # origin -> a size it showed two trees of
    limit: int = 4096

    def remember(self, checkpoint: Checkpoint) -> None:
        key = (checkpoint.origin, checkpoint.size)
        if self.roots.setdefault(key, checkpoint.root) != checkpoint.root:
            self.forked.setdefault(checkpoint.origin, checkpoint.size)
        if (fork := self.fork(checkpoint.origin)) is not None:
            raise fork
        while len(self.roots) > self.limit:
            del self.roots[next(iter(self.roots))]  # dicts keep insertion order: the oldest goes first

    def fork(self, origin: str) -> ForkError | None:
        """The error to refuse the log `origin` with once it has shown two trees of one size; else None."""
        size = self.forked.get(origin)
        if size is None:
            return None
        return ForkError(f"the transparency log {origin} is forked: it showed this client two trees of size {size}, "
                         "so no node proven from it is used; report it to the log's monitors")


@dataclass(frozen=True, slots=True)
class NodeIdentity:
    """What the node's verified evidence says: its digests (hex) and the key configuration it serves."""

    code_digest: str
    policy_digest: str
    model_digest: str
    measurement: str  # the measurement digest bound into the evidence
    key_config: bytes
    receipt_key: bytes  # the Ed25519 key the evidence binds, which signs the node's receipts


@dataclass(frozen=True, slots=True)
class LoggedNode:
    release: ReleaseStatement
    node_key: NodeKeyStatement
    checkpoint_sizes: tuple[int, int]


def check_node(bundle: ProofBundle | None, node: NodeIdentity, requirement: TransparencyRequirement, now: float,
               memory: CheckpointMemory | None = None) -> LoggedNode:
    """Raise the failing check's TransparencyError unless the node's release and key are logged and witnessed."""
    memory = memory if memory is not None else CheckpointMemory()
    if (fork := memory.fork(requirement.policy.log.name)) is not None:  # a checkpoint's origin is its key's name
        raise fork
    if bundle is None or bundle.release is None:
        raise NotLoggedError("the node's release is not logged: it offers no inclusion proof for it")
    if bundle.node_key is None:
        raise NotLoggedError("the node's key is not logged: it offers no inclusion proof for it")
    release_checkpoint = verify_stapled(bundle.release, requirement, now, memory)
    key_checkpoint = verify_stapled(bundle.node_key, requirement, now, memory)
    release, node_key = _statement(bundle.release.entry), _statement(bundle.node_key.entry)
    _check_release(release, node)
    _check_key(node_key, node, now)
    return LoggedNode(release, node_key, (release_checkpoint.size, key_checkpoint.size))


def verify_stapled(stapled: StapledEntry, requirement: TransparencyRequirement, now: float,
                   memory: CheckpointMemory) -> Checkpoint:
    """Check one entry's tlog-proof: signature, quorum, age, fork, inclusion; return its checkpoint."""
    policy = requirement.policy
    proof = parse_proof(stapled.proof)
    signed = open_checkpoint(proof.checkpoint, policy.log)
    _check_witnessed(signed.note, requirement, now)
    memory.remember(signed.checkpoint)
    try:
        verify_inclusion(leaf_hash(stapled.entry), proof.index, signed.checkpoint.size, proof.hashes,
                         signed.checkpoint.root)
    except InclusionProofError:
        raise WrongEntryError("the inclusion proof is not for this entry (or not in this checkpoint)") from None
    return signed.checkpoint


def _check_witnessed(note: Note, requirement: TransparencyRequirement, now: float) -> None:
    policy = requirement.policy
    if policy.quorum is None:  # only cosignatures carry a time: with none required, no age could be checked
        raise WitnessQuorumError("the policy names no witness quorum: the log's signature alone shows neither "
                                 "that others see this tree nor how old it is; name witnesses and a quorum")
    times = {name: verifier.timestamp(note) for name, verifier in policy.witnesses.items()}
    cosigned = {name for name, when in times.items() if when is not None}
    if not policy.satisfied_by(cosigned):
        raise WitnessQuorumError(f"the checkpoint is cosigned by {len(cosigned)} of the policy's witnesses, "
                                 "short of its quorum")
    if any(when > now + CLOCK_SKEW_S for when in times.values() if when is not None):
        raise CheckpointAgeError("a witness cosigned the checkpoint in the future; check this machine's clock")
    fresh = {name for name in cosigned if now - times[name] <= requirement.max_age_s}  # type: ignore[operator]
    if not policy.satisfied_by(fresh):
        raise CheckpointAgeError(f"the checkpoint's cosignatures are older than the policy's "
                                 f"{requirement.max_age_s} s; the node must staple a fresher proof")


def _statement(entry: bytes) -> object:
    try:
        return decode_statement(entry)
    except StatementFormatError:
        raise WrongEntryError("a stapled entry is not a statement Veil logs") from None


def _check_release(release: object, node: NodeIdentity) -> None:
    if not isinstance(release, ReleaseStatement):
        raise WrongEntryError("the release proof is for an entry that is not a release")
    if (release.code_digest, release.policy_digest) != (node.code_digest, node.policy_digest):
        raise WrongEntryError("the logged release is not the code and policy this node attests to")
    if node.model_digest not in release.model_digests:
        raise WrongEntryError("the logged release does not list the model this node attests to")


def _check_key(node_key: object, node: NodeIdentity, now: float) -> None:
    if not isinstance(node_key, NodeKeyStatement):
        raise WrongEntryError("the key proof is for an entry that is not a node key")
    if node_key.key_config_digest != hashlib.sha256(node.key_config).hexdigest():
        raise WrongEntryError("the logged key is not the key configuration this node serves")
    if node_key.measurement != node.measurement:
        raise WrongEntryError("the logged key belongs to another measurement than this node's")
    if node_key.receipt_key != node.receipt_key.hex():
        raise WrongEntryError("the logged key carries another receipt key than the one this node's evidence binds")
    if not node_key.not_before <= now < node_key.not_after:
        raise NotLoggedError("the node's key is logged for another time: outside its logged validity")

