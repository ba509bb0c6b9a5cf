"""c2sp.org/tlog-proof@v1: an inclusion proof with the cosigned checkpoint it leads to, checkable offline.

    c2sp.org/tlog-proof@v1
    [extra <base64>]
    index <leaf index>
    <inclusion proof hashes, base64, one a line>
    <blank line>
    <the signed checkpoint note, with its cosignatures>
"""

from __future__ import annotations

import base64
from dataclasses import dataclass

from attestation.transparency.errors import TransparencyError
from attestation.transparency.merkle import HASH_SIZE
from attestation.transparency.note import decode_b64

HEADER = "c2sp.org/tlog-proof@v1"
MAX_PROOF_HASHES = 64
MAX_PROOF_BYTES = 64 * 1024


class ProofFormatError(TransparencyError):
    """A tlog-proof is not in its format."""


@dataclass(frozen=True, slots=True)
class TlogProof:
    index: int
    hashes: tuple[bytes, ...]
    checkpoint: bytes  # the signed note, verified by whoever uses the proof
    extra: bytes | None = None

    def encode(self) -> bytes:
        lines = [HEADER, *([f"extra {base64.b64encode(self.extra).decode()}"] if self.extra is not None else []),
                 f"index {self.index}", *(base64.b64encode(value).decode() for value in self.hashes)]
        return ("\n".join(lines) + "\n\n").encode() + self.checkpoint


def parse_proof(data: bytes) -> TlogProof:
    """Raise ProofFormatError unless `data` is a tlog-proof (never quoting it)."""
    if len(data) > MAX_PROOF_BYTES:
        raise ProofFormatError("a tlog-proof is larger than 64 KiB")
    head, blank, checkpoint = data.partition(b"\n\n")
    try:
        lines = head.decode("ascii").split("\n")
    except UnicodeDecodeError:
        raise ProofFormatError("a tlog-proof's head must be ASCII") from None
    if not blank or lines[0] != HEADER:
        raise ProofFormatError(f"a tlog-proof starts with {HEADER} and ends with a checkpoint after a blank line")
    lines.pop(0)
    extra = None
    if lines and lines[0].startswith("extra "):
        extra = decode_b64(lines.pop(0)[6:], "a tlog-proof's extra data", ProofFormatError)
    if not lines or not lines[0].startswith("index ") or not _decimal(lines[0][6:]):
        raise ProofFormatError("a tlog-proof names its entry with 'index <decimal>'")
    hashes = tuple(decode_b64(line, "a tlog-proof hash", ProofFormatError) for line in lines[1:])
    if len(hashes) > MAX_PROOF_HASHES or any(len(value) != HASH_SIZE for value in hashes):
        raise ProofFormatError(f"a tlog-proof holds at most {MAX_PROOF_HASHES} hashes of {HASH_SIZE} bytes")
    return TlogProof(int(lines[0][6:]), hashes, checkpoint, extra)


def _decimal(text: str) -> bool:
    return text.isascii() and text.isdigit() and (text == "0" or not text.startswith("0"))
