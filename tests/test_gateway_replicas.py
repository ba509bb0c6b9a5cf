"""Two `veil gateway` processes sharing one spent-token store: every token succeeds once, even across a SIGKILL.

Both replicas run as `veil gateway` runs them, in front of one recording gRPC node, with one store
(an SQLite file; a real redis-server on loopback where it can start). Each of 1,000 tokens is
presented to both replicas at once; one replica is killed with SIGKILL partway through. Every token
then has exactly one success, or was in flight to the killed replica when it died (spent there,
its answer lost), and the store holds every token once.

Tokens are signed with the issuer's private key directly (RSASSA-PSS, what blind issuance yields),
without the issuance round trips, to keep 1,000 of them cheap.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding

from ohttp.privacypass import IssuerKey, Token, TokenChallenge, encode_authorization
from ohttp.privacypass.issuance import VARIANT
from tests.spent_tokens_support import RedisServer
from tests.test_audit_events import refusals
from tests.test_gateway_support import GrpcNode, RecordingNode, candidate, sim_root  # noqa: F401
from tests.token_support import ISSUER_NAME, make_keys, node_evidence, policy_listing, write_directory
from tests.conftest import HANG_S

pytestmark = pytest.mark.slow
ORIGIN = "gateway.veil.test"
CHALLENGE = TokenChallenge(issuer_name=ISSUER_NAME, origin_info=(ORIGIN,))
TOKENS = 1000
IN_FLIGHT = 16  # tokens presented at once (each to both replicas)
KILL_AFTER = 400  # tokens answered before the second replica is killed
REPO = Path(__file__).resolve().parent.parent


def mint(key: IssuerKey) -> str:
    """An Authorization value carrying a fresh token under `key`, bound to this gateway's challenge."""
    unsigned = Token(nonce=os.urandom(32), challenge_digest=CHALLENGE.digest(), token_key_id=key.token_key.key_id,
                     authenticator=b"")
    pss = padding.PSS(mgf=padding.MGF1(hashes.SHA384()), salt_length=VARIANT.salt_length)
    signature = key.private_key.sign(unsigned.token_input(), pss, hashes.SHA384())
    return encode_authorization(Token(unsigned.nonce, unsigned.challenge_digest, unsigned.token_key_id, signature))


class GatewayProcess:
    """One `veil gateway` replica: `python -m veil gateway ...`, its port file, audit file and stderr."""

    def __init__(self, folder: Path, node_address: str, policy: Path, directory: Path, store_url: str) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.audit_path = folder / "audit.jsonl"
        port_file = folder / "port"
        command = [sys.executable, "-m", "veil", "gateway", "--listen", "127.0.0.1:0", "--port-file", str(port_file),
                   "--node", node_address, "--policy", str(policy), "--origin", ORIGIN,
                   "--issuer-directory", str(directory), "--spent-tokens", store_url,
                   "--audit", f"file:{self.audit_path}",
                   # Idle keep-alive connections stay open for the whole run: a server closing one just as the
                   # client reuses it would read as a lost answer, which this test counts only for the killed one.
                   "--keep-alive-s", "600", "--header-timeout-s", "600"]
        self._stderr = open(folder / "stderr", "wb")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(command, cwd=REPO, stdin=subprocess.DEVNULL, stdout=self._stderr,
                                      stderr=self._stderr)
        self.url = f"http://127.0.0.1:{self._wait_for_port(port_file)}"
        self._wait_for_node()

    def _wait_for_port(self, port_file: Path) -> int:
        deadline = time.monotonic() + HANG_S
        while not (port_file.is_file() and port_file.read_text().strip()):
            if self.popen.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"the gateway did not start; see {self._stderr.name}")
            time.sleep(0.05)
        return int(port_file.read_text())

    def _wait_for_node(self) -> None:
        deadline = time.monotonic() + HANG_S
        while httpx.get(f"{self.url}/v1/health", trust_env=False).json()["nodes"] != 1:
            assert time.monotonic() < deadline, "the gateway did not admit the node in time"
            time.sleep(0.05)

    def kill(self) -> None:
        self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(HANG_S)

    def stop(self) -> None:
        """SIGTERM, as an operator stops it: the gateway reports its last tally on the way out."""
        if self.popen.poll() is None:
            self.popen.terminate()
            self.popen.wait(HANG_S)
        self._stderr.close()

    def token_tallies(self) -> list[dict]:
        records = [json.loads(line) for line in self.audit_path.read_text().splitlines()]
        return [record for record in records if record["kind"] == "token_decisions"]


@dataclass(slots=True)
class Outcomes:
    """What each replica answered for each token: an HTTP status, or "lost" when its connection failed."""

    answers: list[dict[str, int | str]] = field(default_factory=lambda: [{} for _ in range(TOKENS)])
    done: int = 0


async def _present(http: httpx.AsyncClient, url: str, node_id: str, authorization: str) -> int | str:
    body = {"candidates": [candidate(node_id, b"x")]}
    try:
        return (await http.post(f"{url}/v1/infer", json=body, headers={"authorization": authorization})).status_code
    except httpx.TransportError:
        return "lost"


async def _double_spend(tokens: list[str], replicas: dict[str, GatewayProcess], node_id: str) -> Outcomes:
    """Present every token to both replicas concurrently; SIGKILL replica "b" once KILL_AFTER are answered."""
    outcomes, slots = Outcomes(), asyncio.Semaphore(IN_FLIGHT)
    limits = httpx.Limits(max_connections=4 * IN_FLIGHT, max_keepalive_connections=4 * IN_FLIGHT)

    async def one(index: int, http: httpx.AsyncClient) -> None:
        async with slots:
            statuses = await asyncio.gather(*(_present(http, replica.url, node_id, tokens[index])
                                              for replica in replicas.values()))
            outcomes.answers[index] = dict(zip(replicas, statuses, strict=True))
            outcomes.done += 1
            if outcomes.done == KILL_AFTER:
                replicas["b"].kill()  # mid-run: other tokens are in flight to it right now

    # No answer is late on a loaded machine: only a dead replica's connections fail.
    async with httpx.AsyncClient(timeout=600.0, trust_env=False, limits=limits) as http:
        await asyncio.gather(*(one(index, http) for index in range(TOKENS)))
    return outcomes


@pytest.fixture(scope="module")
def fleet_parts(sim_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:  # noqa: F811
    folder = tmp_path_factory.mktemp("replicas")
    key = make_keys(folder / "issuer-keys", 1)[0]
    policy = policy_listing(folder / "policy.toml", [key])
    directory = write_directory(folder / "directory.json", [key])
    node = GrpcNode(RecordingNode(node_evidence(policy)))
    yield key, policy, directory, node
    node.stop()


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


def _stored_spends(kind: str, url: str) -> int:
    if kind == "sqlite":
        import sqlite3

        with sqlite3.connect(url.removeprefix("sqlite:")) as db:
            return db.execute("SELECT count(*) FROM spent").fetchone()[0]
    import redis

    return sum(1 for _ in redis.Redis.from_url(url).scan_iter("veil:spent:*"))


@pytest.mark.parametrize("kind", ["sqlite", "redis"])
def test_two_replicas_spend_each_token_once_through_a_sigkill(kind: str, fleet_parts, request: pytest.FixtureRequest,
                                                               tmp_path: Path) -> None:
    key, policy, directory, node = fleet_parts
    store_url = f"sqlite:{tmp_path / 'spent.sqlite'}" if kind == "sqlite" else request.getfixturevalue(
        "redis_server").url
    tokens = [mint(key) for _ in range(TOKENS)]
    received_before = len(node.servicer.received)
    replicas = {name: GatewayProcess(tmp_path / name, node.address, policy, directory, store_url) for name in "ab"}
    try:
        outcomes = asyncio.run(_double_spend(tokens, replicas, node.node_id))
    finally:
        for replica in replicas.values():
            replica.stop()

    successes = {name: [i for i, answer in enumerate(outcomes.answers) if answer[name] == 200] for name in "ab"}
    assert not set(successes["a"]) & set(successes["b"])  # no token succeeds twice
    assert set(successes["a"]) | set(successes["b"])  # both replicas took part before the kill
    assert successes["b"] and all(index < KILL_AFTER + IN_FLIGHT for index in successes["b"])
    for answer in outcomes.answers:
        assert answer["a"] in (200, 401)  # the survivor answered every token: admitted, or spent already
        assert answer["b"] in (200, 401, "lost")
        assert (answer["a"], answer["b"]) != (401, 401)  # refused on both: the token was lost
    # In flight at the kill: spent by the killed replica, which died before answering; the survivor saw it spent.
    in_flight = [i for i, answer in enumerate(outcomes.answers) if (answer["a"], answer["b"]) == (401, "lost")]
    assert len(in_flight) <= IN_FLIGHT
    assert len(successes["a"]) + len(successes["b"]) + len(in_flight) == TOKENS
    assert _stored_spends(kind, store_url) == TOKENS  # every token recorded once, by whichever replica won
    forwarded = len(node.servicer.received) - received_before
    assert len(successes["a"]) + len(successes["b"]) <= forwarded <= TOKENS

    # The survivor's audit tally agrees with what it answered; the killed replica's counts died with it.
    survivor = [tally for tally in replicas["a"].token_tallies() if tally["key_id"] == key.token_key.key_id.hex()]
    assert sum(tally["accepted"] for tally in survivor) == len(successes["a"])
    assert sum(tally["refused"]["spent"] for tally in survivor) == TOKENS - len(successes["a"])
    assert all(tally["refused"] == refusals(spent=tally["refused"]["spent"]) for tally in survivor)
