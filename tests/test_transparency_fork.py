"""A log that shows one client two views is forked for that client, whichever view the client saw first.

A colluding operator holds the log's key and its witnesses' keys: it builds a second log of the same size
(the same statements in another order), which witnesses with fresh state cosign, and staples proofs from
it to what chosen clients see. Against a real HTTP stand-in of the gateway listing real simulated
evidence, with both views built by the log's own code and the fleet's policy writer, the SDK must refuse
every node proven from that log once it has seen both views (the view it saw first too, in the same
request and in every later one), send nothing, and say that the log is forked.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from fastapi import FastAPI, Request, Response

from attestation.backends.sim import SimBackend
from attestation.measurement import Measurement
from attestation.sim_root import ROOT_DIR_ENV
from attestation.transparency.statements import NodeKeyStatement, ReleaseStatement, encode_statement
from attestation.verifier import node_id_for
from client.errors import GatewayError, NoVerifiedNodeError
from client.sdk import Client
from transparency.keys import read_signer
from transparency.staple import proof_bundle
from transparency.witness import Witness
from ohttp import generate_key_pair
from policy import load_policy
from tests.http_stand_in import environment, served
from tests.test_attestation_support import RECEIPT_KEY
from tests.transparency_support import witnessed_log
from veil.fleet_transparency import LOG_ORIGIN, make_log_keys, write_transparency_policy

HONEST, FORKED = "honest", "forked"


@dataclass
class StandIn:
    """A gateway stand-in: two simulated nodes, each with its proofs from either view, listed as a test says."""

    nodes: list[dict]
    proofs: dict[str, list[str]]  # view -> each node's stapled proofs (a ProofBundle's JSON)
    policy: str
    listed: list[dict] = field(default_factory=list)
    infer_bodies: list[bytes] = field(default_factory=list)
    url: str = ""

    def show(self, *listing: tuple[int, str]) -> None:
        """List node `index` with its proofs from `view`, for each (index, view) given."""
        self.listed = [{**self.nodes[index], "transparency": self.proofs[view][index]} for index, view in listing]

    def node_id(self, index: int) -> str:
        return self.nodes[index]["node_id"]


def _app(stand_in: StandIn) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/nodes")
    def nodes() -> dict:
        return {"version": 1, "nodes": stand_in.listed, "policy_digest": ""}

    @app.post("/v1/infer")
    async def infer(request: Request) -> Response:  # what was sent is recorded; the answer is a refusal
        stand_in.infer_bodies.append(await request.body())
        return Response('{"error": {"code": "overloaded", "message": "busy"}}', status_code=503,
                        media_type="application/json", headers={"retry-after": "1"})

    return app


def _node(root: Path, measurement: Measurement) -> tuple[dict, bytes]:
    """A simulated node's directory entry and its key statement (valid for an hour)."""
    config = generate_key_pair(1).config.encode()
    evidence = SimBackend(root).collect(config, measurement, secrets.token_bytes(32), RECEIPT_KEY)
    now = int(time.time())
    statement = NodeKeyStatement(hashlib.sha256(config).hexdigest(), measurement.digest().hex(), now - 60,
                                 now + 3600, RECEIPT_KEY.hex())
    entry = {"node_id": node_id_for(config, measurement), "key_config": base64.b64encode(config).decode(),
             "evidence": evidence.to_json(), "capacity": 4, "attestation_result": ""}
    return entry, encode_statement(statement)


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandIn]:
    root = tmp_path_factory.mktemp("fork")
    keys = make_log_keys(root / "keys")
    policy_path = write_transparency_policy(root / "policy.toml", "dev", keys, max_age_s=3600)
    measurement = Measurement(secrets.token_bytes(32), load_policy(policy_path).digest, secrets.token_bytes(32))
    release = encode_statement(ReleaseStatement("1.0", measurement.code_digest.hex(), measurement.policy_digest.hex(),
                                                (measurement.model_digest.hex(),)))
    (first, first_key), (second, second_key) = (_node(root / "sim", measurement) for _ in range(2))
    log = read_signer(keys.log_key)
    cosigners: list = [read_signer(path) for path in keys.witness_keys]

    def view(name: str, entries: list[bytes]) -> list[str]:
        witnesses = [Witness(c, [log.verifier], root / f"{name}-{c.name}.json") for c in cosigners]
        reader = witnessed_log(root / name, log, entries, witnesses)
        return [proof_bundle(reader, 0, entries.index(key)).to_json() for key in (first_key, second_key)]

    proofs = {HONEST: view(HONEST, [release, first_key, second_key]),
              FORKED: view(FORKED, [release, second_key, first_key])}  # one size, another root
    stand = StandIn([first, second], proofs, str(policy_path))
    with served(_app(stand)) as url, environment(ROOT_DIR_ENV, str(root / "sim")):
        stand.url = url
        yield stand


def _client(stand_in: StandIn) -> Client:
    return Client(stand_in.url, policy=stand_in.policy, max_retries=0, directory_ttl_s=0.0)


def _sent_to(stand_in: StandIn, client: Client) -> list[str]:
    """Ask once; the node ids the request was sealed to (it was sent: the stand-in refuses it with 503)."""
    before = len(stand_in.infer_bodies)
    with pytest.raises(GatewayError, match="overloaded"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    (body,) = stand_in.infer_bodies[before:]
    return sorted(candidate["node_id"] for candidate in json.loads(body)["candidates"])


def _refused(stand_in: StandIn, client: Client) -> NoVerifiedNodeError:
    before = len(stand_in.infer_bodies)
    with pytest.raises(NoVerifiedNodeError) as refused:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert stand_in.infer_bodies[before:] == [], "something was sent"
    return refused.value


def _says_the_log_is_forked(error: NoVerifiedNodeError, count: int) -> None:
    assert [failure.check for failure in error.failures] == ["transparency/fork"] * count
    assert all(f"the transparency log {LOG_ORIGIN} is forked" in failure.reason for failure in error.failures)


def test_each_view_alone_passes(stand_in: StandIn) -> None:
    """Neither view is refused on its own: the stapled proofs of each are valid and witnessed."""
    for view in (HONEST, FORKED):
        stand_in.show((0, view), (1, view))
        with _client(stand_in) as client:
            assert _sent_to(stand_in, client) == sorted([stand_in.node_id(0), stand_in.node_id(1)])


def test_a_fork_shown_first_is_caught_once_the_other_view_comes(stand_in: StandIn,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    with _client(stand_in) as client, caplog.at_level(logging.WARNING, logger="veil.client"):
        stand_in.show((0, FORKED))
        assert _sent_to(stand_in, client) == [stand_in.node_id(0)]  # one view only: nothing to tell it by
        stand_in.show((1, HONEST))
        _says_the_log_is_forked(_refused(stand_in, client), 1)
        for listing in (((0, FORKED),), ((1, HONEST),), ((0, FORKED), (1, HONEST))):
            stand_in.show(*listing)  # the view seen first is no better than the other: the log is forked
            _says_the_log_is_forked(_refused(stand_in, client), len(listing))
    said = [record for record in caplog.records if "is forked" in record.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.ERROR and LOG_ORIGIN in said[0].getMessage()


def test_both_views_in_one_directory_send_nothing(stand_in: StandIn) -> None:
    """Whichever candidate is checked first passes alone; the second shows the fork, and neither is sealed to."""
    stand_in.show((0, FORKED), (1, HONEST))
    with _client(stand_in) as client:
        error = _refused(stand_in, client)
    _says_the_log_is_forked(error, 2)
    assert f"the transparency log {LOG_ORIGIN} is forked" in str(error).splitlines()[0]
