"""The transparency servers as tests run them: `veil log serve` and `veil witness` as real processes on loopback,
and a log built in a directory with the log's own code and cosigned by real `Witness` objects."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from attestation.transparency.note import NoteSigner
from transparency.fetch import directory_fetch
from transparency.log import add_cosignatures, append_entries, init_log
from transparency.reader import LogReader
from transparency.witness import Witness
from tests.conftest import HANG_S

REPO_ROOT = Path(__file__).resolve().parents[1]


@contextmanager
def veil_server(*args: str, port_file: Path) -> Iterator[str]:
    """Run `veil <args> --listen 127.0.0.1:0`; yield its base URL once it serves, stop it cleanly after."""
    port_file.unlink(missing_ok=True)
    process = subprocess.Popen([sys.executable, "-m", "veil", *args, "--listen", "127.0.0.1:0", "--port-file",
                                str(port_file)], cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + HANG_S
        while not port_file.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise AssertionError("the server did not start: " + process.communicate()[1])
            time.sleep(0.05)
        yield f"http://127.0.0.1:{int(port_file.read_text())}"
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=HANG_S)
    assert process.returncode == 0, stderr


def witnessed_log(directory: Path, signer: NoteSigner, entries: list[bytes], witnesses: Sequence[Witness]) -> LogReader:
    """A new log of `entries` under `signer`, its checkpoint cosigned by each of `witnesses`.

    Witnesses with fresh state files cosign whatever they are shown first: with the log's key, that is
    how a colluding operator and its witnesses make a second view of one log (a fork)."""
    init_log(directory, signer)
    signed = append_entries(directory, signer, entries)
    note = (directory / "checkpoint").read_bytes()
    add_cosignatures(directory, signer, signed.checkpoint, [w.add_checkpoint(0, (), note) for w in witnesses])
    return LogReader(directory_fetch(directory), signer.verifier)
