"""C2SP tlog-cosignature: a witness's `cosignature/v1` signature on a checkpoint.

A cosigner's key has type 0x04 (its key hash is SHA-256(name || 0x0A || 0x04 || key)[:4]). It signs
`cosignature/v1\\ntime <seconds>\\n` followed by the checkpoint body, and its signature line carries
key hash || timestamp (8 bytes, big-endian) || Ed25519 signature: the time is when the witness
saw the checkpoint consistent with everything it had seen before, which is what a client's maximum
checkpoint age is measured against.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from attestation.transparency.note import (
    Note,
    NoteSigner,
    NoteVerifier,
    Signature,
    check_name,
    key_hash,
    new_seed,
)

COSIGNATURE_TYPE = 0x04
_HEADER = "cosignature/v1\ntime {}\n"


def cosigned_message(text: str, timestamp: int) -> bytes:
    return (_HEADER.format(timestamp) + text).encode()


@dataclass(frozen=True, slots=True)
class CosignatureVerifier(NoteVerifier):
    """A witness's public key; a signature's bytes are its timestamp then the Ed25519 signature."""

    def message(self, text: str, signature: bytes) -> tuple[bytes, bytes]:
        if len(signature) != 8 + 64:
            return b"", b""
        return cosigned_message(text, struct.unpack(">Q", signature[:8])[0]), signature[8:]

    def timestamp(self, note: Note) -> int | None:
        """When this witness cosigned `note` (its signature verified), or None when it did not."""
        signature = note.verified_by(self)
        return None if signature is None else struct.unpack(">Q", signature.signature[:8])[0]


@dataclass(frozen=True, slots=True)
class CosignatureSigner(NoteSigner):
    """A witness's private key."""

    key_type = COSIGNATURE_TYPE

    @property
    def verifier(self) -> CosignatureVerifier:
        return CosignatureVerifier(self.name, key_hash(self.name, COSIGNATURE_TYPE, self.public), COSIGNATURE_TYPE,
                                   self.public)

    def cosign(self, text: str, timestamp: int) -> Signature:
        signature = Ed25519PrivateKey.from_private_bytes(self.seed).sign(cosigned_message(text, timestamp))
        return Signature(self.name, self.verifier.key_id, struct.pack(">Q", timestamp) + signature)

    def signature_line(self, text: str) -> str:
        raise TypeError("a cosigner signs checkpoints with a time: use cosign()")


def generate_cosigner(name: str) -> CosignatureSigner:
    check_name(name)
    return CosignatureSigner(name, new_seed())

