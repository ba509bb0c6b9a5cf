"""`veil log audit` against a log large enough for tiles at levels 0, 1 and 2 (65,799 entries: full and
partial tiles and bundles at every level), tampered at every kind of tile and position: each change
fails the audit through the real command, with its own message, a non-zero exit and nothing saved,
read from the directory and over HTTP from `veil log serve`."""

from __future__ import annotations

import hashlib
import os
import resource
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from attestation.transparency.checkpoint import Checkpoint
from attestation.transparency.merkle import leaf_hash, root_of
from attestation.transparency.note import generate_signer, sign_note
from attestation.transparency.statements import IssuerKeyStatement, encode_statement
from attestation.transparency.tiles import TileName, encode_bundle, parse_bundle
from transparency.log import append_entries, init_log
from tests.transparency_support import REPO_ROOT, veil_server
from veil.cli import main

ORIGIN = "log.example/veil"
SIGNER = generate_signer(ORIGIN)
LOG_KEY = SIGNER.verifier.encode()
SIZE = 65_536 + 256 + 7  # level 0: 257 full tiles + 7; level 1: a full tile + 1; level 2: one hash
FIRST_BATCH = 300  # an older checkpoint, whose partial tiles stay beside the current ones


def _entry(number: int) -> bytes:
    return encode_statement(IssuerKeyStatement(hashlib.sha256(b"%d" % number).hexdigest(), number, number + 1))


@pytest.fixture(scope="module")
def entries() -> list[bytes]:
    return [_entry(number) for number in range(SIZE)]


def _build(directory: Path, entries: list[bytes]) -> Path:
    init_log(directory, SIGNER)
    append_entries(directory, SIGNER, entries[:FIRST_BATCH])
    append_entries(directory, SIGNER, entries[FIRST_BATCH:])
    return directory


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory, entries: list[bytes]) -> Path:
    log = _build(tmp_path_factory.mktemp("template") / "log", entries)
    for path in ("tile/0/000", "tile/0/257.p/7", "tile/1/000", "tile/1/001.p/1", "tile/2/000.p/1",
                 "tile/entries/256", "tile/entries/257.p/7", "tile/entries/001.p/44"):
        assert (log / path).is_file(), path  # every kind of tile the cases below tamper with exists
    return log


def _copy(template: Path, target: Path) -> Path:
    """A copy of hard links (fast): every tampering below replaces a file, never writes into a shared one."""
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(template, target, copy_function=os.link)
    return target


def _replace(path: Path, data: bytes) -> None:
    path.unlink()
    path.write_bytes(data)


def _bundle(change: Callable[[list[bytes]], list[bytes]], path: str, width: int = 256) -> Callable[[Path], None]:
    def tamper(log: Path) -> None:
        _replace(log / path, encode_bundle(change(parse_bundle((log / path).read_bytes(), width))))
    return tamper


def _hashes(change: Callable[[list[bytes]], list[bytes]], path: str) -> Callable[[Path], None]:
    def tamper(log: Path) -> None:
        data = (log / path).read_bytes()
        _replace(log / path, b"".join(change([data[i:i + 32] for i in range(0, len(data), 32)])))
    return tamper


def _bytes(change: Callable[[bytes], bytes], path: str) -> Callable[[Path], None]:
    return lambda log: _replace(log / path, change((log / path).read_bytes()))


def _at(index: int, value: bytes) -> Callable[[list[bytes]], list[bytes]]:
    return lambda items: items[:index] + [value] + items[index + 1:]


def _swap(first: int) -> Callable[[list[bytes]], list[bytes]]:
    return lambda items: items[:first] + [items[first + 1], items[first]] + items[first + 2:]


def _removed(index: int) -> Callable[[list[bytes]], list[bytes]]:
    """Remove one, and fill the end with a copy of the last so the width stays (a careful forger)."""
    return lambda items: items[:index] + items[index + 1:] + items[-1:]


def _inserted(index: int, value: bytes) -> Callable[[list[bytes]], list[bytes]]:
    return lambda items: items[:index] + [value] + items[index:-1]


def _duplicated(index: int) -> Callable[[list[bytes]], list[bytes]]:
    return lambda items: items[:index] + [items[index - 1]] + items[index + 1:]


def _swap_files(first: str, second: str) -> Callable[[Path], None]:
    def tamper(log: Path) -> None:
        one, two = (log / first).read_bytes(), (log / second).read_bytes()
        _replace(log / first, two)
        _replace(log / second, one)
    return tamper


def _checkpoint(size: int, root: bytes, signer=SIGNER) -> Callable[[Path], None]:
    return lambda log: _replace(log / "checkpoint", sign_note(Checkpoint(ORIGIN, size, root).body(), signer).encode())


def _flip_signature(log: Path) -> None:
    data = bytearray((log / "checkpoint").read_bytes())
    data[-10] = ord("A") if data[-10] != ord("A") else ord("B")
    _replace(log / "checkpoint", bytes(data))


OTHER = _entry(10**9)
FAKE = hashlib.sha256(b"a hash no tree holds").digest()
BUNDLE, PARTIAL = "tile/entries/256", "tile/entries/257.p/7"

# id: (tampering, what the failure must say)
CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    # entry bundles, full and partial: changed, removed, inserted, reordered, duplicated, truncated, extended
    "bundle full, first entry changed": (_bundle(_at(0, OTHER), "tile/entries/000"),
                                         "entry bundle tile/entries/000 is not what the signed tree holds: "
                                         "the entry at position 0 changed"),
    "bundle full, last entry changed": (_bundle(_at(255, OTHER), BUNDLE),
                                        f"entry bundle {BUNDLE} is not what the signed tree holds: "
                                        "the entry at position 255 changed"),
    "bundle partial, entry changed": (_bundle(_at(3, OTHER), PARTIAL, 7), "the entry at position 3 changed"),
    "bundle full, entry removed": (_bundle(_removed(10), "tile/entries/100"),
                                   "tile/entries/100 is not what the signed tree holds: the entry at position 10 "
                                   "removed"),
    "bundle full, entry removed, not filled": (_bundle(lambda items: items[1:], "tile/entries/005"),
                                               "entry bundle tile/entries/005: an entry bundle of width 256 holds "
                                               "255 entries (entries removed)"),
    "bundle partial, last entry removed": (_bundle(lambda items: items[:-1], PARTIAL, 7),
                                           f"entry bundle {PARTIAL}: an entry bundle of width 7 holds 6 entries "
                                           "(entries removed)"),
    "bundle full, entry inserted": (_bundle(_inserted(20, OTHER), "tile/entries/200"),
                                    "an entry inserted at position 20"),
    "bundle full, entries reordered": (_bundle(_swap(5), "tile/entries/050"), "entries reordered from position 5"),
    "bundle partial, entries reordered": (_bundle(_swap(0), PARTIAL, 7), "entries reordered from position 0"),
    "bundle full, entry duplicated": (_bundle(_duplicated(9), "tile/entries/007"),
                                      "an entry duplicated at position 9"),
    "bundle partial, entry duplicated": (_bundle(_duplicated(6), PARTIAL, 7), "an entry duplicated at position 6"),
    "bundle partial, entry added": (_bundle(lambda items: [*items, OTHER], PARTIAL, 7),
                                    "holds 8 entries (entries added)"),
    "bundle full, truncated": (_bytes(lambda data: data[:-5], BUNDLE), f"entry bundle {BUNDLE}: an entry bundle "
                                                                      "ends inside an entry"),
    "bundles swapped": (_swap_files("tile/entries/001", "tile/entries/002"),
                        "tile/entries/001 is not what the signed tree holds: the entry at position 0 changed"),
    "bundle missing": (lambda log: (log / "tile/entries/123").unlink(), "the log has no tile/entries/123"),
    "bundle partial missing": (lambda log: (log / PARTIAL).unlink(), f"the log has no {PARTIAL}"),
    # hash tiles of level 0 (full, partial), level 1 (full, partial) and level 2 (partial)
    "level 0 full, first hash changed": (_hashes(_at(0, FAKE), "tile/0/000"),
                                         "hash tile tile/0/000 does not hold the hashes its entries imply: "
                                         "the hash at position 0 changed"),
    "level 0 full, hash removed": (_hashes(_removed(17), "tile/0/256"),
                                   "hash tile tile/0/256 does not hold the hashes its entries imply: "
                                   "the hash at position 17 removed"),
    "level 0 full, hashes reordered": (_hashes(_swap(254), "tile/0/099"), "tile/0/099 does not hold the hashes its "
                                                                          "entries imply: hashes reordered from "
                                                                          "position 254"),
    "level 0 full, hash duplicated": (_hashes(_duplicated(1), "tile/0/033"), "a hash duplicated at position 1"),
    "level 0 full, hash inserted": (_hashes(_inserted(2, FAKE), "tile/0/034"), "a hash inserted at position 2"),
    "level 0 partial, last hash changed": (_hashes(_at(6, FAKE), "tile/0/257.p/7"),
                                           "hash tile tile/0/257.p/7 does not hold the hashes its entries imply: "
                                           "the hash at position 6 changed"),
    "level 0 full, truncated": (_bytes(lambda data: data[:-32], "tile/0/010"),
                                "hash tile tile/0/010: a tile of width 256 must be 8192 bytes, not 8160 (truncated)"),
    "level 0 partial, extended": (_bytes(lambda data: data + FAKE, "tile/0/257.p/7"),
                                  "hash tile tile/0/257.p/7: a tile of width 7 must be 224 bytes, not 256 (extended)"),
    "level 0 missing": (lambda log: (log / "tile/0/042").unlink(), "the log has no tile/0/042"),
    "level 0 partial missing": (lambda log: (log / "tile/0/257.p/7").unlink(), "the log has no tile/0/257.p/7"),
    "level 1 full, hash changed": (_hashes(_at(100, FAKE), "tile/1/000"),
                                   "hash tile tile/1/000 does not hold the hashes its entries imply: "
                                   "the hash at position 100 changed"),
    "level 1 full, hashes reordered": (_hashes(_swap(3), "tile/1/000"), "tile/1/000 does not hold the hashes its "
                                                                        "entries imply: hashes reordered from "
                                                                        "position 3"),
    "level 1 full, truncated": (_bytes(lambda data: data[:100], "tile/1/000"),
                                "hash tile tile/1/000: a tile of width 256 must be 8192 bytes, not 100 (truncated)"),
    "level 1 partial, hash changed": (_hashes(_at(0, FAKE), "tile/1/001.p/1"),
                                      "hash tile tile/1/001.p/1 does not hold the hashes its entries imply: "
                                      "the hash at position 0 changed"),
    "level 1 partial, extended": (_bytes(lambda data: data + FAKE, "tile/1/001.p/1"),
                                  "hash tile tile/1/001.p/1: a tile of width 1 must be 32 bytes, not 64 (extended)"),
    "level 1 missing": (lambda log: (log / "tile/1/000").unlink(), "the log has no tile/1/000"),
    "level 2 partial, hash changed": (_hashes(_at(0, FAKE), "tile/2/000.p/1"),
                                      "hash tile tile/2/000.p/1 does not hold the hashes its entries imply: "
                                      "the hash at position 0 changed"),
    "level 2 partial, extended": (_bytes(lambda data: data + FAKE, "tile/2/000.p/1"),
                                  "hash tile tile/2/000.p/1: a tile of width 1 must be 32 bytes, not 64 (extended)"),
    "level 2 partial, truncated": (_bytes(lambda data: data[:31], "tile/2/000.p/1"), "not 31 (truncated)"),
    # the checkpoint
    "checkpoint root changed, re-signed": (_checkpoint(SIZE, FAKE), "the checkpoint signs a root that the log's "
                                                                    "entries do not produce"),
    "checkpoint size grown, re-signed": (_checkpoint(SIZE + 1, FAKE), "the log has no tile/entries/257.p/8"),
    "checkpoint signature changed": (_flip_signature, f"the signature by {ORIGIN} does not verify"),
    "checkpoint signed by another key": (_checkpoint(SIZE, FAKE, generate_signer(ORIGIN)),
                                         "the note is not signed by any key this verifier knows"),
    "checkpoint missing": (lambda log: (log / "checkpoint").unlink(), "the log has no checkpoint"),
}


def _audit(source: str, state: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    status = main(["log", "audit", source, "--log-key", LOG_KEY, "--state", str(state)])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def _expect_failure(source: str, state: Path, expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    before = state.read_bytes() if state.exists() else None
    status, out, err = _audit(source, state, capsys)
    assert status == 1 and out == ""
    assert "veil log audit: FAILED: " in err and expected in err, err
    assert "Traceback" not in err
    assert (state.read_bytes() if state.exists() else None) == before  # a failed audit records nothing


def test_the_untouched_log_passes_and_every_case_has_its_own_message(template: Path, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = _audit(str(template), tmp_path / "state.json", capsys)
    assert status == 0 and f"{SIZE} entries" in out and "0 entries flagged" in out
    assert len({expected for _, expected in CASES.values()}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=CASES)
def test_a_tampered_directory_fails_the_audit(case: str, template: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    tamper, expected = CASES[case]
    log = _copy(template, tmp_path / "log")
    tamper(log)
    _expect_failure(str(log), tmp_path / "state.json", expected, capsys)


# ----- history rewritten and re-signed, against the auditor's saved state ------------------------------


def _rewritten(entries: list[bytes]) -> dict[str, tuple[list[bytes], str]]:
    return {
        "an old entry changed, same size": (entries[:1000] + [OTHER] + entries[1001:],
                                            f"the log's first {SIZE} entries no longer produce the root last "
                                            "audited: history was rewritten"),
        "an old entry removed, one appended": (entries[:70] + entries[71:] + [OTHER],
                                               f"the log's first {SIZE} entries no longer produce"),
        "an old entry changed, log grown": (entries[:5] + [OTHER] + entries[6:] + [_entry(SIZE + i) for i in range(9)],
                                            f"the log's first {SIZE} entries no longer produce"),
        "entries reordered, same size": (entries[:-2] + entries[-1:] + entries[-2:-1],
                                         f"the log's first {SIZE} entries no longer produce"),
        "rolled back to an older size": (entries[:FIRST_BATCH],
                                         f"the log is smaller ({FIRST_BATCH}) than when last audited ({SIZE})"),
    }


@pytest.fixture(scope="module")
def audited_state(template: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The auditor's state after auditing the honest log through the command."""
    state = tmp_path_factory.mktemp("auditor") / "state.json"
    assert main(["log", "audit", str(template), "--log-key", LOG_KEY, "--state", str(state)]) == 0
    return state


@pytest.mark.parametrize("case", ["an old entry changed, same size", "an old entry removed, one appended",
                                  "an old entry changed, log grown", "entries reordered, same size",
                                  "rolled back to an older size"])
def test_a_history_rebuilt_and_re_signed_fails_against_the_saved_state(
        case: str, entries: list[bytes], audited_state: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    rebuilt, expected = _rewritten(entries)[case]
    log = tmp_path / "rebuilt"
    init_log(log, SIGNER)
    append_entries(log, SIGNER, rebuilt)
    state = tmp_path / "state.json"
    shutil.copy(audited_state, state)
    _, out, _ = _audit(str(log), tmp_path / "fresh.json", capsys)
    assert "first audit" in out  # on its own, the rebuilt log is a well-formed log
    _expect_failure(str(log), state, expected, capsys)


def test_a_log_that_grew_honestly_passes_against_the_saved_state(
        template: Path, audited_state: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = _copy(template, tmp_path / "log")  # appending replaces files (never writes into them): links are safe
    append_entries(log, SIGNER, [_entry(SIZE + i) for i in range(300)])
    state = tmp_path / "state.json"
    shutil.copy(audited_state, state)
    status, out, _ = _audit(str(log), state, capsys)
    assert status == 0 and f"{SIZE + 300} entries" in out and f"consistent with size {SIZE}" in out


# ----- the same over HTTP, from `veil log serve` ----------------------------------------------------------


@pytest.fixture(scope="module")
def served(template: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str]]:
    """`veil log serve` over a directory that each test fills with its own tampered copy."""
    root = tmp_path_factory.mktemp("served")
    directory = _copy(template, root / "log")
    with veil_server("log", "serve", str(directory), port_file=root / "port") as url:
        yield directory, url


HTTP_CASES = ["bundle full, first entry changed", "bundle partial, entry duplicated", "bundle partial, entry added",
              "level 0 full, hash removed", "level 0 partial, extended", "level 1 full, hashes reordered",
              "level 1 partial, hash changed", "level 2 partial, hash changed", "level 0 missing",
              "checkpoint root changed, re-signed", "checkpoint signature changed"]


@pytest.mark.parametrize("case", HTTP_CASES)
def test_a_tampered_log_fails_the_audit_over_http(case: str, template: Path, served: tuple[Path, str],
                                                  tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    directory, url = served
    _copy(template, directory)
    status, out, _ = _audit(url, tmp_path / "honest.json", capsys)
    assert status == 0 and f"{SIZE} entries" in out  # the same server, untouched, passes
    tamper, expected = CASES[case]
    tamper(directory)
    _expect_failure(url, tmp_path / "state.json", expected, capsys)


# ----- a checkpoint signed over far more entries than the log holds ------------------------------------------

HUGE = 2**40
NO_HANG_S = 300  # bounds a hang, not a speed: the audit needs one fetch to fail
AUDIT_MEMORY_BYTES = 4 << 30  # a regression that names every tile must not take the machine down with it


def _bounded_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (AUDIT_MEMORY_BYTES, AUDIT_MEMORY_BYTES))


def test_a_checkpoint_signed_over_2_to_the_40_fails_the_audit_instead_of_hanging(tmp_path: Path) -> None:
    """The operator under audit signs one checkpoint of size 2**40 over its real log: `veil log audit`, over
    HTTP from `veil log serve`, prints FAILED naming the bundle the log lacks, and does not stall."""
    log = _build(tmp_path / "log", [_entry(number) for number in range(FIRST_BATCH)])
    _checkpoint(HUGE, FAKE)(log)
    with veil_server("log", "serve", str(log), port_file=tmp_path / "port") as url:
        audit = subprocess.run([sys.executable, "-m", "veil", "log", "audit", url, "--log-key", LOG_KEY, "--state",
                                str(tmp_path / "state.json")], cwd=REPO_ROOT, capture_output=True, text=True,
                               env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, timeout=NO_HANG_S,
                               preexec_fn=_bounded_memory)
    last_bundle = TileName(None, HUGE // 256 - 1).path()
    assert audit.returncode == 1 and audit.stdout == ""
    assert f"veil log audit: FAILED: the log has no {last_bundle}" in audit.stderr, audit.stderr
    assert not (tmp_path / "state.json").exists()
