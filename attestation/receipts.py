"""Signed answers: the receipt a node signs for each answer, and its verification.

A receipt is the attested code's signed word that it gave this answer to this request: the node's
receipt key is generated in memory at start and bound into its evidence beside its OHTTP key
configuration (`attestation.binding`), and logged in its key statements
(`attestation.transparency.statements.NodeKeyStatement.receipt_key`). It travels only inside the
encryption, as the answer's Binary HTTP trailer `veil-receipt`, so only the client ever holds it.

    receipt   = canonical JSON (sorted keys, no spaces, ASCII) of
                {"type": "veil.receipt/v1",
                 "key_id":          hex SHA-256 of the receipt key (its 32 raw Ed25519 bytes),
                 "request_sha256":  hex SHA-256 of the Binary HTTP request as the node decrypted it,
                 "response_sha256": hex SHA-256 of the response body (a streamed one: all its content, in order),
                 "status":          the response's HTTP status,
                 "model_digest":    hex, the model digest the node attests to,
                 "measurement":     hex, the measurement digest bound into its evidence,
                 "time":            Unix seconds when the node signed,
                 "signature":       base64 of the Ed25519 signature below}
    signature = Ed25519(receipt key, "veil receipt v1\\n" ‖ canonical JSON of every field but "signature")

The prefix keeps a receipt signature from being valid as anything else. Parsing is strict (one
encoding per receipt, no unknown or missing field) and every refusal is a `ReceiptError` naming what
was wrong, never quoting the bytes. Whoever holds a receipt can test guesses of the request and the
answer against its hashes: it is the client's to keep or to show.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from dataclasses import asdict, dataclass, replace
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from attestation.binding import RECEIPT_KEY_SIZE
from attestation.errors import AttestationError
from attestation.measurement import Measurement
from attestation.transparency.statements import NodeKeyStatement

RECEIPT_TYPE = "veil.receipt/v1"
RECEIPT_DOMAIN = b"veil receipt v1\n"
RECEIPT_TRAILER = b"veil-receipt"  # the Binary HTTP trailer field that carries it
MAX_RECEIPT_BYTES = 1024
_SIGNATURE_SIZE = 64
_HEX32 = re.compile(r"[0-9a-f]{64}")
_DIGEST_FIELDS = ("key_id", "request_sha256", "response_sha256", "model_digest", "measurement")
_FIELDS = frozenset({"type", "status", "time", "signature", *_DIGEST_FIELDS})
_MAX_TIME = 1 << 40


class ReceiptError(AttestationError):
    """Base of every receipt refusal."""

    check = "receipt"


class ReceiptFormatError(ReceiptError):
    """A receipt is not a veil.receipt/v1 in its canonical encoding."""


class MissingReceiptError(ReceiptError):
    """An answer came without the receipt every answer carries."""


class ReceiptKeyError(ReceiptError):
    """A receipt names, or a statement carries, another key than the one it is checked against."""


class ReceiptSignatureError(ReceiptError):
    """A receipt's signature does not verify under the receipt key."""


class ReceiptMismatchError(ReceiptError):
    """A valid receipt for something else: another request, body, status, model or measurement."""


class ReceiptTimeError(ReceiptError):
    """A receipt signed too far from now, or outside its key's logged validity."""


@dataclass(frozen=True, slots=True)
class Receipt:
    """One parsed receipt (digests in lowercase hex); `encode()` gives back its one wire form."""

    key_id: str
    request_sha256: str
    response_sha256: str
    status: int
    model_digest: str
    measurement: str
    time: int
    signature: bytes

    def signed_bytes(self) -> bytes:
        """What the signature covers: the domain prefix and every other field, canonically."""
        fields = {name: value for name, value in asdict(self).items() if name != "signature"}
        return RECEIPT_DOMAIN + _canonical({"type": RECEIPT_TYPE, **fields})

    def encode(self) -> bytes:
        fields = {**asdict(self), "signature": base64.b64encode(self.signature).decode("ascii")}
        return _canonical({"type": RECEIPT_TYPE, **fields})

    def to_json(self) -> dict[str, Any]:
        """The receipt as a JSON object (what `veil receipt verify` reads back)."""
        return json.loads(self.encode())


def key_id(receipt_key: bytes) -> str:
    """The key id receipts name: hex SHA-256 of the key's 32 raw bytes."""
    return hashlib.sha256(receipt_key).hexdigest()


class ReceiptSigner:
    """A node's receipt key: generated in memory, never exported, written or shown (its repr says nothing)."""

    __slots__ = ("_private", "public_key", "key_id")

    def __init__(self, private: Ed25519PrivateKey) -> None:
        self._private = private
        self.public_key = private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        self.key_id = key_id(self.public_key)

    @classmethod
    def generate(cls) -> ReceiptSigner:
        return cls(Ed25519PrivateKey.generate())

    def __repr__(self) -> str:
        return "ReceiptSigner(<in memory>)"

    def sign(self, request: bytes, body_sha256: bytes, status: int, measurement: Measurement, now: float) -> bytes:
        """The encoded receipt for an answer with `status` and a body of SHA-256 `body_sha256` to `request`."""
        unsigned = Receipt(self.key_id, hashlib.sha256(request).hexdigest(), body_sha256.hex(), status,
                           measurement.model_digest.hex(), measurement.digest().hex(), int(now), b"")
        signature = self._private.sign(unsigned.signed_bytes())
        return replace(unsigned, signature=signature).encode()


def decode_receipt(data: bytes) -> Receipt:
    """Parse a receipt strictly; ReceiptFormatError unless it is one, canonically encoded."""
    if len(data) > MAX_RECEIPT_BYTES:
        raise ReceiptFormatError(f"a receipt is at most {MAX_RECEIPT_BYTES} bytes")
    try:
        value = json.loads(bytes(data).decode("ascii"), object_pairs_hook=_unique)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise ReceiptFormatError("a receipt is not ASCII JSON without duplicate keys") from None
    receipt = _from_value(value)
    if receipt.encode() != data:
        raise ReceiptFormatError("a receipt is not in its canonical encoding")
    return receipt


def _from_value(value: Any) -> Receipt:
    if not isinstance(value, dict) or set(value) != _FIELDS:
        raise ReceiptFormatError("a receipt must be an object with exactly the veil.receipt/v1 fields")
    if value["type"] != RECEIPT_TYPE:
        raise ReceiptFormatError(f"a receipt's type must be {RECEIPT_TYPE}")
    for name in _DIGEST_FIELDS:
        if not isinstance(value[name], str) or not _HEX32.fullmatch(value[name]):
            raise ReceiptFormatError(f"a receipt's {name} must be 32 bytes in lowercase hex")
    if type(value["status"]) is not int or not 100 <= value["status"] <= 599:
        raise ReceiptFormatError("a receipt's status must be an HTTP status")
    if type(value["time"]) is not int or not 0 <= value["time"] < _MAX_TIME:
        raise ReceiptFormatError("a receipt's time must be Unix seconds")
    return Receipt(*(value[name] for name in ("key_id", "request_sha256", "response_sha256", "status",
                                              "model_digest", "measurement", "time")), _signature(value["signature"]))


def _signature(value: Any) -> bytes:
    try:
        signature = base64.b64decode(value.encode("ascii"), validate=True) if isinstance(value, str) else b""
    except (binascii.Error, UnicodeEncodeError):
        signature = b""
    if len(signature) != _SIGNATURE_SIZE:
        raise ReceiptFormatError("a receipt's signature must be 64 bytes in base64")
    return signature


def check_signature(receipt: Receipt, receipt_key: bytes) -> None:
    """The receipt names `receipt_key` and its signature verifies under it."""
    if len(receipt_key) != RECEIPT_KEY_SIZE:
        raise ReceiptKeyError(f"a receipt key is {RECEIPT_KEY_SIZE} bytes (an Ed25519 public key)")
    if receipt.key_id != key_id(receipt_key):
        raise ReceiptKeyError("the receipt names another receipt key than the node's")
    try:
        Ed25519PublicKey.from_public_bytes(receipt_key).verify(receipt.signature, receipt.signed_bytes())
    except (InvalidSignature, ValueError):
        raise ReceiptSignatureError("the receipt's signature does not verify under the node's receipt key") from None


@dataclass(frozen=True, slots=True)
class AnswerFacts:
    """What the client knows of one answer: what it sent, what it received, and whom it verified."""

    request: bytes  # the Binary HTTP request, as sealed
    body_sha256: bytes
    status: int
    receipt_key: bytes
    measurement: Measurement


def verify_receipt(data: bytes | None, facts: AnswerFacts, now: float, max_skew_s: float) -> Receipt:
    """The receipt of this answer, verified; raise the ReceiptError of the first check that fails."""
    if data is None:
        raise MissingReceiptError("the answer carries no receipt; every answer of a node must")
    receipt = decode_receipt(data)
    check_signature(receipt, facts.receipt_key)
    _same(receipt.request_sha256, hashlib.sha256(facts.request).hexdigest(), "another request than the one sent")
    _same(receipt.response_sha256, facts.body_sha256.hex(), "another answer body than the one received")
    if receipt.status != facts.status:
        raise ReceiptMismatchError("the receipt is for another status than the answer's")
    _same(receipt.model_digest, facts.measurement.model_digest.hex(), "another model than the node attests to")
    _same(receipt.measurement, facts.measurement.digest().hex(), "another measurement than the node attests to")
    if abs(now - receipt.time) > max_skew_s:
        raise ReceiptTimeError(f"the receipt is dated {receipt.time - now:+.0f} s from now; the policy allows "
                               f"{max_skew_s:g} s of clock skew")
    return receipt


def verify_against_statement(data: bytes, statement: NodeKeyStatement) -> Receipt:
    """A third party's check: the receipt is signed by the key a logged NodeKeyStatement carries, for its
    measurement, within its validity window. What was asked and answered is the receipt's holder's to show."""
    receipt = decode_receipt(data)
    if not isinstance(statement.receipt_key, str) or not _HEX32.fullmatch(statement.receipt_key):
        raise ReceiptKeyError("the key statement carries no receipt key in lowercase hex")
    check_signature(receipt, bytes.fromhex(statement.receipt_key))
    _same(receipt.measurement, statement.measurement, "another measurement than the key statement's")
    if not statement.not_before <= receipt.time <= statement.not_after:
        raise ReceiptTimeError("the receipt is dated outside the key statement's validity window")
    return receipt


def _same(signed: str, expected: str, what: str) -> None:
    if signed != expected:
        raise ReceiptMismatchError(f"the receipt is for {what}")


def _canonical(value: dict[str, Any]) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    if len({key for key, _ in pairs}) != len(pairs):
        raise ValueError("duplicate key")
    return dict(pairs)
