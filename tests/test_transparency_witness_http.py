"""`veil witness` over HTTP, as a log reaches it: it cosigns only consistent growth, refuses a rollback, a
fork and a wrong consistency proof each with the status c2sp.org/tlog-witness gives it, keeps refusing them after
a restart from its state file, and keeps the logs it follows apart."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import httpx
import pytest

from attestation.transparency.checkpoint import Checkpoint
from attestation.transparency.encoded_keys import parse_verifier
from attestation.transparency.note import sign_note
from transparency.fetch import directory_fetch
from transparency.keys import read_signer
from transparency.log import append_entries, init_log
from transparency.protocol import AddCheckpoint, encode_add_checkpoint
from transparency.reader import LogReader
from tests.transparency_support import veil_server
from veil.cli import main

SIZE_MEDIA_TYPE = "text/x.tlog.size"


def _new_log(tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]) -> tuple[Path, str]:
    assert main(["log", "init", str(tmp_path / name), "--origin", f"{name}.example/veil", "--key",
                 str(tmp_path / f"{name}.key")]) == 0
    return tmp_path / name, capsys.readouterr().out.strip()


def _append(log: Path, count: int, witness: str, capsys: pytest.CaptureFixture[str]) -> bytes:
    """Append `count` statements with `veil log append --witness`; the cosigned checkpoint it leaves."""
    start = LogReader(directory_fetch(log), read_signer(_key(log)).verifier).size
    statements = log.parent / f"{log.name}-{start}.json"
    statements.write_text(json.dumps([
        {"type": "veil.issuer-key/v1", "token_key_id": hashlib.sha256(b"%d" % (start + i)).hexdigest(),
         "not_before": start + i, "not_after": start + i + 1} for i in range(count)]))
    status = main(["log", "append", str(log), "--key", str(_key(log)), "--statement", str(statements),
                   "--witness", witness])
    assert status == 0, capsys.readouterr().err
    capsys.readouterr()
    return (log / "checkpoint").read_bytes()


def _key(log: Path) -> Path:
    return log.parent / f"{log.name}.key"


def _post(url: str, old: int, proof: tuple[bytes, ...], note: bytes) -> httpx.Response:
    return httpx.post(f"{url}/add-checkpoint", content=encode_add_checkpoint(AddCheckpoint(old, proof, note)))


def _signed(log: Path, size: int, root: bytes) -> bytes:
    signer = read_signer(_key(log))
    return sign_note(Checkpoint(signer.name, size, root).body(), signer).encode()


def _reader(log: Path) -> LogReader:
    return LogReader(directory_fetch(log), read_signer(_key(log)).verifier)


def _state(path: Path) -> dict[str, int]:
    return {origin: seen["size"] for origin, seen in json.loads(path.read_text())["logs"].items()}


def _refusals(url: str, log: Path, old_note: bytes, forked: Path, scratch: Path) -> None:
    """What the witness at `url`, which cosigned `log` at its current size, must refuse, each in its own way."""
    reader = _reader(log)
    size = reader.size
    rollback = _post(url, 3, (), old_note)  # a genuine, older checkpoint of the same log: the witness is further
    assert rollback.status_code == 409 and rollback.headers["content-type"].startswith(SIZE_MEDIA_TYPE)
    assert rollback.text == f"{size}\n"
    fork = _post(url, size, (), _signed(log, size, hashlib.sha256(b"another tree").digest()))
    assert fork.status_code == 422 and f"two trees of size {size}" in fork.text
    # A forked history that grew: its own consistency proof cannot lead from the root the witness holds.
    forked_reader = _reader_of(forked, log)
    assert forked_reader.size > size
    fork_grown = _post(url, size, tuple(forked_reader.consistency_proof(size)), forked_reader.checkpoint_note)
    assert fork_grown.status_code == 422 and "consistency proof" in fork_grown.text
    # The honest next checkpoint (grown in a copy), with its proof spoiled: a hash changed, dropped or added.
    grown = _reader_of(_grown_copy(log, scratch, 5), log)
    proof = tuple(grown.consistency_proof(size))
    for spoiled in ((bytes([proof[0][0] ^ 1]) + proof[0][1:], *proof[1:]), proof[:-1], (*proof, proof[0])):
        answer = _post(url, size, spoiled, grown.checkpoint_note)
        assert answer.status_code == 422 and "consistency proof" in answer.text
    stale = _post(url, 0, (), grown.checkpoint_note)  # the log's guess of the witness's size is wrong
    assert stale.status_code == 409 and stale.headers["content-type"].startswith(SIZE_MEDIA_TYPE)
    assert stale.text.strip() == str(size)


def _reader_of(directory: Path, log: Path) -> LogReader:
    return LogReader(directory_fetch(directory), read_signer(_key(log)).verifier)


def test_a_witness_refuses_rollbacks_forks_and_bad_proofs_and_still_does_after_a_restart(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log, log_key = _new_log(tmp_path, "a", capsys)
    assert main(["witness", "--key", str(tmp_path / "w.key"), "--new-key", "w.example"]) == 0
    witness_key = parse_verifier(capsys.readouterr().out.strip())
    forked = tmp_path / "forked"  # another history under the same key: what a compromised operator could sign
    init_log(forked, read_signer(_key(log)))
    append_entries(forked, read_signer(_key(log)), [b"forked %d" % i for i in range(20)])
    state = tmp_path / "w.state"
    arguments = ("witness", "--key", str(tmp_path / "w.key"), "--log", log_key, "--state", str(state))
    with veil_server(*arguments, port_file=tmp_path / "w.port") as url:
        old_note = _append(log, 3, url, capsys)
        _append(log, 4, url, capsys)  # the log sends old 0, learns 3, then proves 3 -> 7
        assert witness_key.timestamp(_reader(log).signed.note) is not None
        _refusals(url, log, old_note, forked, tmp_path / "grown-1")
    assert _state(state) == {"a.example/veil": 7}
    with veil_server(*arguments, port_file=tmp_path / "w.port") as url:  # a new process, the same state file
        _refusals(url, log, old_note, forked, tmp_path / "grown-2")
        _append(log, 1, url, capsys)  # honest growth from where it stopped is still cosigned: 7 -> 8
        assert witness_key.timestamp(_reader(log).signed.note) is not None
    assert _state(state) == {"a.example/veil": 8}


def test_two_logs_in_one_witness_do_not_mix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (one, one_key), (two, two_key) = _new_log(tmp_path, "one", capsys), _new_log(tmp_path, "two", capsys)
    assert main(["witness", "--key", str(tmp_path / "w.key"), "--new-key", "w.example"]) == 0
    capsys.readouterr()
    state = tmp_path / "w.state"
    with veil_server("witness", "--key", str(tmp_path / "w.key"), "--log", one_key, "--log", two_key, "--state",
                     str(state), port_file=tmp_path / "w.port") as url:
        _append(one, 6, url, capsys)
        _append(two, 2, url, capsys)
        _append(two, 3, url, capsys)
        assert _state(state) == {"one.example/veil": 6, "two.example/veil": 5}
        # Each log's size is its own: log one's proof from 6 means nothing for log two (at 5).
        append_entries(two, read_signer(_key(two)), [b"more"] * 4)
        stale = _post(url, 6, (), _reader(two).checkpoint_note)
        assert stale.status_code == 409 and stale.text.strip() == "5"
        wrong = _post(url, 5, tuple(_reader(one).consistency_proof(5)), _reader(two).checkpoint_note)
        assert wrong.status_code == 422  # a proof over log one's tree cannot extend log two's
        # A checkpoint naming log two but signed with log one's key is not log two's.
        impostor = sign_note(Checkpoint("two.example/veil", 9, b"\x01" * 32).body(), read_signer(_key(one)))
        answer = _post(url, 5, (), impostor.encode())
        assert answer.status_code == 403
        assert _state(state) == {"one.example/veil": 6, "two.example/veil": 5}
        _append(two, 1, url, capsys)
        _append(one, 1, url, capsys)
    assert _state(state) == {"one.example/veil": 7, "two.example/veil": 10}


def test_a_witness_refuses_two_log_keys_of_one_origin(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Keyed by origin, a second key of the same name would silently replace the first one's log."""
    _, first = _new_log(tmp_path, "one", capsys)
    assert main(["log", "init", str(tmp_path / "again"), "--origin", "one.example/veil", "--key",
                 str(tmp_path / "again.key")]) == 0
    second = capsys.readouterr().out.strip()
    assert main(["witness", "--key", str(tmp_path / "w.key"), "--new-key", "w.example"]) == 0
    capsys.readouterr()
    status = main(["witness", "--key", str(tmp_path / "w.key"), "--log", first, "--log", second, "--state",
                   str(tmp_path / "w.state")])
    assert status == 2
    assert "two --log keys name the same log one.example/veil" in capsys.readouterr().err


def test_each_refusal_has_the_status_c2sp_tlog_witness_gives_it(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """c2sp.org/tlog-witness, add-checkpoint, item by item, against a witness that cosigned the log at size 3."""
    log, log_key = _new_log(tmp_path, "a", capsys)
    assert main(["witness", "--key", str(tmp_path / "w.key"), "--new-key", "w.example"]) == 0
    capsys.readouterr()
    with veil_server("witness", "--key", str(tmp_path / "w.key"), "--log", log_key, "--state",
                     str(tmp_path / "w.state"), port_file=tmp_path / "w.port") as url:
        at_three = _append(log, 3, url, capsys)
        grown = _reader_of(_grown_copy(log, tmp_path / "grown", 4), log)
        proof = tuple(grown.consistency_proof(3))
        other_root = hashlib.sha256(b"another tree").digest()
        # "The old size MUST be equal to or lower than the checkpoint size. Otherwise ... 400 Bad Request."
        assert _post(url, 8, proof, grown.checkpoint_note).status_code == 400
        # "If it doesn't match, ... 409 Conflict ... the tree size of the latest cosigned checkpoint in decimal,
        # followed by a newline ... Content-Type of text/x.tlog.size": a checkpoint older than the witness's too.
        for stale in (_post(url, 0, (), grown.checkpoint_note), _post(url, 2, (), _signed(log, 2, other_root)),
                      _post(url, 0, (), _signed(log, 0, other_root))):
            assert stale.status_code == 409 and stale.headers["content-type"] == SIZE_MEDIA_TYPE
            assert stale.text == "3\n"
        # "If the old size matches the checkpoint size ... root hashes ... If they don't match, ... 422".
        fork = _post(url, 3, (), _signed(log, 3, other_root))
        assert fork.status_code == 422 and "two trees of size 3" in fork.text
        # "If a Merkle Consistency Proof doesn't verify, ... 422 Unprocessable Entity".
        assert _post(url, 3, proof[:-1], grown.checkpoint_note).status_code == 422
        assert _state(tmp_path / "w.state") == {"a.example/veil": 3}
        assert _post(url, 3, proof, grown.checkpoint_note).status_code == 200
        assert (log / "checkpoint").read_bytes() == at_three
    with veil_server("witness", "--key", str(tmp_path / "w.key"), "--log", log_key, "--state",
                     str(tmp_path / "fresh.state"), port_file=tmp_path / "w.port") as url:  # a witness at size 0
        # "A checkpoint of size zero MUST have the root hash of the empty tree ... Otherwise, ... 422".
        empty_but_wrong = _post(url, 0, (), _signed(log, 0, other_root))
        assert empty_but_wrong.status_code == 422 and "empty tree" in empty_but_wrong.text
        # "If the proof is not empty when the old size is zero, ... 422 Unprocessable Entity".
        assert _post(url, 0, proof, grown.checkpoint_note).status_code == 422
        assert not (tmp_path / "fresh.state").exists()
        assert _post(url, 0, (), grown.checkpoint_note).status_code == 200


def _grown_copy(log: Path, scratch: Path, count: int) -> Path:
    """A copy of `log` grown by `count` entries: the log's honest next checkpoint, not yet published."""
    grown = shutil.copytree(log, scratch, ignore=shutil.ignore_patterns(".lock"))
    append_entries(grown, read_signer(_key(log)), [b"next entry %d" % i for i in range(count)])
    return grown
