"""A monitor's audit of a whole log: recompute every tile and the root, check consistency, list statements.

The auditor trusts nothing it fetches but the log's signature: it rebuilds each level of tiles from
the entry bundles up and compares it with what the log serves, recomputes the root of the signed
checkpoint, and checks that the tree it last saw (kept in its own state file) is a prefix of this
one, both directly from the entries and with the consistency proof a client would be given. An
entry removed or changed in any tile, or a history rewritten and re-signed, fails one of these.
"""

from __future__ import annotations

import base64
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from attestation.transparency.cosignature import CosignatureVerifier
from attestation.transparency.errors import (
    ConsistencyProofError,
    ForkError,
    RollbackError,
    StatementFormatError,
    TileError,
)
from attestation.transparency.merkle import HASH_SIZE, leaf_hash, root_of, subtree_hash, verify_consistency
from attestation.transparency.note import NoteVerifier
from attestation.transparency.statements import IssuerKeyStatement, ReleaseStatement, Statement, decode_statement
from attestation.transparency.tiles import TILE_WIDTH, Fetch, TileName, tile_count, tile_root, tiles_for
from transparency.difference import describe_difference
from transparency.errors import LogStoreError
from transparency.reader import LogReader


@dataclass(frozen=True, slots=True)
class AuditedEntry:
    index: int
    statement: Statement | None  # None: the entry is not a statement Veil logs
    trusted: bool | None  # releases only: whether the auditor's list names its code digest


@dataclass(slots=True)
class AuditReport:
    origin: str
    size: int
    root: bytes
    previous_size: int | None
    cosigners: tuple[str, ...]  # witnesses whose cosignature verified under a key the auditor gave
    unverified: tuple[str, ...]  # names on other signature lines: claimed, not checked
    entries: list[AuditedEntry] = field(default_factory=list)
    unlogged_issuer_keys: tuple[str, ...] = ()  # key ids a policy accepts that no statement in the log names

    @property
    def untrusted_releases(self) -> list[AuditedEntry]:
        return [entry for entry in self.entries if entry.trusted is False]

    @property
    def malformed(self) -> list[AuditedEntry]:
        return [entry for entry in self.entries if entry.statement is None]


def audit_log(fetch: Fetch, log_key: NoteVerifier, state_path: Path, trusted_code: frozenset[str] | None = None,
              witnesses: tuple[CosignatureVerifier, ...] = (), issuer_keys: tuple[str, ...] = ()) -> AuditReport:
    """Audit the log behind `fetch`; raise a TransparencyError on the first inconsistency found.

    `issuer_keys`: token key ids a policy accepts, each of which the log must hold. The state file is
    updated only when everything checked out.
    """
    reader = LogReader(fetch, log_key)
    checkpoint = reader.signed.checkpoint
    bundles = tile_count(reader.size, None)
    if bundles:  # the last bundle first: a checkpoint signed over more entries than the log holds fails at once
        reader.bundle(bundles - 1)
    entries = [entry for index in range(bundles) for entry in reader.bundle(index)]
    leaves = [leaf_hash(entry) for entry in entries]
    if root_of(leaves) != checkpoint.root:
        raise _unsigned_entries(reader, leaves)
    _check_tiles(reader, leaves)
    previous = load_seen(state_path, checkpoint.origin)
    if previous is not None:
        _check_consistent(reader, leaves, previous)
    save_seen(state_path, checkpoint.origin, checkpoint.size, checkpoint.root)
    note = reader.signed.note
    cosigners = tuple(witness.name for witness in witnesses if witness.timestamp(note) is not None)
    unverified = tuple(signature.name for signature in note.signatures
                       if signature.name != log_key.name and signature.name not in cosigners)
    report = AuditReport(checkpoint.origin, checkpoint.size, checkpoint.root,
                         None if previous is None else previous[0], cosigners, unverified)
    report.entries = [_audited(index, entry, trusted_code) for index, entry in enumerate(entries)]
    logged = {entry.statement.token_key_id for entry in report.entries
              if isinstance(entry.statement, IssuerKeyStatement)}
    report.unlogged_issuer_keys = tuple(key for key in issuer_keys if key not in logged)
    return report


def _unsigned_entries(reader: LogReader, leaves: list[bytes]) -> TileError:
    """Why the entries' root is not the checkpoint's: a bundle changed (its tiles still lead to the signed
    root), or a checkpoint signed over a root that neither the entries nor the tiles produce."""
    if reader.size and subtree_hash(reader.hashes.complete, 0, reader.size) == reader.signed.checkpoint.root:
        for name in tiles_for(reader.size, 0):
            start = name.index * TILE_WIDTH
            difference = describe_difference(reader.hashes.tile(0, name.index), leaves[start:start + name.width],
                                             "entry", "entries")
            if difference:
                bundle = TileName(None, name.index, name.width).path()
                return TileError(f"entry bundle {bundle} is not what the signed tree holds: {difference}")
    return TileError("the checkpoint signs a root that the log's entries do not produce "
                     "(the checkpoint or the entries and their tiles were changed)")


def _check_tiles(reader: LogReader, leaves: list[bytes]) -> None:
    """Every tile of every level equals what the level below it implies, from the leaves up."""
    level, hashes = 0, leaves
    while hashes:
        for name in tiles_for(reader.size, level):
            start = name.index * TILE_WIDTH
            difference = describe_difference(hashes[start:start + name.width], reader.hashes.tile(level, name.index),
                                             "hash", "hashes")
            if difference:
                raise TileError(f"hash tile {name.path()} does not hold the hashes its entries imply: {difference}")
        full = len(hashes) - len(hashes) % TILE_WIDTH
        hashes = [tile_root(hashes[i:i + TILE_WIDTH]) for i in range(0, full, TILE_WIDTH)]
        level += 1


def _check_consistent(reader: LogReader, leaves: list[bytes], previous: tuple[int, bytes]) -> None:
    size, root = previous
    if reader.size < size:
        raise RollbackError(f"the log is smaller ({reader.size}) than when last audited ({size})")
    if size == 0:
        return
    if root_of(leaves[:size]) != root:
        raise ForkError(f"the log's first {size} entries no longer produce the root last audited: "
                        "history was rewritten")
    try:
        verify_consistency(size, reader.size, reader.consistency_proof(size), root, reader.signed.checkpoint.root)
    except ConsistencyProofError:
        raise ForkError("the log's tiles give no valid consistency proof from the tree last audited") from None


def _audited(index: int, entry: bytes, trusted_code: frozenset[str] | None) -> AuditedEntry:
    try:
        statement = decode_statement(entry)
    except StatementFormatError:
        return AuditedEntry(index, None, None)
    trusted = None
    if isinstance(statement, ReleaseStatement) and trusted_code is not None:
        trusted = statement.code_digest in trusted_code
    return AuditedEntry(index, statement, trusted)


def load_seen(path: Path, origin: str) -> tuple[int, bytes] | None:
    """The (size, root) last audited for `origin`, or None for a first audit."""
    try:
        logs = json.loads(path.read_text(encoding="utf-8"))["logs"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        raise LogStoreError(f"the auditor's state {path} is unreadable; restore it, never start afresh") from None
    if origin not in logs:
        return None
    try:
        size, root = logs[origin]["size"], base64.b64decode(logs[origin]["root"], validate=True)
    except (ValueError, KeyError, TypeError):
        raise LogStoreError(f"the auditor's state {path} is unreadable; restore it, never start afresh") from None
    if type(size) is not int or size < 0 or len(root) != HASH_SIZE:
        raise LogStoreError(f"the auditor's state {path} is unreadable; restore it, never start afresh")
    return size, root


def save_seen(path: Path, origin: str, size: int, root: bytes) -> None:
    try:
        logs = json.loads(path.read_text(encoding="utf-8"))["logs"] if path.exists() else {}
        logs[origin] = {"size": size, "root": base64.b64encode(root).decode()}
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        temporary.write_text(json.dumps({"logs": logs}, indent=1, sort_keys=True), encoding="utf-8")
        os.replace(temporary, path)
    except (OSError, ValueError, KeyError, TypeError):
        raise LogStoreError(f"cannot write the auditor's state {path}") from None
