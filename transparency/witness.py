"""A witness (c2sp.org/tlog-witness): cosigns a log's checkpoint only if it extends the last one it cosigned.

For each log it follows, the witness keeps the size and root it last cosigned in its state file,
written durably before any cosignature leaves. A checkpoint must be signed by the log, the log
must say which size it thinks the witness is at (`old`), and a consistency proof must lead from
the witness's root to the new one. A smaller checkpoint is a rollback, one of the same size with
another root is a fork: both are refused, and the state is left as it was. The checks run in the
order c2sp.org/tlog-witness lists them, each refusal with its error type, which `apps` answers with
the spec's status: `old` above the checkpoint's size 400; `old` not the witness's size 409 with that
size (`text/x.tlog.size`), which is how a rollback shows; a size-0 checkpoint with another root than
the empty tree's, a proof after `old 0`, a proof that does not verify, or another root at the
witness's own size 422.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from attestation.transparency.checkpoint import Checkpoint, parse_checkpoint
from attestation.transparency.cosignature import CosignatureSigner
from attestation.transparency.errors import ConsistencyProofError, ForkError
from attestation.transparency.merkle import HASH_SIZE, verify_consistency
from attestation.transparency.note import NoteVerifier, Signature, open_note, parse_note
from transparency.errors import (
    LogStoreError,
    StaleSizeError,
    UnknownLogError,
    WitnessConfigError,
    WitnessRequestError,
)

EMPTY_ROOT = hashlib.sha256(b"").digest()  # RFC 9162: the root of the tree of no entries


@dataclass(frozen=True, slots=True)
class Seen:
    size: int
    root: bytes


class Witness:
    """Cosigns checkpoints of the logs in `logs` (keyed by origin = the log key's name)."""

    def __init__(self, signer: CosignatureSigner, logs: Sequence[NoteVerifier], state_path: Path,
                 clock: Callable[[], float] = time.time) -> None:
        self.signer, self.state_path, self.clock = signer, state_path, clock
        self.logs = _by_origin(logs)
        self._lock = threading.Lock()
        self._state = load_state(state_path)

    def seen(self, origin: str) -> Seen:
        return self._state.get(origin, Seen(0, b""))

    def add_checkpoint(self, old_size: int, proof: Sequence[bytes], note_data: bytes) -> Signature:
        """Cosign the checkpoint in `note_data` if it extends what this witness has seen; else raise."""
        checkpoint = self._verified(note_data)
        with self._lock:
            seen = self.seen(checkpoint.origin)
            _check_extends(seen, old_size, proof, checkpoint)
            state = {**self._state, checkpoint.origin: Seen(checkpoint.size, checkpoint.root)}
            save_state(self.state_path, state)  # durable before the cosignature exists
            self._state = state
        return self.signer.cosign(checkpoint.body(), int(self.clock()))

    def _verified(self, note_data: bytes) -> Checkpoint:
        checkpoint = parse_checkpoint(parse_note(note_data).text)
        log = self.logs.get(checkpoint.origin)
        if log is None:
            raise UnknownLogError("this witness does not follow that log")
        open_note(note_data, (log,))
        return checkpoint


def _by_origin(logs: Sequence[NoteVerifier]) -> dict[str, NoteVerifier]:
    """The logs keyed by origin; two different keys of one origin would leave one silently unfollowed."""
    by_origin: dict[str, NoteVerifier] = {}
    for log in logs:
        if by_origin.setdefault(log.name, log).encode() != log.encode():
            raise WitnessConfigError(f"two --log keys name the same log {log.name}; a witness follows one key a log")
    return by_origin


def _check_extends(seen: Seen, old_size: int, proof: Sequence[bytes], checkpoint: Checkpoint) -> None:
    if old_size > checkpoint.size:
        raise WitnessRequestError(f"old size {old_size} is above the checkpoint's size {checkpoint.size}")
    if old_size != seen.size:  # also a rollback (a checkpoint below the witness's size): the log learns the size
        raise StaleSizeError(f"this witness is at size {seen.size}, not {old_size}", seen.size)
    if checkpoint.size == 0 and checkpoint.root != EMPTY_ROOT:
        # No tree of size 0 has another root: cosigning one would vouch for a history no log can have.
        raise ForkError("a checkpoint of size 0 must carry the empty tree's root")
    if seen.size == 0:
        if proof:
            raise ConsistencyProofError("a checkpoint extending the empty tree takes no consistency proof")
        return  # the first checkpoint of a log is trusted on first use, as any witness does
    if checkpoint.size == seen.size and checkpoint.root != seen.root:
        raise ForkError(f"the log shows two trees of size {seen.size}: this witness cosigned another root")
    verify_consistency(seen.size, checkpoint.size, proof, seen.root, checkpoint.root)


def load_state(path: Path) -> dict[str, Seen]:
    """The state file's logs; a missing file is a fresh witness, an unreadable one a LogStoreError."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError):
        raise LogStoreError(f"cannot read the witness state {path}") from None
    try:
        value = json.loads(text)
        return {origin: _seen(item) for origin, item in value["logs"].items()}
    except (ValueError, KeyError, TypeError, AttributeError):
        raise LogStoreError(f"the witness state {path} is corrupt; restore it from a backup, "
                            "never start afresh") from None


def _seen(item: dict) -> Seen:
    root = base64.b64decode(item["root"], validate=True)
    if type(item["size"]) is not int or item["size"] < 0 or len(root) not in (0, HASH_SIZE):
        raise ValueError("bad state entry")
    return Seen(item["size"], root)


def save_state(path: Path, state: dict[str, Seen]) -> None:
    value = {"logs": {origin: {"size": seen.size, "root": base64.b64encode(seen.root).decode()}
                      for origin, seen in sorted(state.items())}}
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with temporary.open("w", encoding="utf-8") as file:
            json.dump(value, file, indent=1)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except OSError as error:
        raise LogStoreError(f"cannot write the witness state ({error.strerror})") from None
