"""The log's append endpoint verifies evidence for whoever posts it, so it bounds that work: appends past
`max_appends_in_flight` are refused at once with 503 and Retry-After, and the log's reads keep being served."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from attestation.transparency.node_append import APPEND_PATH, AppendRequest
from attestation.measurement import Measurement
from enclave.transparency import TransparencyStapler
from transparency.apps import log_app
from transparency.writer import LogWriter
from tests.http_stand_in import served
from tests.conftest import HANG_S

APPEND = AppendRequest(b"an entry", "{}").to_json()


@dataclass
class HeldWriter(LogWriter):
    """A writer whose appends wait until released: what a slow evidence verification looks like from outside."""

    entered: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(0))
    release: threading.Event = field(default_factory=threading.Event)

    def append_node_key(self, request: AppendRequest) -> int:
        self.entered.release()
        assert self.release.wait(HANG_S)
        return 7


def _writer(tmp_path: Path) -> HeldWriter:
    return HeldWriter(tmp_path, signer=None, policy=None)  # type: ignore[arg-type]  # neither is read when held


@pytest.mark.parametrize("bound", [1, 2])
def test_appends_past_the_bound_are_refused_at_once_and_the_held_ones_finish(tmp_path: Path, bound: int) -> None:
    (tmp_path / "checkpoint").write_text("a checkpoint\n")
    writer = _writer(tmp_path)
    with served(log_app(tmp_path, writer, max_appends_in_flight=bound)) as url, ThreadPoolExecutor(bound) as pool:
        held = [pool.submit(httpx.post, f"{url}{APPEND_PATH}", content=APPEND, timeout=60.0) for _ in range(bound)]
        for _ in range(bound):
            assert writer.entered.acquire(timeout=60)  # every slot is taken by an append inside the writer
        refused = httpx.post(f"{url}{APPEND_PATH}", content=APPEND, timeout=60.0)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert "appends" in refused.json()["error"]["message"]
        assert httpx.get(f"{url}/checkpoint", timeout=60.0).text == "a checkpoint\n"  # reads are not bounded
        writer.release.set()
        assert [answer.result().json() for answer in held] == [{"index": 7}] * bound
        # The slots came back: the next append is taken.
        assert httpx.post(f"{url}{APPEND_PATH}", content=APPEND, timeout=60.0).json() == {"index": 7}


def test_a_refused_or_malformed_append_gives_its_slot_back(tmp_path: Path) -> None:
    writer = _writer(tmp_path)
    writer.release.set()
    with served(log_app(tmp_path, writer, max_appends_in_flight=1)) as url:
        for _ in range(3):
            assert httpx.post(f"{url}{APPEND_PATH}", content=b"not json", timeout=60.0).status_code == 400
        assert httpx.post(f"{url}{APPEND_PATH}", content=APPEND, timeout=60.0).json() == {"index": 7}


def test_a_sender_trickling_its_body_in_holds_no_slot(tmp_path: Path) -> None:
    writer = _writer(tmp_path)
    writer.release.set()
    go_on, first_sent = threading.Event(), threading.Event()

    def trickled():
        yield APPEND[:10]
        first_sent.set()  # asked for more: the headers and the first bytes are on the wire
        assert go_on.wait(HANG_S)
        yield APPEND[10:]

    with served(log_app(tmp_path, writer, max_appends_in_flight=1)) as url, ThreadPoolExecutor(1) as pool:
        slow = pool.submit(httpx.post, f"{url}{APPEND_PATH}", content=trickled(), timeout=60.0)
        assert first_sent.wait(HANG_S)
        # The trickling sender is connected and sending, yet the one slot is free for this append.
        assert httpx.post(f"{url}{APPEND_PATH}", content=APPEND, timeout=60.0).json() == {"index": 7}
        go_on.set()
        assert slow.result().json() == {"index": 7}


def test_a_bound_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        log_app(Path("."), None, max_appends_in_flight=0)


def test_veil_log_serve_refuses_a_bound_below_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from veil.cli import main

    (tmp_path / "checkpoint").write_text("a checkpoint\n")
    assert main(["log", "serve", str(tmp_path), "--max-appends-in-flight", "0"]) == 2
    assert "--max-appends-in-flight must be at least 1" in capsys.readouterr().err


def test_a_node_told_the_log_is_busy_says_so_and_tries_again_later(tmp_path: Path) -> None:
    writer = _writer(tmp_path)
    with served(log_app(tmp_path, writer, max_appends_in_flight=1)) as url, ThreadPoolExecutor(1) as pool:
        held = pool.submit(httpx.post, f"{url}{APPEND_PATH}", content=APPEND, timeout=60.0)
        assert writer.entered.acquire(timeout=60)
        stapler = TransparencyStapler(url, Measurement(bytes(32), bytes(32), bytes(32)), lambda: b"a key config",
                                      lambda nonce: "{}", key_lifetime_s=3600, refresh_s=60, receipt_key=bytes(32))
        assert stapler.refresh_quietly() is False  # its background thread retries after RETRY_S
        assert stapler.last_error is not None and "503" in stapler.last_error
        assert "as many appends as it takes at once" in stapler.last_error  # the log's own sentence
        writer.release.set()
        assert held.result().json() == {"index": 7}
