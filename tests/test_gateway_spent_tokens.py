"""The spent-token stores: every (key id, nonce) pair is spent once, across processes, replicas and a killed one.

Each test runs on the real SQLite store (a file in WAL mode) and on a real
Redis server on loopback (skipped, saying why, where redis-server or the redis
package is missing). Replicas are separate processes, each with its own store
handle.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.errors import GatewaySettingsError, SpentTokensError
from gateway.spent_tokens import (
    EXPIRY_GRANULARITY_S,
    RedisSpentTokens,
    SqliteSpentTokens,
    open_spent_tokens,
    stored_expiry,
)
from tests.spent_tokens_support import RedisServer, recorded, spend_and_record
from tests.conftest import HANG_S

KEY_ID = bytes(range(32))
ATTEMPTS = 1000
SPAWN = multiprocessing.get_context("spawn")


def nonces(count: int, salt: bytes = b"") -> list[bytes]:
    return [salt + index.to_bytes(8, "big") + os.urandom(24) for index in range(count)]


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture(params=["sqlite", "redis"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:{tmp_path / 'spent.db'}"
    server: RedisServer = request.getfixturevalue("redis_server")
    server.client().flushdb()
    return server.url


def in_an_hour() -> float:
    return time.time() + 3600


# The start signal of running replicas: it must outlive run_replicas until every child has opened it.
_STARTS: list[object] = []


def run_replicas(url: str, jobs: list[tuple[list[bytes], Path, float]], *,
                 in_step: bool = False) -> list[multiprocessing.Process]:
    start = SPAWN.Event()
    barrier = SPAWN.Barrier(len(jobs)) if in_step else None
    _STARTS[:] = [start, barrier]
    replicas = [SPAWN.Process(target=spend_and_record, args=(url, KEY_ID, batch, str(record), start, pause_s, barrier))
                for batch, record, pause_s in jobs]
    for replica in replicas:
        replica.start()
    start.set()
    return replicas


def test_a_pair_is_spent_once_and_other_pairs_are_independent(store_url: str) -> None:
    store = open_spent_tokens(store_url)
    nonce, other_nonce, other_key = os.urandom(32), os.urandom(32), bytes(32)
    assert store.spend(KEY_ID, nonce, in_an_hour()) is True
    assert store.spend(KEY_ID, nonce, in_an_hour()) is False
    assert store.spend(KEY_ID, other_nonce, in_an_hour()) is True
    assert store.spend(other_key, nonce, in_an_hour()) is True  # the same nonce under another key is another token
    store.close()


def test_two_processes_hammering_the_same_nonces_spend_each_exactly_once(store_url: str, tmp_path: Path) -> None:
    shared = nonces(ATTEMPTS)
    records = [tmp_path / "first.txt", tmp_path / "second.txt"]
    replicas = run_replicas(store_url, [(shared, records[0], 0.0), (shared, records[1], 0.0)], in_step=True)
    for replica in replicas:
        replica.join(HANG_S)
        assert replica.exitcode == 0
    won = [recorded(record) for record in records]
    assert not set(won[0]) & set(won[1]), "a nonce was admitted by both processes"
    assert sorted(won[0] + won[1]) == sorted(nonce.hex() for nonce in shared), "a nonce was admitted by neither"


def test_a_thousand_double_spends_through_another_handle_are_all_refused(store_url: str, tmp_path: Path) -> None:
    first, second = open_spent_tokens(store_url), open_spent_tokens(store_url)
    batch = nonces(ATTEMPTS)
    assert all(first.spend(KEY_ID, nonce, in_an_hour()) for nonce in batch)
    assert not any(second.spend(KEY_ID, nonce, in_an_hour()) for nonce in batch)
    # And from another process: a replica of its own records no win.
    record = tmp_path / "replica.txt"
    (replica,) = run_replicas(store_url, [(batch, record, 0.0)])
    replica.join(HANG_S)
    assert replica.exitcode == 0 and recorded(record) == []
    first.close()
    second.close()


def test_a_replica_killed_mid_run_loses_and_doubles_nothing(store_url: str, tmp_path: Path) -> None:
    shared = nonces(ATTEMPTS)
    # After the shared nonces, the victim spends fresh ones of its own for minutes: however late this
    # test gets to kill it on a loaded machine, it is still running, never finished.
    tail = nonces(100 * ATTEMPTS, salt=b"tail")
    survivor_record, victim_record = tmp_path / "survivor.txt", tmp_path / "victim.txt"
    # In opposite orders, so that each wins a share and they race where they meet.
    survivor, victim = run_replicas(store_url, [(shared[::-1], survivor_record, 0.001),
                                                (shared + tail, victim_record, 0.001)])
    deadline = time.monotonic() + HANG_S
    while len(recorded(victim_record)) < 100 and victim.is_alive() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert victim.is_alive() and len(recorded(victim_record)) >= 100, "the victim never got going"
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(HANG_S)
    survivor.join(HANG_S)
    assert victim.exitcode == -signal.SIGKILL
    assert survivor.exitcode == 0
    wanted = {nonce.hex() for nonce in shared}
    survivor_won, victim_won = recorded(survivor_record), [n for n in recorded(victim_record) if n in wanted]
    assert not set(survivor_won) & set(victim_won), "a nonce was admitted by both replicas"
    # The victim may have died between spending a nonce and recording it: that one is spent, unrecorded.
    assert len(survivor_won) + len(victim_won) in (ATTEMPTS - 1, ATTEMPTS)
    store = open_spent_tokens(store_url)
    assert not any(store.spend(KEY_ID, nonce, in_an_hour()) for nonce in shared), "a spent nonce was lost"
    store.close()


def test_an_expired_token_is_never_spendable(store_url: str) -> None:
    store = open_spent_tokens(store_url)
    assert store.spend(KEY_ID, os.urandom(32), time.time() - 1) is False
    store.close()


def test_pairs_must_have_bounded_sizes(store_url: str) -> None:
    store = open_spent_tokens(store_url)
    for key_id, nonce in ((b"", b"n"), (KEY_ID, b""), (bytes(33), b"n"), (KEY_ID, bytes(65))):
        with pytest.raises(ValueError):
            store.spend(key_id, nonce, in_an_hour())
    store.close()


def test_the_sqlite_file_holds_only_key_ids_nonces_and_hour_rounded_expiries(tmp_path: Path) -> None:
    path = tmp_path / "spent.db"
    store = SqliteSpentTokens(path)
    expires_at = time.time() + 1234.5
    for nonce in nonces(20):
        store.spend(KEY_ID, nonce, expires_at)
    store.close()
    db = sqlite3.connect(path)
    assert [row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")] == ["spent"]
    assert [row[1] for row in db.execute("PRAGMA table_info(spent)")] == ["key_id", "nonce", "expires_at"]
    assert {row[0] for row in db.execute("SELECT expires_at FROM spent")} == {stored_expiry(expires_at)}
    assert stored_expiry(expires_at) % EXPIRY_GRANULARITY_S == 0 and stored_expiry(expires_at) >= expires_at
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert path.stat().st_mode & 0o077 == 0, "the file is readable by others"
    db.close()


def test_sqlite_forgets_expired_entries_in_bounded_batches(tmp_path: Path) -> None:
    store = SqliteSpentTokens(tmp_path / "spent.db", purge_batch=10)
    soon, later = time.time() + 60, time.time() + 10 * 24 * 3600
    for nonce in nonces(25, b"soon"):
        store.spend(KEY_ID, nonce, soon)
    kept = nonces(5, b"late")
    for nonce in kept:
        store.spend(KEY_ID, nonce, later)
    after_soon = stored_expiry(soon) + 1
    assert [store.purge_expired(after_soon) for _ in range(4)] == [10, 10, 5, 0]
    assert not any(store.spend(KEY_ID, nonce, later) for nonce in kept), "an unexpired entry was forgotten"
    store.close()


def test_sqlite_purges_a_batch_every_so_many_spends(tmp_path: Path) -> None:
    store = SqliteSpentTokens(tmp_path / "spent.db", purge_every=5, purge_batch=100)
    store.spend(KEY_ID, b"old", time.time() + 60)
    store._db.execute("UPDATE spent SET expires_at = 0")  # as if its hour had passed
    for nonce in nonces(4):
        store.spend(KEY_ID, nonce, in_an_hour())
    assert store._db.execute("SELECT count(*) FROM spent").fetchone()[0] == 4
    store.close()


def test_redis_keys_are_namespaced_and_expire_at_the_rounded_expiry(redis_server: RedisServer) -> None:
    redis_server.client().flushdb()
    store = RedisSpentTokens(redis_server.url)
    nonce, expires_at = os.urandom(32), time.time() + 4000
    assert store.spend(KEY_ID, nonce, expires_at)
    client = redis_server.client()
    assert [key.decode() for key in client.keys("*")] == [f"veil:spent:{KEY_ID.hex()}:{nonce.hex()}"]
    # PTTL, not EXPIRETIME (Redis 7 only): the key expires at the server's clock plus PTTL, and the server
    # read its clock between `before` and `after`, so the expiry lies in that window, however slow the machine.
    before = time.time()
    remaining_s = client.pttl(store.key(KEY_ID, nonce)) / 1000
    after = time.time()
    assert before + remaining_s - 0.002 <= stored_expiry(expires_at) <= after + remaining_s + 0.002
    store.close()


def test_an_unreachable_redis_refuses_the_token_instead_of_admitting_it() -> None:
    pytest.importorskip("redis", reason="the redis package is not installed (pip install 'veil[redis]')")
    import socket

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    store = open_spent_tokens(f"redis://127.0.0.1:{port}/0")
    with pytest.raises(SpentTokensError) as raised:
        store.spend(KEY_ID, os.urandom(32), in_an_hour())
    assert raised.value.status == 503 and str(port) not in raised.value.message
    store.close()


@pytest.mark.parametrize("url", ["", "sqlite:", "postgres://db/1", "memory:", "/tmp/spent.db"])
def test_store_urls_other_than_sqlite_and_redis_are_refused_with_the_accepted_forms(url: str) -> None:
    with pytest.raises(GatewaySettingsError) as raised:
        open_spent_tokens(url)
    assert "sqlite:PATH" in raised.value.message


def test_an_unwritable_sqlite_path_is_a_settings_error(tmp_path: Path) -> None:
    with pytest.raises(GatewaySettingsError) as raised:
        open_spent_tokens(f"sqlite:{tmp_path / 'missing-folder' / 'spent.db'}")
    assert "writable path" in raised.value.message


@pytest.mark.parametrize("persistence, named", [
    (["--appendonly", "yes", "--appendfsync", "everysec"], "appendfsync"),
    (["--appendonly", "no", "--appendfsync", "always"], "appendonly"),
    (["--appendonly", "yes", "--appendfsync", "always", "--no-appendfsync-on-rewrite", "yes"],
     "no-appendfsync-on-rewrite"),
])
def test_a_redis_that_can_lose_an_acknowledged_spend_is_refused_at_start(persistence: list[str], named: str,
                                                                         tmp_path: Path) -> None:
    server = RedisServer(tmp_path, persistence=[*persistence, "--save", ""])
    try:
        with pytest.raises(GatewaySettingsError) as refused:
            open_spent_tokens(server.url)
        assert f"({named})" in refused.value.message and "appendfsync always" in refused.value.message
    finally:
        server.stop()


def test_a_redis_whose_settings_cannot_be_read_is_used_with_a_clear_warning(tmp_path: Path,
                                                                            capsys: pytest.CaptureFixture) -> None:
    server = RedisServer(tmp_path, persistence=["--appendonly", "no", "--save", "", "--rename-command", "CONFIG", ""])
    try:
        store = open_spent_tokens(server.url)
        assert "cannot read the Redis spent-token store's settings" in capsys.readouterr().err
        assert store.spend(KEY_ID, os.urandom(32), in_an_hour())
        store.close()
    finally:
        server.stop()


def test_the_shipped_redis_keeps_every_acknowledged_spend_across_a_crash(tmp_path: Path) -> None:
    server = RedisServer(tmp_path)  # persisting as deploy/k8s/base/redis.yaml does
    try:
        assert server.client().config_get("appendfsync") == {"appendfsync": "always"}
        store = open_spent_tokens(server.url)
        acknowledged: list[bytes] = []

        def spend_until_the_crash() -> None:
            for nonce in nonces(100 * ATTEMPTS):
                try:
                    if store.spend(KEY_ID, nonce, in_an_hour()):
                        acknowledged.append(nonce)
                except SpentTokensError:
                    return

        spender = threading.Thread(target=spend_until_the_crash)
        spender.start()
        deadline = time.monotonic() + HANG_S
        while len(acknowledged) < 300 and spender.is_alive() and time.monotonic() < deadline:
            time.sleep(0.005)
        assert spender.is_alive() and len(acknowledged) >= 300, "the spender never got going"
        server.crash()  # while spends are in flight
        spender.join(HANG_S)
        server.restart()
        again = open_spent_tokens(server.url)
        forgotten = [nonce for nonce in acknowledged if again.spend(KEY_ID, nonce, in_an_hour())]
        assert forgotten == [], f"{len(forgotten)} acknowledged spends were forgotten in the crash"
        store.close()
        again.close()
    finally:
        server.stop()
