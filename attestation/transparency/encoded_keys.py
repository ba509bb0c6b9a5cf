"""A key's text form, read into a note signer's or a witness's key: the one place that knows both kinds.

A note key (type 0x01, `note.py`) and a witness's cosignature key (type 0x04, `cosignature.py`) share
the C2SP encoding; which class a key becomes depends on its type byte.
"""

from __future__ import annotations

from attestation.transparency.cosignature import COSIGNATURE_TYPE, CosignatureSigner, CosignatureVerifier
from attestation.transparency.errors import NoteFormatError
from attestation.transparency.note import ED25519_TYPE, NoteSigner, NoteVerifier, check_name, decode_b64, key_hash


def parse_verifier(encoded: str) -> NoteVerifier:
    """A verifier key `name+hash+base64(type || key)`; raise NoteFormatError if malformed or inconsistent."""
    name, plus, rest = encoded.strip().partition("+")
    hash_hex, plus2, key_b64 = rest.partition("+")
    if not (plus and plus2) or len(hash_hex) != 8:
        raise NoteFormatError("a verifier key must look like name+hash+base64key")
    check_name(name)
    try:
        key_id = bytes.fromhex(hash_hex)
    except ValueError:
        raise NoteFormatError("a verifier key's hash must be 8 hexadecimal digits") from None
    raw = decode_b64(key_b64, "a verifier key")
    if len(raw) != 33 or raw[0] not in (ED25519_TYPE, COSIGNATURE_TYPE):
        raise NoteFormatError("a verifier key must be an Ed25519 key (type 0x01, or 0x04 for a cosigner)")
    if key_hash(name, raw[0], raw[1:]) != key_id:
        raise NoteFormatError("a verifier key's hash does not match its name and key")
    if raw[0] == COSIGNATURE_TYPE:
        return CosignatureVerifier(name, key_id, raw[0], raw[1:])
    return NoteVerifier(name, key_id, raw[0], raw[1:])


def parse_signer(encoded: str) -> NoteSigner:
    """A private key `PRIVATE+KEY+name+hash+base64`; errors never quote it."""
    fields = encoded.strip().split("+", 4)
    if len(fields) != 5 or fields[:2] != ["PRIVATE", "KEY"]:
        raise NoteFormatError("a signing key must look like PRIVATE+KEY+name+hash+base64key")
    check_name(fields[2])
    raw = decode_b64(fields[4], "a signing key")
    if len(raw) != 33 or raw[0] not in (ED25519_TYPE, COSIGNATURE_TYPE):
        raise NoteFormatError("a signing key must be an Ed25519 key (type 0x01, or 0x04 for a cosigner)")
    if raw[0] == COSIGNATURE_TYPE:
        signer: NoteSigner = CosignatureSigner(fields[2], raw[1:])
    else:
        signer = NoteSigner(fields[2], raw[1:])
    if signer.verifier.key_id.hex() != fields[3].lower():
        raise NoteFormatError("a signing key's hash does not match its name and key")
    return signer
