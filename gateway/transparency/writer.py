"""`veil log serve --key`: the log appends attested nodes' key statements and keeps its checkpoint cosigned.

One writer per log directory; its lock serializes appends and cosigning, so the witnesses are always
asked about the checkpoint that is current. After each append, and every `cosign_every_s` while
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
from gateway.transparency.cosign import cosign_checkpoint
from gateway.transparency.errors import LogStoreError
from gateway.transparency.fetch import directory_fetch
from gateway.transparency.log import append_entries
from gateway.transparency.log_index import LogIndex
from gateway.transparency.reader import LogReader
from gateway.transparency.staple import stapled_entry
from policy.model import Policy

_log = logging.getLogger("veil.log")


@dataclass(slots=True)
class LogWriter:
    directory: Path
    signer: NoteSigner
    policy: Policy  # evidence of appending nodes is verified under it
    witness_urls: Sequence[str] = ()
    _lock: threading.Lock = field(default_factory=threading.Lock)
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
            try:
                self._cosign_locked()
            except TransparencyError as error:  # appended all the same: the next round gets it cosigned
                _log.warning("veil log serve: the witnesses did not cosign: %s", error)
        return index

    def cosign(self) -> None:
        with self._lock:
            self._cosign_locked()

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

    def _cosign_locked(self) -> None:
        if not self.witness_urls:
            return
        with httpx.Client(timeout=30.0, trust_env=False) as client:
            cosign_checkpoint(self.directory, self.signer, self.witness_urls, client)

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
