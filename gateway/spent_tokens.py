"""Spent Privacy Pass tokens: each (token key id, nonce) pair is spent exactly once, across every replica.

A token (RFC 9578) is accepted only if `spend` says this is the first time its
pair is seen; the check and the record are one atomic operation in the store,
so two gateway processes (or two replicas) racing on one token admit it once.

What a store holds is the least that makes double spending detectable: the
key id, the nonce and when the entry may be forgotten. It never holds when a
token was spent. A spend time is a timestamp of one request, kept as long as
the token's key is valid; set beside any record of traffic (a relay's
connection log, a route event's latency bucket), it would let whoever reads
the store tie a token, and through it a request, to a moment. So the expiry
kept is the token key's expiry rounded up to a whole hour (`EXPIRY_GRANULARITY_S`),
which is the same for every token of a key and says nothing about when each
was spent, and SQLite keeps its rows in (key id, nonce) order, not in the
order they were spent. Entries live a little past their token's expiry;
tokens are refused once expired anyway.

Two stores: SQLite in WAL mode, the embedded default, shared by every gateway
process on one host through one file; and Redis, shared by gateways on many
hosts (the `redis` package, imported only when a Redis store is opened: install
the `redis` extra). `open_spent_tokens(url)` opens either by URL.

A store must not acknowledge a spend it can lose: a spend forgotten in a crash lets its
token be spent again. SQLite syncs each spend to disk before answering; Redis does so only
with `appendonly yes`, `appendfsync always` and `no-appendfsync-on-rewrite no` (its default
`everysec` acknowledges writes it may not have written yet), so a Redis store reads those
settings with CONFIG GET when it opens and refuses a Redis that could lose a spend.
"""

from __future__ import annotations

import math
import os
import sqlite3
import sys
import threading
import time
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

from gateway.errors import GatewaySettingsError, SpentTokensError

# Stored expiries are rounded up to this, so that they cannot encode when a token was spent.
EXPIRY_GRANULARITY_S = 3600
MAX_KEY_ID_BYTES = 32
MAX_NONCE_BYTES = 64
REDIS_NAMESPACE = "veil:spent"

# The Redis settings under which an acknowledged SET is on disk (fsynced) before its reply is sent.
DURABLE_REDIS = {"appendonly": "yes", "appendfsync": "always", "no-appendfsync-on-rewrite": "no"}
_DURABLE_FORM = " ".join(f"{name} {value}" for name, value in DURABLE_REDIS.items())

_UNREACHABLE = "the spent-token store cannot be reached; the token is not accepted, retry later"
_URL_FORMS = "a spent-token store is sqlite:PATH or redis://HOST:PORT/DB (rediss:// for TLS)"


class SpentTokens(Protocol):
    """Where spent tokens are recorded; one instance per process, safe to share between threads."""

    def spend(self, key_id: bytes, nonce: bytes, expires_at: float) -> bool:
        """True exactly the first time the unexpired pair (key_id, nonce) is spent, in any process or replica.

        An expired pair is never spendable (False). Raises SpentTokensError when the store cannot be
        reached: the caller then refuses the token, it never admits one it could not record.
        """
        ...

    def give_back(self, key_id: bytes, nonce: bytes) -> None:
        """Forget a spend of the pair: only the gateway that spent it calls this, for a request no node took.

        Raises SpentTokensError when the store cannot be reached: the token then stays spent, never more.
        """
        ...

    def close(self) -> None:
        """Release the store's connections; the instance is unusable afterwards."""
        ...


def open_spent_tokens(url: str) -> SpentTokens:
    """The store named by `url`: `sqlite:PATH` or `redis://HOST:PORT/DB` (`rediss://` for TLS)."""
    if url.startswith("sqlite:"):
        path = url.removeprefix("sqlite:").removeprefix("//")
        if not path:
            raise GatewaySettingsError(f"the SQLite store needs a file path; {_URL_FORMS}")
        return SqliteSpentTokens(Path(path))
    if urlsplit(url).scheme in ("redis", "rediss"):
        return RedisSpentTokens(url)
    raise GatewaySettingsError(_URL_FORMS)


def stored_expiry(expires_at: float) -> int:
    """`expires_at` rounded up to the next whole `EXPIRY_GRANULARITY_S` (epoch seconds)."""
    return math.ceil(expires_at / EXPIRY_GRANULARITY_S) * EXPIRY_GRANULARITY_S


def _check_pair(key_id: bytes, nonce: bytes) -> None:
    if not 0 < len(key_id) <= MAX_KEY_ID_BYTES or not 0 < len(nonce) <= MAX_NONCE_BYTES:
        raise ValueError(f"a token key id is 1 to {MAX_KEY_ID_BYTES} bytes and a nonce 1 to {MAX_NONCE_BYTES}")


_SCHEMA = (
    # WITHOUT ROWID: rows are stored in (key_id, nonce) order, so the file does not keep the order of spending.
    "CREATE TABLE IF NOT EXISTS spent (key_id BLOB NOT NULL, nonce BLOB NOT NULL, expires_at INTEGER NOT NULL, "
    "PRIMARY KEY (key_id, nonce)) WITHOUT ROWID",
    "CREATE INDEX IF NOT EXISTS spent_by_expiry ON spent (expires_at)",
)
_SPEND = "INSERT OR IGNORE INTO spent (key_id, nonce, expires_at) VALUES (?, ?, ?)"
_GIVE_BACK = "DELETE FROM spent WHERE key_id = ? AND nonce = ?"
_PURGE = ("DELETE FROM spent WHERE (key_id, nonce) IN "
          "(SELECT key_id, nonce FROM spent WHERE expires_at <= ? LIMIT ?)")


class SqliteSpentTokens:
    """Spent tokens in one SQLite file in WAL mode, shared by every gateway process on the host.

    Each spend is one `INSERT OR IGNORE`: it inserted a row (SQLite's `changes()`, which `rowcount`
    reports) exactly when the pair was new, and SQLite's write lock makes that atomic across
    processes. Writers wait up to `busy_timeout_s` for the lock. Every `purge_every` spends, one
    batch of at most `purge_batch` expired rows is deleted, so no transaction holds the lock long.
    """

    def __init__(self, path: Path, *, busy_timeout_s: float = 5.0, purge_every: int = 256,
                 purge_batch: int = 1000) -> None:
        self.path = path
        self.purge_every = purge_every
        self.purge_batch = purge_batch
        self._lock = threading.Lock()
        self._spends_since_purge = 0
        self._db = self._connect(path, busy_timeout_s)

    @staticmethod
    def _connect(path: Path, busy_timeout_s: float) -> sqlite3.Connection:
        try:
            # Created owner-only: nonces are not secrets, but nobody else has any reason to read them.
            os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
            db = sqlite3.connect(path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False)
            db.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
            _set_up(db, time.monotonic() + busy_timeout_s)
        except (OSError, sqlite3.Error) as error:
            raise GatewaySettingsError(f"cannot open the spent-token file ({type(error).__name__}); "
                                       "give a writable path to sqlite:PATH") from None
        return db

    def spend(self, key_id: bytes, nonce: bytes, expires_at: float) -> bool:
        _check_pair(key_id, nonce)
        now = time.time()
        if expires_at <= now:
            return False
        with self._lock:
            try:
                first = self._db.execute(_SPEND, (key_id, nonce, stored_expiry(expires_at))).rowcount == 1
            except sqlite3.Error:
                raise SpentTokensError(_UNREACHABLE) from None
            self._spends_since_purge += 1
            if self._spends_since_purge >= self.purge_every:
                self._spends_since_purge = 0
                self._purge_batch(now)
        return first

    def give_back(self, key_id: bytes, nonce: bytes) -> None:
        _check_pair(key_id, nonce)
        with self._lock:
            try:
                self._db.execute(_GIVE_BACK, (key_id, nonce))
            except sqlite3.Error:
                raise SpentTokensError(_UNREACHABLE) from None

    def purge_expired(self, now: float | None = None) -> int:
        """Delete one batch (at most `purge_batch`) of entries expired by `now`; the number deleted."""
        with self._lock:
            return self._purge_batch(time.time() if now is None else now)

    def _purge_batch(self, now: float) -> int:
        try:
            return self._db.execute(_PURGE, (now, self.purge_batch)).rowcount
        except sqlite3.OperationalError:
            return 0  # the lock is busy; expired rows wait for the next batch, spending goes on

    def close(self) -> None:
        with self._lock:
            self._db.close()


class RedisSpentTokens:
    """Spent tokens in Redis, shared by gateways on many hosts: one `SET key 1 NX EXAT expiry` per spend.

    `NX` makes the first spend the only one that sets the key; `EXAT` lets Redis forget it at the
    (rounded) expiry. Keys are `veil:spent:<key id hex>:<nonce hex>`, so one Redis can serve others.
    Opening one checks that Redis syncs every write before acknowledging it (`DURABLE_REDIS`).
    """

    def __init__(self, url: str, *, namespace: str = REDIS_NAMESPACE, timeout_s: float = 2.0) -> None:
        try:
            import redis
        except ModuleNotFoundError:
            raise GatewaySettingsError("a Redis spent-token store needs the redis package: "
                                       "pip install 'veil[redis]'") from None
        self.namespace = namespace
        self._connection_error: tuple[type[Exception], ...] = (redis.RedisError, OSError)
        try:
            self._redis: Any = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        except ValueError:
            raise GatewaySettingsError(_URL_FORMS) from None
        self._check_durability()

    def _check_durability(self) -> None:
        """Refuse a Redis that may lose an acknowledged spend; warn where its settings cannot be read."""
        try:
            settings = {name: str(self._redis.config_get(name).get(name, "")) for name in DURABLE_REDIS}
        except self._connection_error:
            # Unreachable for now, or CONFIG renamed away (managed Redis services often do).
            print("veil gateway: cannot read the Redis spent-token store's settings (CONFIG GET); make sure it "
                  f"runs with {_DURABLE_FORM}, or a crash can forget spent tokens", file=sys.stderr)
            return
        wrong = [name for name, value in DURABLE_REDIS.items() if settings[name].lower() != value]
        if wrong:
            raise GatewaySettingsError(
                f"the Redis spent-token store can lose acknowledged spends ({', '.join(wrong)}), and a lost spend "
                f"lets its token be spent again: run Redis with {_DURABLE_FORM}")

    def key(self, key_id: bytes, nonce: bytes) -> str:
        return f"{self.namespace}:{key_id.hex()}:{nonce.hex()}"

    def spend(self, key_id: bytes, nonce: bytes, expires_at: float) -> bool:
        _check_pair(key_id, nonce)
        if expires_at <= time.time():
            return False
        try:
            return bool(self._redis.set(self.key(key_id, nonce), b"1", nx=True, exat=stored_expiry(expires_at)))
        except self._connection_error:
            raise SpentTokensError(_UNREACHABLE) from None

    def give_back(self, key_id: bytes, nonce: bytes) -> None:
        _check_pair(key_id, nonce)
        try:
            self._redis.delete(self.key(key_id, nonce))
        except self._connection_error:
            raise SpentTokensError(_UNREACHABLE) from None

    def close(self) -> None:
        self._redis.close()


def _set_up(db: sqlite3.Connection, deadline: float) -> None:
    """WAL mode, durability and the table, retried until `deadline` while another process sets them up.

    Switching a new file to WAL takes a lock for which SQLite does not call its busy handler, so two
    replicas opening the same new file at once can see "database is locked" without any wait.
    """
    while True:
        try:
            db.execute("PRAGMA journal_mode = WAL")
            # A spend must survive a power loss, or a token spent just before it could be spent again.
            db.execute("PRAGMA synchronous = FULL")
            # Deleted (expired) rows are overwritten, not left readable in free pages.
            db.execute("PRAGMA secure_delete = ON")
            for statement in _SCHEMA:
                db.execute(statement)
            return
        except sqlite3.OperationalError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.02)
