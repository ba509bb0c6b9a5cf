"""The witness: it cosigns a log's checkpoint only when a consistency proof leads from the last one it
cosigned, keeps that in its state file, and refuses rollbacks, forks and checkpoints it cannot check."""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path

import pytest

from attestation.transparency.checkpoint import Checkpoint
from attestation.transparency.cosignature import generate_cosigner
from attestation.transparency.errors import (
    CheckpointFormatError,
    ConsistencyProofError,
    ForkError,
    NoteSignatureError,
)
from attestation.transparency.note import generate_signer, parse_note, sign_note
from transparency.errors import StaleSizeError, UnknownLogError, WitnessRequestError
from transparency.fetch import directory_fetch
from transparency.log import append_entries, init_log
from transparency.protocol import AddCheckpoint, encode_add_checkpoint, parse_add_checkpoint
from transparency.reader import LogReader
from transparency.witness import Witness

LOG = generate_signer("log.example/veil")
COSIGNER = generate_cosigner("witness.example")
NOW = 1_800_000_000


@pytest.fixture
def log(tmp_path: Path) -> Path:
    init_log(tmp_path / "log", LOG)
    return tmp_path / "log"


def _grow(log: Path, count: int) -> LogReader:
    start = LogReader(directory_fetch(log), LOG.verifier).size
    append_entries(log, LOG, [f"entry {start + i}".encode() for i in range(count)])
    return LogReader(directory_fetch(log), LOG.verifier)


def _note(log: Path) -> bytes:
    return (log / "checkpoint").read_bytes()


def _witness(state: Path) -> Witness:
    return Witness(COSIGNER, [LOG.verifier], state, clock=lambda: NOW)


def test_cosigns_the_first_checkpoint_then_only_consistent_extensions(log: Path, tmp_path: Path) -> None:
    witness = _witness(tmp_path / "state.json")
    first = _grow(log, 5)
    signature = witness.add_checkpoint(0, (), _note(log))
    cosigned = parse_note(_note(log) + signature.encode().encode())
    assert COSIGNER.verifier.timestamp(cosigned) == NOW
    later = _grow(log, 300)
    witness.add_checkpoint(5, later.consistency_proof(5), _note(log))
    assert witness.seen("log.example/veil").size == 305
    with pytest.raises(StaleSizeError) as stale:
        witness.add_checkpoint(5, later.consistency_proof(5), _note(log))
    assert stale.value.size == 305
    assert first.size == 5


def test_refuses_a_rollback_and_remembers_across_restarts(log: Path, tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    _grow(log, 3)
    old_note = _note(log)
    _witness(state).add_checkpoint(0, (), old_note)
    reader = _grow(log, 4)
    _witness(state).add_checkpoint(3, reader.consistency_proof(3), _note(log))
    restarted = _witness(state)  # a new process reading the same state file
    with pytest.raises(StaleSizeError) as stale:  # the log is told the size it must prove from
        restarted.add_checkpoint(3, (), old_note)
    assert stale.value.size == 7
    with pytest.raises(WitnessRequestError, match="above the checkpoint's size"):
        restarted.add_checkpoint(7, (), old_note)
    assert json.loads(state.read_text())["logs"]["log.example/veil"]["size"] == 7


def test_refuses_a_fork_two_trees_of_one_size(log: Path, tmp_path: Path) -> None:
    witness = _witness(tmp_path / "state.json")
    _grow(log, 4)
    witness.add_checkpoint(0, (), _note(log))
    forked = Checkpoint("log.example/veil", 4, hashlib.sha256(b"another tree").digest())
    with pytest.raises(ForkError):
        witness.add_checkpoint(4, (), sign_note(forked.body(), LOG).encode())
    # A fork at a larger size shows as a consistency proof that cannot lead from the cosigned root.
    other = tmp_path / "other"
    init_log(other, LOG)
    append_entries(other, LOG, [b"not the same"] * 6)
    reader = LogReader(directory_fetch(other), LOG.verifier)
    with pytest.raises(ConsistencyProofError):
        witness.add_checkpoint(4, reader.consistency_proof(4), _note(other))
    assert witness.seen("log.example/veil").size == 4


def test_refuses_what_it_cannot_check(log: Path, tmp_path: Path) -> None:
    witness = _witness(tmp_path / "state.json")
    _grow(log, 2)
    with pytest.raises(UnknownLogError):
        Witness(COSIGNER, [generate_signer("other.example").verifier], tmp_path / "s2.json").add_checkpoint(
            0, (), _note(log))
    impostor = Checkpoint("log.example/veil", 2, hashlib.sha256(b"x").digest())
    with pytest.raises(NoteSignatureError):
        witness.add_checkpoint(0, (), sign_note(impostor.body(), generate_signer("log.example/veil")).encode())
    with pytest.raises(ConsistencyProofError, match="takes no consistency proof"):
        witness.add_checkpoint(0, (b"\x00" * 32,), _note(log))
    with pytest.raises(CheckpointFormatError):
        witness.add_checkpoint(0, (), sign_note("log.example/veil\nnot a size\n", LOG).encode())
    assert not (tmp_path / "state.json").exists()


def test_refuses_a_tree_of_size_zero_with_any_root_but_the_empty_one(log: Path, tmp_path: Path) -> None:
    witness = _witness(tmp_path / "state.json")
    empty_but_wrong = Checkpoint("log.example/veil", 0, hashlib.sha256(b"not nothing").digest())
    with pytest.raises(ForkError, match="empty tree's root"):
        witness.add_checkpoint(0, (), sign_note(empty_but_wrong.body(), LOG).encode())
    assert not (tmp_path / "state.json").exists()
    witness.add_checkpoint(0, (), _note(log))  # the log's own empty checkpoint carries SHA-256 of nothing
    assert witness.seen("log.example/veil").size == 0


def test_a_corrupt_state_file_stops_the_witness(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    state.write_text('{"logs": {"log.example/veil": {"size": "7"}}}')
    from transparency.errors import LogStoreError

    with pytest.raises(LogStoreError, match="corrupt"):
        _witness(state)


def test_add_checkpoint_requests_round_trip_and_malformed_ones_are_refused() -> None:
    request = AddCheckpoint(12, (b"\x01" * 32, b"\x02" * 32), b"note\n\n\xe2\x80\x94 x AAAA\n")
    assert parse_add_checkpoint(encode_add_checkpoint(request)) == request
    for body in (b"old 1\n", b"new 1\n\nnote", b"old 01\n\nnote", b"old 1\n!!!\n\nnote", b"old \xff\n\nnote",
                 b"old 1\n" + b"AAAA\n" * 65 + b"\nnote"):
        with pytest.raises(WitnessRequestError):
            parse_add_checkpoint(body)


def test_a_consistency_proof_holds_at_most_the_63_lines_tlog_witness_allows() -> None:
    line = base64.b64encode(b"\x03" * 32)
    assert len(parse_add_checkpoint(b"old 1\n" + (line + b"\n") * 63 + b"\nnote").proof) == 63
    with pytest.raises(WitnessRequestError, match="at most 63"):
        parse_add_checkpoint(b"old 1\n" + (line + b"\n") * 64 + b"\nnote")
    with pytest.raises(WitnessRequestError, match="at most 63"):  # nor does the log's client send one
        encode_add_checkpoint(AddCheckpoint(1, (b"\x03" * 32,) * 64, b"note"))
