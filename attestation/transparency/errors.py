"""Transparency errors: part of the attestation hierarchy, one type per thing that can be wrong.

Every parse of a note, checkpoint, tile, proof or policy that comes from outside ends in one of
these. Messages say which part was wrong and what to do; they never quote the bytes they refused
(a log entry or a note may carry anything).
"""

from __future__ import annotations

from attestation.errors import AttestationError


class TransparencyError(AttestationError):
    """Base of every transparency error."""

    check = "transparency"


class NoteFormatError(TransparencyError):
    """A signed note, key or signature line is not in the C2SP signed-note format."""


class NoteSignatureError(TransparencyError):
    """No signature of a note verifies under the keys it must be signed by."""


class CheckpointFormatError(TransparencyError):
    """A checkpoint body is not origin, size and root hash lines (c2sp.org/tlog-checkpoint)."""


class ProofError(TransparencyError):
    """A Merkle proof does not verify against the root it is checked against."""


class InclusionProofError(ProofError):
    """An inclusion proof does not lead from the entry to the checkpoint's root."""


class ConsistencyProofError(ProofError):
    """A consistency proof does not show that the older tree is a prefix of the newer one."""


class TileError(TransparencyError):
    """A tile or entry bundle is malformed, missing, or not what the rest of the log implies."""


class PolicyFormatError(TransparencyError):
    """A transparency policy (c2sp.org/tlog-policy shape) is malformed or inconsistent."""


class StatementFormatError(TransparencyError):
    """A log entry is not a release or key statement in its canonical JSON encoding."""


class ForkError(TransparencyError):
    """Two checkpoints of one log disagree about the same tree: the log has shown different views."""


class RollbackError(TransparencyError):
    """A checkpoint is older (smaller) than one already seen for its log."""


class WitnessQuorumError(TransparencyError):
    """A checkpoint lacks the cosignatures that the policy's quorum of witnesses requires."""


class CheckpointAgeError(TransparencyError):
    """A checkpoint's newest qualifying cosignature is older than the policy allows, or from the future."""


class NotLoggedError(TransparencyError):
    """A release or key statement has no inclusion proof in the log."""


class WrongEntryError(TransparencyError):
    """A proof is for another entry than the statement it was offered for."""
