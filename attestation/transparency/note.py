"""C2SP signed notes: Ed25519 keys in the `name+hash+base64` encoding, signing and opening notes.

A note is UTF-8 text ending in a newline, then a blank line, then signature lines
`— <name> <base64(key hash[4] || signature)>`. The key hash is the first 4 bytes of
SHA-256(name || 0x0A || type || public key), with type 0x01 for Ed25519 note keys (and 0x04 for
cosignature/v1 keys, `cosignature.py`; `encoded_keys.py` reads either kind's text form). Opening a note checks every signature by a known key and
ignores signatures by unknown ones, as golang.org/x/mod/sumdb/note does.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import unicodedata
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

from attestation.transparency.errors import NoteFormatError, NoteSignatureError

ED25519_TYPE = 0x01
SIGNATURE_PREFIX = "\u2014 "  # an em dash and a space begin every signature line
MAX_SIGNATURES = 100  # as golang.org/x/mod: a note with more is refused, not scanned
MAX_NOTE_BYTES = 1 << 20


def key_hash(name: str, key_type: int, public: bytes) -> bytes:
    return hashlib.sha256(name.encode() + b"\n" + bytes([key_type]) + public).digest()[:4]


def check_name(name: str) -> None:
    if not name or "+" in name or any(char.isspace() or unicodedata.category(char)[0] == "C" for char in name):
        raise NoteFormatError("a key name must be non-empty, with no '+', space or control character")


def decode_b64(text: str, what: str, error: type[Exception] = NoteFormatError) -> bytes:
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError):
        raise error(f"{what} is not valid base64") from None


@dataclass(frozen=True, slots=True)
class NoteVerifier:
    """A public key that signs notes: its name, key hash, type and raw key."""

    name: str
    key_id: bytes
    key_type: int
    public: bytes

    def encode(self) -> str:
        return f"{self.name}+{self.key_id.hex()}+{base64.b64encode(bytes([self.key_type]) + self.public).decode()}"

    def message(self, text: str, signature: bytes) -> tuple[bytes, bytes]:
        """The signed message and Ed25519 signature that a signature line's bytes stand for."""
        return text.encode(), signature

    def verify(self, text: str, signature: bytes) -> bool:
        """Whether `signature` (the bytes after the key hash) signs `text` under this key."""
        message, raw = self.message(text, signature)
        if len(raw) != 64:
            return False
        try:
            Ed25519PublicKey.from_public_bytes(self.public).verify(raw, message)
        except InvalidSignature:
            return False
        return True


@dataclass(frozen=True, slots=True)
class NoteSigner:
    """An Ed25519 private key that signs notes; `repr` shows the name only."""

    name: str
    seed: bytes
    key_type = ED25519_TYPE

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    @property
    def public(self) -> bytes:
        return Ed25519PrivateKey.from_private_bytes(self.seed).public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)

    @property
    def verifier(self) -> NoteVerifier:
        return NoteVerifier(self.name, key_hash(self.name, self.key_type, self.public), self.key_type, self.public)

    def encode(self) -> str:
        """`PRIVATE+KEY+name+hash+base64(type || seed)`: keep it secret."""
        key_id = self.verifier.key_id.hex()
        return f"PRIVATE+KEY+{self.name}+{key_id}+{base64.b64encode(bytes([self.key_type]) + self.seed).decode()}"

    def signature_line(self, text: str) -> str:
        signature = Ed25519PrivateKey.from_private_bytes(self.seed).sign(text.encode())
        return f"{SIGNATURE_PREFIX}{self.name} {base64.b64encode(self.verifier.key_id + signature).decode()}\n"


def new_seed() -> bytes:
    return Ed25519PrivateKey.generate().private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())


def generate_signer(name: str) -> NoteSigner:
    check_name(name)
    return NoteSigner(name, new_seed())


@dataclass(frozen=True, slots=True)
class Signature:
    """One signature line: the signer's name, key hash and the bytes after the key hash."""

    name: str
    key_id: bytes
    signature: bytes

    def encode(self) -> str:
        return f"{SIGNATURE_PREFIX}{self.name} {base64.b64encode(self.key_id + self.signature).decode()}\n"


@dataclass(frozen=True, slots=True)
class Note:
    """A note's text and every signature line it carries (verified or not)."""

    text: str
    signatures: tuple[Signature, ...]

    def encode(self) -> str:
        return self.text + "\n" + "".join(signature.encode() for signature in self.signatures)

    def verified_by(self, verifier: NoteVerifier) -> Signature | None:
        """The signature by `verifier` that verifies, or None (a signature with its key hash that fails: raise)."""
        for signature in self.signatures:
            if signature.name == verifier.name and signature.key_id == verifier.key_id:
                if not verifier.verify(self.text, signature.signature):
                    raise NoteSignatureError(f"the signature by {verifier.name} does not verify")
                return signature
        return None


def sign_note(text: str, *signers: NoteSigner) -> str:
    check_text(text)
    return text + "\n" + "".join(signer.signature_line(text) for signer in signers)


def check_text(text: str) -> None:
    if not text.endswith("\n"):
        raise NoteFormatError("a note's text must end in a newline")
    if any(unicodedata.category(char) == "Cc" and char != "\n" for char in text):
        raise NoteFormatError("a note's text must not hold control characters other than newlines")


def parse_note(data: bytes | str) -> Note:
    """Split a signed note into text and signature lines; raise NoteFormatError if it is not one."""
    if isinstance(data, bytes):
        if len(data) > MAX_NOTE_BYTES:
            raise NoteFormatError("a signed note is larger than 1 MiB")
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError:
            raise NoteFormatError("a signed note must be UTF-8") from None
    text, blank, signed = data.rpartition("\n\n")
    if not blank or not signed.endswith("\n"):
        raise NoteFormatError("a signed note must be text, a blank line and newline-ended signature lines")
    text += "\n"
    check_text(text)
    lines = signed[:-1].split("\n")
    if len(lines) > MAX_SIGNATURES:
        raise NoteFormatError(f"a signed note carries more than {MAX_SIGNATURES} signatures")
    return Note(text, tuple(_parse_signature(line) for line in lines))


def _parse_signature(line: str) -> Signature:
    if not line.startswith(SIGNATURE_PREFIX):
        raise NoteFormatError("a signature line must begin with an em dash and a space")
    name, space, encoded = line[len(SIGNATURE_PREFIX):].partition(" ")
    if not space or " " in encoded:
        raise NoteFormatError("a signature line must be a name and one base64 field")
    check_name(name)
    raw = decode_b64(encoded, "a note signature")
    if len(raw) < 5:
        raise NoteFormatError("a note signature is shorter than its key hash")
    return Signature(name, raw[:4], raw[4:])


def open_note(data: bytes | str, verifiers: tuple[NoteVerifier, ...]) -> tuple[Note, tuple[NoteVerifier, ...]]:
    """Parse a note and return it with the known verifiers whose signatures verify (at least one)."""
    note = parse_note(data)
    signed = tuple(verifier for verifier in verifiers if note.verified_by(verifier) is not None)
    if not signed:
        raise NoteSignatureError("the note is not signed by any key this verifier knows")
    return note, signed
