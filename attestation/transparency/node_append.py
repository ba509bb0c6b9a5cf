"""A node's request to the operator's log to append its key statement, and the log's check of it.

The node sends its canonical key statement with evidence collected over a nonce derived from that
statement, so the evidence vouches for exactly this entry: the log appends it only if the evidence
verifies (under the log's policy, with the verifier the gateway uses) and the statement's key
configuration digest, measurement and receipt key are the evidence's. The node never holds the log's key, and
the log appends nothing else on a node's word.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from dataclasses import dataclass

from attestation.bundle import EvidenceBundle
from attestation.errors import AttestationError
from attestation.transparency.errors import StatementFormatError, TransparencyError
from attestation.transparency.statements import NodeKeyStatement, decode_statement
from attestation.verifier import VerifiedNode, verify
from policy.model import Policy

APPEND_PATH = "/add-node-key"
MAX_APPEND_BYTES = 512 * 1024  # evidence with its certificate chains, and one statement
_NONCE_TAG = b"veil-log-append-v1"


class AppendRefusedError(TransparencyError):
    """The log refuses a statement: not a node key, or not the key and measurement of the evidence."""


class AppendFormatError(TransparencyError):
    """An append request is not JSON of a base64 entry and an evidence bundle, or is too large."""


@dataclass(frozen=True, slots=True)
class AppendRequest:
    entry: bytes  # the canonical statement, as it will stand in the log
    evidence: str  # the node's evidence bundle (JSON) over append_nonce(entry)

    def to_json(self) -> bytes:
        return json.dumps({"entry": base64.b64encode(self.entry).decode(), "evidence": self.evidence}).encode()


def append_nonce(entry: bytes) -> bytes:
    """The nonce a node's evidence must be collected over to vouch for `entry` (32 bytes)."""
    return hashlib.sha256(_NONCE_TAG + entry).digest()


def parse_append_request(body: bytes) -> AppendRequest:
    if len(body) > MAX_APPEND_BYTES:
        raise AppendFormatError("an append request is larger than 512 KiB")
    try:
        value = json.loads(body)
        entry, evidence = value["entry"], value["evidence"]
        if not isinstance(entry, str) or not isinstance(evidence, str):
            raise TypeError
        return AppendRequest(base64.b64decode(entry, validate=True), evidence)
    except (ValueError, KeyError, TypeError, binascii.Error, RecursionError):
        raise AppendFormatError("an append request is JSON with a base64 entry and an evidence bundle") from None


def check_append(request: AppendRequest, policy: Policy, now: float | None = None) -> NodeKeyStatement:
    """The statement, if the evidence verifies and vouches for it; raise AppendRefusedError otherwise."""
    try:
        statement = decode_statement(request.entry)
    except StatementFormatError as error:
        raise AppendFormatError(f"the entry is not a statement Veil logs: {error}") from None
    if not isinstance(statement, NodeKeyStatement):
        raise AppendRefusedError("a node may append only its own key statement, not a release or issuer key")
    node = _verified(request, policy, now)
    if statement.key_config_digest != hashlib.sha256(node.key_config).hexdigest():
        raise AppendRefusedError("the statement's key configuration is not the one bound into the evidence")
    if statement.measurement != node.measurement.digest().hex():
        raise AppendRefusedError("the statement's measurement is not the evidence's")
    if statement.receipt_key != node.receipt_key.hex():
        raise AppendRefusedError("the statement's receipt key is not the one bound into the evidence")
    return statement


def _verified(request: AppendRequest, policy: Policy, now: float | None) -> VerifiedNode:
    try:
        return verify(EvidenceBundle.from_json(request.evidence), policy, expected_nonce=append_nonce(request.entry),
                      now=now)
    except AttestationError as error:
        raise AppendRefusedError(f"the node's evidence does not verify under the log's policy ({error.check})") \
            from None
    except Exception as error:  # the sender's bytes made the verifier fail: refuse them, name only the type
        raise AppendRefusedError(f"the node's evidence could not be verified ({type(error).__name__})") from None
