"""A slow witness does not hold up the log's nodes: `veil log serve --key` asks its witnesses without the lock
that `/proof` and `/release-index` take, and an append made while a witness round is under way is neither
lost nor published under two roots (the overtaken round's cosignatures are dropped, the next round's kept).

The log and the witness are the real applications on real servers; the witness is slow by construction: it
holds each add-checkpoint until the test lets it go."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx

from attestation.transparency.checkpoint import open_checkpoint
from attestation.transparency.cosignature import generate_cosigner
from attestation.transparency.note import Signature, generate_signer, parse_note
from attestation.transparency.statements import ReleaseStatement, encode_statement
from transparency.apps import log_app, witness_app
from transparency.fetch import directory_fetch
from transparency.log import append_entries, init_log
from transparency.reader import LogReader
from transparency.witness import Witness
from transparency.writer import LogWriter
from tests.http_stand_in import served

LOG = generate_signer("log.example/veil")
COSIGNER = generate_cosigner("witness.example")
NO_HANG_S = 120.0  # bounds a hang, never a speed
DIGESTS = {"code": "c0" * 32, "policy": "d0" * 32, "model": "e0" * 32}
RELEASE = encode_statement(ReleaseStatement("1.0", DIGESTS["code"], DIGESTS["policy"], (DIGESTS["model"],)))


class HeldWitness(Witness):
    """A real witness whose every add-checkpoint waits until released: a witness taking its full timeout."""

    def __init__(self, state: Path) -> None:
        Witness.__init__(self, COSIGNER, [LOG.verifier], state)
        self.entered, self.release = threading.Semaphore(0), threading.Event()

    def add_checkpoint(self, old_size: int, proof, note_data: bytes) -> Signature:  # type: ignore[no-untyped-def]
        self.entered.release()
        assert self.release.wait(NO_HANG_S)
        return super().add_checkpoint(old_size, proof, note_data)


def _log(tmp_path: Path) -> Path:
    init_log(tmp_path / "log", LOG)
    append_entries(tmp_path / "log", LOG, [RELEASE])
    return tmp_path / "log"


def _checkpoint(http: httpx.Client, url: str) -> tuple[int, bytes]:
    checkpoint = open_checkpoint(http.get(f"{url}/checkpoint").content, LOG.verifier).checkpoint
    return checkpoint.size, checkpoint.root


def test_nodes_get_their_proofs_while_a_witness_stalls_and_an_append_meanwhile_is_kept(tmp_path: Path) -> None:
    log = _log(tmp_path)
    witness = HeldWitness(tmp_path / "witness.json")
    with served(witness_app(witness)) as witness_url:
        writer = LogWriter(log, LOG, policy=None, witness_urls=(witness_url,),  # type: ignore[arg-type]  # no appends
                           witness_timeout_s=NO_HANG_S)
        with served(log_app(log, writer)) as url, httpx.Client(timeout=NO_HANG_S / 2) as http:
            seen = {_checkpoint(http, url)}
            first_round = threading.Thread(target=writer.cosign)
            first_round.start()
            assert witness.entered.acquire(timeout=NO_HANG_S)  # the round is inside the witness, held there
            # What nodes fetch is answered while the witness holds the round.
            assert http.get(f"{url}/proof/0").status_code == 200
            assert http.get(f"{url}/release-index", params=DIGESTS).json() == {"index": 0}
            assert first_round.is_alive()  # answered while the witness still held the round, not after it ended
            append_entries(log, LOG, [b"appended while the witness held the round"])
            seen.add(_checkpoint(http, url))
            witness.release.set()
            first_round.join(NO_HANG_S)
            assert not first_round.is_alive()
            # The held round showed size 1; the log is at 2 now: that round's cosignature is not stapled to it.
            assert COSIGNER.verifier.timestamp(parse_note(http.get(f"{url}/checkpoint").content)) is None
            writer.cosign()  # the next round (an append's own, or the periodic one) cosigns size 2
            seen.add(_checkpoint(http, url))
            note = parse_note(http.get(f"{url}/checkpoint").content)
    assert COSIGNER.verifier.timestamp(note) is not None and witness.seen(LOG.name).size == 2
    assert len({size for size, _ in seen}) == len(seen)  # one root per size, ever
    reader = LogReader(directory_fetch(log), LOG.verifier)
    assert [reader.entry(0), reader.entry(1)] == [RELEASE, b"appended while the witness held the round"]
