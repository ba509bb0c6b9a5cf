"""The operator's log and its monitor: appends written as tiles, proofs read from them, and an audit
that recomputes everything and catches an entry removed or changed in any tile, or history rewritten."""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from attestation.transparency.checkpoint import Checkpoint
from attestation.transparency.errors import ForkError, NoteSignatureError, RollbackError, TileError
from attestation.transparency.merkle import leaf_hash, root_of, verify_consistency, verify_inclusion
from attestation.transparency.note import generate_signer, sign_note
from attestation.transparency.statements import (
    IssuerKeyStatement,
    NodeKeyStatement,
    ReleaseStatement,
    encode_statement,
)
from attestation.transparency.tiles import encode_bundle, parse_bundle
from transparency.audit import audit_log
from transparency.errors import LogStoreError
from transparency.fetch import directory_fetch
from transparency.log import append_entries, init_log
from transparency.reader import LogReader

SIGNER = generate_signer("log.example/veil")


def _digest(label: str) -> str:
    return hashlib.sha256(label.encode()).hexdigest()


def issuer_key(number: int) -> bytes:
    return encode_statement(IssuerKeyStatement(_digest(f"token key {number}"), number, number + 3600))


RELEASE = ReleaseStatement("1.0.0", _digest("code"), _digest("policy"), (_digest("model"),))
UNTRUSTED = ReleaseStatement("1.0.1-special", _digest("special code"), _digest("policy"), (_digest("model"),))
NODE_KEY = NodeKeyStatement(_digest("key config"), _digest("measurement"), 1000, 2000, _digest("receipt key"))


def test_appends_across_tile_boundaries_give_the_tree_and_proofs_of_rfc_6962(tmp_path: Path) -> None:
    init_log(tmp_path, SIGNER)
    entries: list[bytes] = []
    seen: list[Checkpoint] = []
    for batch in (3, 253, 1, 300):  # ends a tile exactly, starts one, fills a partial, crosses to level 1
        new = [issuer_key(len(entries) + i) for i in range(batch)]
        signed = append_entries(tmp_path, SIGNER, new)
        entries += new
        assert signed.checkpoint.size == len(entries)
        assert signed.checkpoint.root == root_of([leaf_hash(entry) for entry in entries])
        seen.append(signed.checkpoint)
    reader = LogReader(directory_fetch(tmp_path), SIGNER.verifier)
    for index in (0, 255, 256, 300, len(entries) - 1):
        assert reader.entry(index) == entries[index]
        verify_inclusion(leaf_hash(entries[index]), index, reader.size, reader.inclusion_proof(index),
                         reader.signed.checkpoint.root)
    for old in seen:
        verify_consistency(old.size, reader.size, reader.consistency_proof(old.size), old.root,
                           reader.signed.checkpoint.root)
    assert (tmp_path / "tile/1/000.p/2").is_file() and (tmp_path / "tile/0/001").is_file()


def test_a_log_is_created_once_and_grows_only_with_its_key(tmp_path: Path) -> None:
    init_log(tmp_path, SIGNER)
    with pytest.raises(LogStoreError):
        init_log(tmp_path, SIGNER)
    with pytest.raises(NoteSignatureError):
        append_entries(tmp_path, generate_signer("log.example/veil"), [issuer_key(1)])
    with pytest.raises(LogStoreError):
        append_entries(tmp_path, SIGNER, [b"x" * 70000])
    assert LogReader(directory_fetch(tmp_path), SIGNER.verifier).size == 0


# ----- the audit ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A log of 300 entries (one full tile, a partial one, a level-1 tile) with two releases and a node key."""
    root = tmp_path_factory.mktemp("log")
    init_log(root, SIGNER)
    append_entries(root, SIGNER, [encode_statement(RELEASE), encode_statement(NODE_KEY)])
    append_entries(root, SIGNER, [issuer_key(i) for i in range(297)] + [encode_statement(UNTRUSTED)])
    return root


@pytest.fixture
def log(template: Path, tmp_path: Path) -> Path:
    shutil.copytree(template, tmp_path / "log")
    return tmp_path / "log"


def _audit(log: Path, state: Path, trusted: frozenset[str] | None = None):
    return audit_log(directory_fetch(log), SIGNER.verifier, state, trusted)


def test_an_audit_lists_every_statement_and_flags_untrusted_releases(log: Path, tmp_path: Path) -> None:
    report = _audit(log, tmp_path / "seen.json", frozenset({RELEASE.code_digest}))
    assert report.size == 300 and report.previous_size is None and report.malformed == []
    assert [entry.statement for entry in report.entries[:2]] == [RELEASE, NODE_KEY]
    assert [(entry.index, entry.statement) for entry in report.untrusted_releases] == [(299, UNTRUSTED)]
    assert report.entries[0].trusted is True
    append_entries(log, SIGNER, [issuer_key(1000)])
    again = _audit(log, tmp_path / "seen.json")
    assert (again.previous_size, again.size) == (300, 301)


def _rewrite_bundle(path: Path, width: int, change: Callable[[list[bytes]], list[bytes]]) -> None:
    path.write_bytes(encode_bundle(change(parse_bundle(path.read_bytes(), width))))


def _flip_hash(path: Path, index: int) -> None:
    data = bytearray(path.read_bytes())
    data[index * 32] ^= 1
    path.write_bytes(bytes(data))


TAMPERING = {
    "entry changed in a full bundle": lambda log: _rewrite_bundle(
        log / "tile/entries/000", 256, lambda entries: [encode_statement(UNTRUSTED), *entries[1:]]),
    "entry changed in a partial bundle": lambda log: _rewrite_bundle(
        log / "tile/entries/001.p/44", 44, lambda entries: [*entries[:-1], issuer_key(5000)]),
    "entry removed from a full bundle": lambda log: _rewrite_bundle(
        log / "tile/entries/000", 256, lambda entries: entries[1:] + [entries[-1]]),
    "entry removed from a partial bundle": lambda log: (log / "tile/entries/001.p/44").write_bytes(
        encode_bundle(parse_bundle((log / "tile/entries/001.p/44").read_bytes(), 44)[:-1])),
    "leaf hash changed in a level-0 tile": lambda log: _flip_hash(log / "tile/0/001.p/44", 7),
    "hash changed in a level-1 tile": lambda log: _flip_hash(log / "tile/1/000.p/1", 0),
    "tile removed": lambda log: (log / "tile/0/000").unlink(),
}


@pytest.mark.parametrize("tamper", TAMPERING.values(), ids=TAMPERING.keys())
def test_an_audit_detects_an_entry_or_hash_changed_or_removed_in_any_tile(log: Path, tmp_path: Path, tamper) -> None:
    _audit(log, tmp_path / "before.json")  # untouched, it passes
    tamper(log)
    with pytest.raises(TileError):
        _audit(log, tmp_path / "after.json")
    state = tmp_path / "after.json"
    assert not state.exists()  # a failed audit records nothing


def test_an_audit_detects_history_rewritten_and_re_signed(log: Path, tmp_path: Path) -> None:
    """The operator rebuilds the log without the special release, with its own key: consistent tiles,
    a valid signature, but not an extension of what the auditor saw."""
    state = tmp_path / "seen.json"
    _audit(log, state)
    rebuilt = tmp_path / "rebuilt"
    init_log(rebuilt, SIGNER)
    append_entries(rebuilt, SIGNER, [encode_statement(RELEASE), encode_statement(NODE_KEY)])
    append_entries(rebuilt, SIGNER, [issuer_key(i) for i in range(297)] + [issuer_key(9999), issuer_key(10000)])
    with pytest.raises(ForkError):
        _audit(rebuilt, state)
    shorter = tmp_path / "shorter"
    init_log(shorter, SIGNER)
    append_entries(shorter, SIGNER, [encode_statement(RELEASE)])
    with pytest.raises(RollbackError):
        _audit(shorter, state)


def test_a_checkpoint_re_signed_over_a_changed_root_is_caught(log: Path, tmp_path: Path) -> None:
    body = Checkpoint("log.example/veil", 300, hashlib.sha256(b"another root").digest()).body()
    (log / "checkpoint").write_text(sign_note(body, SIGNER))
    with pytest.raises(TileError, match="root"):
        _audit(log, tmp_path / "seen.json")


def test_an_audit_refuses_a_log_signed_by_another_key(log: Path, tmp_path: Path) -> None:
    with pytest.raises(NoteSignatureError):
        audit_log(directory_fetch(log), generate_signer("log.example/veil").verifier, tmp_path / "seen.json")
