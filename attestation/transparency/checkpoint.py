"""C2SP tlog-checkpoint: the signed body that names a log's tree (origin, size, root hash).

The body is `<origin>\\n<size>\\n<base64 root>\\n` followed by optional extension lines; it is the
text of a signed note whose first signature is the log's. The origin is the log's unique name,
so that a checkpoint of one log can never be taken for another's.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass

from attestation.transparency.errors import CheckpointFormatError
from attestation.transparency.merkle import HASH_SIZE
from attestation.transparency.note import Note, NoteVerifier, decode_b64, open_note

MAX_SIZE = (1 << 63) - 1


@dataclass(frozen=True, slots=True)
class Checkpoint:
    origin: str
    size: int
    root: bytes
    extensions: tuple[str, ...] = ()

    def body(self) -> str:
        lines = [self.origin, str(self.size), base64.b64encode(self.root).decode(), *self.extensions]
        return "".join(f"{line}\n" for line in lines)


def parse_checkpoint(text: str) -> Checkpoint:
    """A checkpoint body; raise CheckpointFormatError unless it is origin, size and root lines."""
    if not text.endswith("\n"):
        raise CheckpointFormatError("a checkpoint must end in a newline")
    lines = text[:-1].split("\n")
    if len(lines) < 3:
        raise CheckpointFormatError("a checkpoint needs an origin, a size and a root hash line")
    origin, size, root, *extensions = lines
    if not origin or origin != origin.strip():
        raise CheckpointFormatError("a checkpoint's origin line must be non-empty with no surrounding spaces")
    if not (size.isascii() and size.isdigit()) or (size != "0" and size.startswith("0")) or int(size) > MAX_SIZE:
        raise CheckpointFormatError("a checkpoint's size must be a decimal number below 2**63 with no leading zero")
    root_hash = decode_b64(root, "a checkpoint's root hash", CheckpointFormatError)
    if len(root_hash) != HASH_SIZE:
        raise CheckpointFormatError(f"a checkpoint's root hash must be {HASH_SIZE} bytes")
    if any(not line for line in extensions):
        raise CheckpointFormatError("a checkpoint's extension lines must not be empty")
    return Checkpoint(origin, int(size), root_hash, tuple(extensions))


@dataclass(frozen=True, slots=True)
class SignedCheckpoint:
    """A checkpoint with the note it came in (its signatures, the log's and any cosignatures)."""

    checkpoint: Checkpoint
    note: Note


def open_checkpoint(data: bytes | str, log: NoteVerifier, origin: str | None = None) -> SignedCheckpoint:
    """Verify a checkpoint note signed by `log` and parse its body; its origin must be the log key's name
    (or `origin`)."""
    note, _ = open_note(data, (log,))
    checkpoint = parse_checkpoint(note.text)
    if checkpoint.origin != (origin or log.name):
        raise CheckpointFormatError("the checkpoint's origin is not the log this key names")
    return SignedCheckpoint(checkpoint, note)
