"""`veil log serve --key`: the log appends attested nodes' key statements and keeps its checkpoint cosigned.

One writer per log directory. Its lock serializes appends and is held only while the log's files are
read or written, never across a witness's HTTP call: nodes' `/proof` and `/release-index` wait for it,
and a witness may take its full timeout (30 s) to answer. Witness rounds are serialized by a lock of
their own (a witness keeps one size per log, so two rounds at once would contradict each other). A
round staples its cosignatures only if the checkpoint it showed is still the current one
(`add_cosignatures` checks under the log's file lock); one that an append overtook is dropped, and the
append's own round cosigns the newer checkpoint. After each append, and every `cosign_every_s` while
the log does not grow, the witnesses are asked again: fresh cosignatures are what lets nodes staple
proofs younger than the policy's max_checkpoint_age_s.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from attestation.transparency.client_check import StapledEntry
from attestation.transparency.errors import TransparencyError
from attestation.transparency.node_append import AppendRequest, check_append
from attestation.transparency.note import NoteSigner
from attestation.transparency.statements import encode_statement
from transparency.cosign import cosign_checkpoint
from transparency.errors import LogGrewError, LogStoreError
from transparency.fetch import directory_fetch
from transparency.log import append_entries
from transparency.log_index import LogIndex
from transparency.reader import LogReader
from transparency.staple import stapled_entry
from policy.model import Policy

_log = logging.getLogger("veil.log")


@dataclass(slots=True)
class LogWriter:
    directory: Path
    signer: NoteSigner
    policy: Policy  # evidence of appending nodes is verified under it
    witness_urls: Sequence[str] = ()
    witness_timeout_s: float = 30.0  # each witness call's; a round asks the witnesses in turn
    _lock: threading.Lock = field(default_factory=threading.Lock)  # appends and reads; never held over HTTP
    _cosign_lock: threading.Lock = field(default_factory=threading.Lock)  # one witness round at a time
    _index: LogIndex = field(default_factory=LogIndex)  # read and caught up under the lock

    def append_node_key(self, request: AppendRequest) -> int:
        """Append the node's key statement if its evidence vouches for it; its index (an existing one if logged)."""
        statement = check_append(request, self.policy)
        entry = encode_statement(statement)
        with self._lock:
            self._index.catch_up(self._reader())
            logged = self._index.index_of(entry)
            if logged is not None:  # a node asking twice gets the entry it has
                return logged
            index = append_entries(self.directory, self.signer, [entry]).checkpoint.size - 1
        try:  # outside the lock: the proofs nodes fetch meanwhile are against the checkpoint as it stands
            self.cosign()
        except TransparencyError as error:  # appended all the same: the next round gets it cosigned
            _log.warning("veil log serve: the witnesses did not cosign: %s", error)
        return index

    def cosign(self) -> None:
        """Ask the witnesses to cosign the current checkpoint and staple their cosignatures, if it still is."""
        if not self.witness_urls:
            return
        with self._cosign_lock, httpx.Client(timeout=self.witness_timeout_s, trust_env=False) as client:
            try:
                cosign_checkpoint(self.directory, self.signer, self.witness_urls, client)
            except LogGrewError:  # an append overtook this round; its own round (next on the lock) cosigns it
                _log.info("veil log serve: the log grew while its witnesses cosigned; the next round covers it")

    def stapled(self, index: int) -> StapledEntry:
        """Entry `index` with its tlog-proof against the current (cosigned) checkpoint."""
        with self._lock:
            reader = self._reader()
            if not 0 <= index < reader.size:
                raise LogStoreError("no entry at that index in the log")
            return stapled_entry(reader, index)

    def release_index(self, code_digest: str, policy_digest: str, model_digest: str) -> int | None:
        """The newest release statement listing these digests, or None."""
        with self._lock:
            self._index.catch_up(self._reader())
            return self._index.release_index(code_digest, policy_digest, model_digest)

    def run_cosigner(self, every_s: float, stop: threading.Event) -> None:
        """Ask the witnesses again every `every_s` seconds until `stop` is set (a failure is logged, not fatal)."""
        while not stop.wait(every_s):
            try:
                self.cosign()
            except TransparencyError as error:
                _log.warning("veil log serve: the witnesses did not cosign: %s", error)

    def _reader(self) -> LogReader:
        return LogReader(directory_fetch(self.directory), self.signer.verifier)


def start_cosigner(writer: LogWriter, every_s: float) -> threading.Event:
    """Cosign now (a failure is logged), then every `every_s` seconds in a daemon thread; set the event to stop."""
    stop = threading.Event()
    try:
        writer.cosign()
    except TransparencyError as error:
        _log.warning("veil log serve: the witnesses did not cosign: %s", error)
    if every_s > 0:
        threading.Thread(target=writer.run_cosigner, args=(every_s, stop), name="veil-log-cosign",
                         daemon=True).start()
    _log.info("veil log serve: %d witness(es), asked again every %g s", len(writer.witness_urls), every_s)
    return stop
