"""A directory cannot list one node many times: adversarial directories against the real SDK.

A gateway stand-in on a real HTTP server lists real simulated evidence and records the candidates
of every request the SDK posts. The non-targetability bound (SECURITY.md section 8) is that a node
of capacity C is a candidate of K·C/ΣC of requests. A gateway that lists one node several times,
under one node id or under several keys of one chip, must not raise that share.
"""

from __future__ import annotations

import base64
import json
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from fastapi import FastAPI, Request, Response

from attestation.backends.sim import SimBackend
from attestation.measurement import Measurement
from attestation.sim_root import ROOT_DIR_ENV
from attestation.verifier import node_id_for
from client.directory import REPEATED_NODE, DirectoryEntry, repeated_listing, sample_candidates
from client.errors import GatewayError, NoVerifiedNodeError
from client.sdk import Client
from client.verify import CandidateVerifier, one_per_chip
from ohttp import generate_key_pair
from policy import shipped_policy
from tests.http_stand_in import served
from tests.test_attestation_support import RECEIPT_KEY

K = 3
DRAWS = 1500


@dataclass
class SimNode:
    """A simulated node: its chip (backend), key configuration and measurement."""

    backend: SimBackend
    config: bytes = field(default_factory=lambda: generate_key_pair(1).config.encode())
    measurement: Measurement = field(default_factory=lambda: Measurement(
        secrets.token_bytes(32), shipped_policy("dev").digest, secrets.token_bytes(32)))

    @property
    def node_id(self) -> str:
        return node_id_for(self.config, self.measurement)

    def evidence(self, nonce: bytes | None = None) -> str:
        return self.backend.collect(self.config, self.measurement, nonce or secrets.token_bytes(32),
                                   RECEIPT_KEY).to_json()

    def listing(self, capacity: int) -> dict:
        return {"node_id": self.node_id, "key_config": base64.b64encode(self.config).decode(),
                "evidence": self.evidence(), "capacity": capacity, "attestation_result": ""}


@dataclass
class StandIn:
    """A gateway stand-in: a directory of its choosing, fresh evidence on demand, and what reached /v1/infer."""

    directory: dict = field(default_factory=dict)
    fresh: dict[str, SimNode] = field(default_factory=dict)
    candidates: list[list[str]] = field(default_factory=list)
    url: str = ""


def _app(stand_in: StandIn) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/nodes")
    def nodes() -> dict:
        return stand_in.directory

    @app.post("/v1/nodes/{node_id}/attest")
    async def attest(node_id: str, request: Request) -> dict:
        nonce = bytes.fromhex((await request.json())["nonce"])
        return {"evidence": stand_in.fresh[node_id].evidence(nonce)}

    @app.post("/v1/infer")
    async def infer(request: Request) -> Response:
        stand_in.candidates.append([c["node_id"] for c in json.loads(await request.body())["candidates"]])
        return Response('{"error": {"code": "overloaded", "message": "busy"}}', status_code=503,
                        media_type="application/json", headers={"retry-after": "1"})

    return app


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandIn]:
    state = StandIn()
    with pytest.MonkeyPatch.context() as patch, served(_app(state)) as url:
        patch.setenv(ROOT_DIR_ENV, str(tmp_path_factory.mktemp("one-chip")))
        state.url = url
        yield state


@dataclass(frozen=True)
class Outcome:
    """What `DRAWS` requests through one directory did."""

    attacker_rate: float  # share of requests with an attacker listing among their candidates
    sealed_twice: int  # requests sealed to more than one listing of the attacker's chip
    refusals: set[str]  # the gateway error codes the SDK raised before sending anything


def _run(stand_in: StandIn, listings: list[dict], attacker_ids: set[str], draws: int = DRAWS) -> Outcome:
    stand_in.directory = {"version": 1, "nodes": listings, "policy_digest": ""}
    start, hits, twice, refusals = len(stand_in.candidates), 0, 0, set()
    with Client(stand_in.url, policy="dev", candidates=K, max_retries=0, directory_ttl_s=3600) as client:
        for _ in range(draws):
            try:
                client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}])
            except GatewayError as error:
                refusals.add(error.code)
                if error.code == REPEATED_NODE:
                    break  # a refusal depends on the directory alone: every later request is refused too
    for candidates in stand_in.candidates[start:]:
        mine = [node_id for node_id in candidates if node_id in attacker_ids]
        hits += bool(mine)
        twice += len(mine) > 1
    return Outcome(hits / draws, twice, refusals)


def _tolerance(p: float, draws: int = DRAWS) -> float:
    # five standard deviations of a binomial share: exceeded only if the inclusion probability is wrong
    return 5 * (p * (1 - p) / draws) ** 0.5


@pytest.fixture(scope="module")
def forty_of_eight(stand_in: StandIn) -> list[dict]:
    return [SimNode(SimBackend()).listing(8) for _ in range(40)]


@pytest.fixture(scope="module")
def ninety_nine_of_sixty_four(stand_in: StandIn) -> list[dict]:
    return [SimNode(SimBackend()).listing(64) for _ in range(99)]


def test_listed_once_a_node_is_a_candidate_in_its_capacity_share(stand_in, forty_of_eight) -> None:
    attacker = SimNode(SimBackend())
    outcome = _run(stand_in, [*forty_of_eight, attacker.listing(64)], {attacker.node_id})
    bound = K * 64 / (40 * 8 + 64)  # 0.5
    assert abs(outcome.attacker_rate - bound) < _tolerance(bound)
    assert outcome.refusals == {"overloaded"} and outcome.sealed_twice == 0


@pytest.mark.parametrize("ids", ["one id", "many keys"])
def test_a_node_listed_six_times_is_refused_not_drawn_six_times(stand_in, forty_of_eight, ids: str) -> None:
    chip = SimBackend()
    first = SimNode(chip)
    listings = [first.listing(64)] * 6 if ids == "one id" else [SimNode(chip).listing(64) for _ in range(6)]
    outcome = _run(stand_in, [*forty_of_eight, *listings], {listing["node_id"] for listing in listings})
    bound = K * 64 / (40 * 8 + 64)  # its share listed once: 0.5 (six listings drew it into 0.92)
    assert outcome.attacker_rate <= bound + _tolerance(bound)
    assert outcome.sealed_twice == 0 and outcome.refusals == {REPEATED_NODE}


def test_one_node_of_a_hundred_listed_fifty_times_gets_no_more_than_its_three_percent(
        stand_in, ninety_nine_of_sixty_four) -> None:
    chip = SimBackend()
    listings = [SimNode(chip).listing(64) for _ in range(50)]
    outcome = _run(stand_in, [*ninety_nine_of_sixty_four, *listings], {listing["node_id"] for listing in listings})
    bound = K * 64 / (100 * 64)  # 0.03 (fifty listings drew it into 0.72)
    assert outcome.attacker_rate <= bound + _tolerance(bound)
    assert outcome.sealed_twice == 0 and outcome.refusals == {REPEATED_NODE}
    honest = _run(stand_in, [*ninety_nine_of_sixty_four, listings[0]], {listings[0]["node_id"]})
    assert abs(honest.attacker_rate - bound) < _tolerance(bound)


def test_the_refusal_names_the_problem_and_nothing_is_sent(stand_in, forty_of_eight) -> None:
    chip = SimBackend()
    listings = [SimNode(chip).listing(8) for _ in range(2)]
    stand_in.directory = {"version": 1, "nodes": [*forty_of_eight[:3], *listings], "policy_digest": ""}
    before = len(stand_in.candidates)
    with Client(stand_in.url, policy="dev") as client, pytest.raises(GatewayError) as caught:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "secret question"}])
    assert caught.value.code == REPEATED_NODE and "one chip" in str(caught.value)
    assert "nothing was sent" in str(caught.value) and "secret question" not in str(caught.value)
    assert not any(listing["node_id"][:12] in str(caught.value) for listing in listings)
    assert len(stand_in.candidates) == before


def test_fresh_evidence_must_come_from_the_chip_the_directory_names(stand_in) -> None:
    # With fresh evidence the listed evidence is only read, not verified: the node must then attest
    # from the chip that evidence names, or a directory could name chips the node is not.
    listed = SimNode(SimBackend())
    elsewhere = SimNode(SimBackend(), listed.config, listed.measurement)  # same key, another chip
    stand_in.directory = {"version": 1, "nodes": [listed.listing(8)], "policy_digest": ""}
    stand_in.fresh = {listed.node_id: elsewhere}
    before = len(stand_in.candidates)
    with Client(stand_in.url, policy="dev", fresh_evidence=True) as client, pytest.raises(NoVerifiedNodeError) as caught:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}])
    [failure] = caught.value.failures
    assert failure.check == "directory" and "another chip" in failure.reason
    assert len(stand_in.candidates) == before
    stand_in.fresh = {listed.node_id: listed}  # from the chip listed, the same request is sent
    with Client(stand_in.url, policy="dev", fresh_evidence=True, max_retries=0) as client, \
            pytest.raises(GatewayError, match="overloaded"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}])
    assert stand_in.candidates[before:] == [[listed.node_id]]


def test_sampling_refuses_a_repeated_node_id() -> None:
    entry = DirectoryEntry("node-0", b"cfg", "{}", 8)
    with pytest.raises(ValueError, match="more than once"):
        sample_candidates([entry, DirectoryEntry("node-1", b"cfg", "{}", 8), entry], 1)


def test_only_evidence_naming_one_chip_twice_is_a_repeat(stand_in) -> None:
    chip = SimBackend()
    twins = [SimNode(chip), SimNode(chip)]
    entries = [DirectoryEntry(node.node_id, node.config, node.evidence(), 8) for node in twins]
    assert entries[0].hardware_id == entries[1].hardware_id is not None
    assert "one chip" in repeated_listing(entries)
    # Evidence that names no chip is no repeat: it can never verify, so it is never sealed to.
    unreadable = [DirectoryEntry(f"node-{index}", b"cfg", "{}", 8) for index in range(2)]
    assert repeated_listing([entries[0], *unreadable]) is None


def test_one_request_is_sealed_to_each_chip_at_most_once(stand_in) -> None:
    chip = SimBackend()
    nodes = [SimNode(chip), SimNode(SimBackend()), SimNode(chip)]
    verifier = CandidateVerifier(shipped_policy("dev"))
    records = one_per_chip([verifier.check(DirectoryEntry(n.node_id, n.config, n.evidence(), 8)) for n in nodes])
    assert [record.ok for record in records] == [True, True, False]
    assert records[2].failed_check == "directory" and "same chip" in records[2].failure
