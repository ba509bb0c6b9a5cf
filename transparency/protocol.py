"""The add-checkpoint exchange of c2sp.org/tlog-witness, both sides.

The log POSTs to `<witness>/add-checkpoint`:

    old <size the log thinks the witness is at>
    <consistency proof, one base64 hash a line>
    <blank line>
    <the signed checkpoint note>

and the witness answers 200 with its cosignature line, or 409 with its own size (one decimal line,
`text/x.tlog.size`) when `old` was wrong, so the log can send a proof from there.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass

import httpx

from attestation.transparency.errors import NoteFormatError
from attestation.transparency.note import Note, Signature, decode_b64, parse_note
from transparency.errors import StaleSizeError, WitnessRequestError

MAX_REQUEST_BYTES = 64 * 1024
# c2sp.org/tlog-witness: "The client MUST NOT send more than 63 consistency proof lines."
MAX_PROOF_HASHES = 63
SIZE_MEDIA_TYPE = "text/x.tlog.size"


@dataclass(frozen=True, slots=True)
class AddCheckpoint:
    old_size: int
    proof: tuple[bytes, ...]
    note: bytes


def encode_add_checkpoint(request: AddCheckpoint) -> bytes:
    if len(request.proof) > MAX_PROOF_HASHES:
        raise WitnessRequestError(f"a consistency proof sent to a witness has at most {MAX_PROOF_HASHES} hashes")
    lines = [f"old {request.old_size}", *(base64.b64encode(value).decode() for value in request.proof)]
    return ("\n".join(lines) + "\n\n").encode() + request.note


def parse_add_checkpoint(body: bytes) -> AddCheckpoint:
    """Raise WitnessRequestError unless `body` is an add-checkpoint request (never quoting it)."""
    head, blank, note = body.partition(b"\n\n")
    if not blank:
        raise WitnessRequestError("an add-checkpoint request is old, proof lines, a blank line and a checkpoint")
    try:
        lines = head.decode("ascii").split("\n")
    except UnicodeDecodeError:
        raise WitnessRequestError("an add-checkpoint request's head must be ASCII") from None
    old = lines[0].removeprefix("old ")
    if old == lines[0] or not old.isdigit() or (old != "0" and old.startswith("0")):
        raise WitnessRequestError("an add-checkpoint request starts with 'old <size>'")
    if len(lines) - 1 > MAX_PROOF_HASHES:
        raise WitnessRequestError(f"a consistency proof has at most {MAX_PROOF_HASHES} hashes")
    proof = tuple(decode_b64(line, "a proof hash", WitnessRequestError) for line in lines[1:])
    return AddCheckpoint(int(old), proof, note)


def request_cosignature(client: httpx.Client, url: str, request: AddCheckpoint) -> Signature:
    """Ask the witness at `url`; raise StaleSizeError (with its size) on 409, WitnessRequestError otherwise."""
    try:
        answer = client.post(f"{url.rstrip('/')}/add-checkpoint", content=encode_add_checkpoint(request))
    except httpx.HTTPError as error:
        raise WitnessRequestError(f"cannot reach the witness ({type(error).__name__})") from None
    if answer.status_code == 409 and answer.headers.get("content-type", "").startswith(SIZE_MEDIA_TYPE):
        size = answer.text.strip()
        if size.isdigit():
            raise StaleSizeError("the witness is at another size", int(size))
    if answer.status_code != 200:
        raise WitnessRequestError(f"the witness refused the checkpoint ({answer.status_code}: {_reason(answer)})")
    return _one_signature(answer.content)


def _reason(answer: httpx.Response) -> str:
    # A witness's refusal is one short line of its own words; anything else is not shown.
    text = answer.text.strip()
    return text if len(text) < 200 and text.isprintable() else "no reason given"


def _one_signature(body: bytes) -> Signature:
    try:
        note: Note = parse_note(b"x\n\n" + body)
    except NoteFormatError:
        raise WitnessRequestError("the witness's answer is not a cosignature line") from None
    if len(note.signatures) != 1:
        raise WitnessRequestError("the witness's answer must be exactly one cosignature line")
    return note.signatures[0]


def cosignature_line(signature: Signature) -> bytes:
    return signature.encode().encode()

