"""What Veil's log holds: release statements and key statements, each one canonical JSON object.

- a release: the code digest, the CPU launch measurements it runs under (SEV-SNP MEASUREMENT, TDX
  MRTD and RTMRs), the model digests, the policy digest and a version;
- a node key: the SHA-256 of a node's OHTTP key configuration, its validity window, the
  measurement (the digest bound into the node's evidence) of the code that holds it, and the
  Ed25519 public key that signs its answers' receipts (`attestation.receipts`), so that anyone
  holding a receipt can check it against the log;
- an issuer key: a Privacy Pass issuer's token key id and its validity window.

Canonical JSON (sorted keys, no spaces, UTF-8) gives every statement exactly one encoding, so the
log entry, and with it the leaf hash, is determined by the statement; an entry in any other
encoding is refused.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from typing import Any

from attestation.transparency.errors import StatementFormatError
from policy.model import LAUNCH_TEES

RELEASE = "veil.release/v1"
NODE_KEY = "veil.node-key/v1"
ISSUER_KEY = "veil.issuer-key/v1"
_SHA256 = re.compile(r"[0-9a-f]{64}")
_SHA384 = re.compile(r"[0-9a-f]{96}")
_ED25519_KEY = re.compile(r"[0-9a-f]{64}")
_VERSION = re.compile(r"[0-9A-Za-z.+_-]{1,64}")


@dataclass(frozen=True, slots=True)
class LaunchMeasurement:
    tee: str  # sev-snp or tdx
    measurement: str  # SEV-SNP MEASUREMENT or TDX MRTD, 48 bytes hex
    rtmrs: tuple[str, ...] = ()  # TDX RTMR0-3 where the release fixes them


@dataclass(frozen=True, slots=True)
class ReleaseStatement:
    version: str
    code_digest: str
    policy_digest: str
    model_digests: tuple[str, ...]
    launch_measurements: tuple[LaunchMeasurement, ...] = ()


@dataclass(frozen=True, slots=True)
class NodeKeyStatement:
    key_config_digest: str  # SHA-256 of the OHTTP key configuration the node serves
    measurement: str  # the measurement digest bound into the node's evidence
    not_before: int
    not_after: int
    receipt_key: str  # the node's receipt-signing Ed25519 public key: its 32 raw bytes in lowercase hex


@dataclass(frozen=True, slots=True)
class IssuerKeyStatement:
    token_key_id: str  # SHA-256 of the issuer's public key as published (RFC 9578)
    not_before: int
    not_after: int


Statement = ReleaseStatement | NodeKeyStatement | IssuerKeyStatement
_TYPES: dict[type, str] = {ReleaseStatement: RELEASE, NodeKeyStatement: NODE_KEY, IssuerKeyStatement: ISSUER_KEY}


def encode_statement(statement: Statement) -> bytes:
    """The statement's one log entry; raise StatementFormatError if a field is out of shape."""
    _check(statement)
    value = {"type": _TYPES[type(statement)], **asdict(statement)}
    return canonical_json(value)


def canonical_json(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def decode_statement(entry: bytes) -> Statement:
    """A log entry back to its statement; raise StatementFormatError unless it is one, canonically encoded."""
    try:
        value = json.loads(entry.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise StatementFormatError("a log entry is not UTF-8 JSON without duplicate keys") from None
    statement = statement_from_value(value)
    if encode_statement(statement) != entry:
        raise StatementFormatError("a log entry is not in its statement's canonical encoding")
    return statement


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    if len({key for key, _ in pairs}) != len(pairs):
        raise ValueError("duplicate key")
    return dict(pairs)


def statement_from_value(value: Any) -> Statement:
    """A statement from parsed JSON (an operator's file: any key order, rtmrs may be left out)."""
    if not isinstance(value, dict):
        raise StatementFormatError("a log entry must be a JSON object")
    fields = dict(value)
    kind = fields.pop("type", None)
    try:
        if kind == RELEASE:
            launches = fields.pop("launch_measurements", None)
            if not isinstance(launches, list) or not all(isinstance(item, dict) for item in launches):
                raise StatementFormatError("a release's launch_measurements must be a list of objects")
            measurements = tuple(LaunchMeasurement(**{**item, "rtmrs": tuple(item.get("rtmrs", ()))})
                                 for item in launches)
            models = fields.pop("model_digests", None)
            if not isinstance(models, list):
                raise StatementFormatError("a release's model_digests must be a list")
            return ReleaseStatement(**fields, model_digests=tuple(models), launch_measurements=measurements)
        if kind == NODE_KEY:
            return NodeKeyStatement(**fields)
        if kind == ISSUER_KEY:
            return IssuerKeyStatement(**fields)
    except TypeError:
        raise StatementFormatError("a log entry has missing or unknown fields for its type") from None
    raise StatementFormatError("a log entry's type is not a statement Veil logs")


def _check(statement: Statement) -> None:
    if isinstance(statement, ReleaseStatement):
        _release(statement)
    elif isinstance(statement, NodeKeyStatement):
        _digest(statement.key_config_digest, "key_config_digest")
        _digest(statement.measurement, "measurement")
        _window(statement.not_before, statement.not_after)
        if not isinstance(statement.receipt_key, str) or not _ED25519_KEY.fullmatch(statement.receipt_key):
            raise StatementFormatError("receipt_key must be an Ed25519 public key: 32 bytes in lowercase hex")
    else:
        _digest(statement.token_key_id, "token_key_id")
        _window(statement.not_before, statement.not_after)


def _release(statement: ReleaseStatement) -> None:
    if not isinstance(statement.version, str) or not _VERSION.fullmatch(statement.version):
        raise StatementFormatError("a release's version must be 1 to 64 letters, digits or . + _ -")
    _digest(statement.code_digest, "code_digest")
    _digest(statement.policy_digest, "policy_digest")
    for digest in statement.model_digests:
        _digest(digest, "model_digests")
    if list(statement.model_digests) != sorted(set(statement.model_digests)):
        raise StatementFormatError("a release lists its model digests sorted, each once")
    for launch in statement.launch_measurements:
        if launch.tee not in LAUNCH_TEES:
            raise StatementFormatError(f"a launch measurement's tee must be one of {', '.join(LAUNCH_TEES)}")
        values = (launch.measurement, *launch.rtmrs)
        if not all(isinstance(value, str) and _SHA384.fullmatch(value) for value in values):
            raise StatementFormatError("a launch measurement and its RTMRs must be 48 bytes in lowercase hex")
        if launch.rtmrs and (launch.tee != "tdx" or len(launch.rtmrs) != 4):
            raise StatementFormatError("only a TDX launch measurement has RTMRs, all four of them")


def _digest(value: object, name: str) -> None:
    if not isinstance(value, str) or not _SHA256.fullmatch(value):
        raise StatementFormatError(f"{name} must be a SHA-256 digest in lowercase hex")


def _window(not_before: object, not_after: object) -> None:
    if not all(type(value) is int and value >= 0 for value in (not_before, not_after)):
        raise StatementFormatError("a key's validity window must be two non-negative integers (Unix seconds)")
    if not_after <= not_before:  # type: ignore[operator]
        raise StatementFormatError("a key's validity ends after it begins")
