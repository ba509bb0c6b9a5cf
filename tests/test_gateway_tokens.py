"""The gateway demanding Privacy Pass tokens, over real HTTP in front of a real gRPC node and SQLite store."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from audit import MemorySink
from gateway.app import create_app
from gateway.audit import GatewayAuditor, TokenTallyReporter
from gateway.auth import ProcessSpentTokens, TokenGate, TokenRequiredError
from gateway.errors import GatewaySettingsError
from ohttp.privacypass import (
    TokenChallenge,
    answer_token_request,
    begin_issuance,
    encode_authorization,
    finish_issuance,
    parse_authorization,
    parse_www_authenticate,
)
from tests.test_audit_events import refusals
from tests.test_gateway_support import (  # noqa: F401  (sim_root is a fixture)
    GrpcNode,
    LiveGateway,
    LiveServer,
    RecordingNode,
    SimEvidence,
    candidate,
    client,
    gateway_settings,
    sim_root,
)
from tests.spent_tokens_support import RedisServer
from tests.token_support import ISSUER_NAME, make_keys, node_evidence, policy_listing, write_directory

ORIGIN = "gateway.veil.test"
CHALLENGE = TokenChallenge(issuer_name=ISSUER_NAME, origin_info=(ORIGIN,))


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201 - listed, listed, published but unlisted
    return make_keys(tmp_path_factory.mktemp("issuer-keys"), 3)


@pytest.fixture(scope="module")
def policy_file(keys, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return policy_listing(tmp_path_factory.mktemp("policy") / "policy.toml", keys[:2])


@pytest.fixture(scope="module")
def node(sim_root: Path, policy_file: Path):
    started = GrpcNode(RecordingNode(node_evidence(policy_file)))
    yield started
    started.stop()


@pytest.fixture(scope="module")
def gateway(node, keys, policy_file: Path, tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("gateway")
    settings = gateway_settings(
        [node.address], policy=str(policy_file), origin=ORIGIN,
        issuer_directory=str(write_directory(folder / "directory.json", keys)),
        spent_tokens=f"sqlite:{folder / 'spent.sqlite'}",
    )
    with LiveGateway(settings) as live:
        live.wait_for(lambda: len(live.runtime.pool) == 1)
        yield live


def _token(key, challenge: TokenChallenge = CHALLENGE) -> str:  # noqa: ANN001
    pending = begin_issuance(key.token_key, challenge)
    return encode_authorization(finish_issuance(pending, answer_token_request([key], pending.request.encode())))


def _infer(gateway, node, authorization: str | None):  # noqa: ANN001, ANN202
    headers = {} if authorization is None else {"authorization": authorization}
    with client(gateway.url) as http:
        return http.post("/v1/infer", json={"candidates": [candidate(node.node_id, b"sealed")]}, headers=headers)


def test_a_valid_token_is_admitted_once_and_its_replay_refused(gateway, node, keys) -> None:
    for key in keys[:2]:
        token = _token(key)
        before = len(node.servicer.received)
        assert _infer(gateway, node, token).status_code == 200
        assert len(node.servicer.received) == before + 1
        replay = _infer(gateway, node, token)
        assert replay.status_code == 401 and replay.json()["error"]["code"] == "token_required"
        assert len(node.servicer.received) == before + 1


@pytest.mark.parametrize("case", ["missing", "malformed", "unlisted key", "other origin", "other issuer", "bit flip"])
def test_a_bad_token_gets_401_with_the_challenge_and_reaches_no_node(gateway, node, keys, case: str) -> None:
    authorization = {
        "missing": lambda: None,
        "malformed": lambda: 'PrivateToken token="not base64!"',
        "unlisted key": lambda: _token(keys[2]),
        "other origin": lambda: _token(keys[0], TokenChallenge(ISSUER_NAME, ("elsewhere.test",))),
        "other issuer": lambda: _token(keys[0], TokenChallenge("issuer.other.test", (ORIGIN,))),
        "bit flip": lambda: _token(keys[0])[:-6] + ("A" if _token(keys[0])[-6] != "A" else "B") + _token(keys[0])[-5:],
    }[case]()
    before = len(node.servicer.received)
    answer = _infer(gateway, node, authorization)
    assert answer.status_code == 401
    assert len(node.servicer.received) == before
    challenges = parse_www_authenticate(answer.headers["www-authenticate"])
    assert {c.token_key.key_id for c in challenges} == {k.token_key.key_id for k in keys[:2]}
    assert all(c.challenge == CHALLENGE for c in challenges)
    if authorization is not None:
        assert authorization[-24:] not in answer.text  # the refusal never echoes the token


def test_the_raw_ohttp_route_demands_a_token_too(gateway, node, keys) -> None:
    with client(gateway.url) as http:
        answer = http.post(f"/v1/nodes/{node.node_id}/ohttp", content=b"sealed",
                           headers={"content-type": "message/ohttp-req"})
        assert answer.status_code == 401
        answer = http.post(f"/v1/nodes/{node.node_id}/ohttp", content=b"sealed",
                           headers={"content-type": "message/ohttp-req", "authorization": _token(keys[0])})
        assert answer.status_code == 200


def test_the_dev_policy_admits_without_a_token(sim_root: Path) -> None:
    node = GrpcNode(RecordingNode(SimEvidence()))
    try:
        with LiveGateway(gateway_settings([node.address])) as live:
            live.wait_for(lambda: len(live.runtime.pool) == 1)
            assert live.runtime.token_gate is None
            assert _infer(live, node, None).status_code == 200
    finally:
        node.stop()


def test_a_policy_with_keys_needs_origin_and_a_directory_holding_them(keys, tmp_path: Path) -> None:
    policy = str(policy_listing(tmp_path / "policy.toml", keys[:1]))
    with pytest.raises(GatewaySettingsError):
        LiveGateway(gateway_settings([], policy=policy))
    only_unlisted = str(write_directory(tmp_path / "directory.json", keys[2:]))
    with pytest.raises(GatewaySettingsError):
        LiveGateway(gateway_settings([], policy=policy, origin=ORIGIN, issuer_directory=only_unlisted))


def test_the_process_store_spends_once_and_forgets_expired_pairs() -> None:
    now = [100.0]
    store = ProcessSpentTokens(clock=lambda: now[0])
    assert store.spend(b"k", b"n", 200.0) is True
    assert store.spend(b"k", b"n", 200.0) is False
    assert store.spend(b"k", b"m", 50.0) is False


def _tally_records(path: Path) -> list[dict]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert {record["kind"] for record in records} <= {"node_admitted", "route_decision", "token_decisions"}
    return [record for record in records if record["kind"] == "token_decisions"]


def test_the_audit_file_holds_token_tallies_and_nothing_else_about_the_tokens(node, keys, policy_file: Path,
                                                                              tmp_path: Path) -> None:
    settings = gateway_settings(
        [node.address], policy=str(policy_file), origin=ORIGIN, audit=f"file:{tmp_path / 'audit.jsonl'}",
        issuer_directory=str(write_directory(tmp_path / "directory.json", keys)),
        spent_tokens=f"sqlite:{tmp_path / 'spent.sqlite'}",
    )
    presented = [_token(keys[0]) for _ in range(3)] + [_token(keys[1])]
    refused = [None, 'PrivateToken token="not base64!"', _token(keys[2]), presented[0],
               _token(keys[0], TokenChallenge(ISSUER_NAME, ("elsewhere.test",)))]
    flipped = _token(keys[1])
    refused.append(flipped[:-6] + ("A" if flipped[-6] != "A" else "B") + flipped[-5:])
    with LiveServer(create_app(settings), settings) as live:
        pool = live.app.state.runtime.pool
        LiveGateway.wait_for(live, lambda: len(pool) == 1)
        for authorization, status in [(value, 200) for value in presented] + [(value, 401) for value in refused]:
            assert _infer(live, node, authorization).status_code == status
    tallies = {record["key_id"]: record for record in _tally_records(tmp_path / "audit.jsonl")}
    key0, key1 = (key.token_key.key_id.hex() for key in keys[:2])
    assert set(tallies) == {key0, key1, None}
    assert (tallies[key0]["accepted"], tallies[key1]["accepted"], tallies[None]["accepted"]) == (3, 1, 0)
    assert tallies[key0]["refused"] == refusals(spent=1, wrong_challenge=1)
    assert tallies[key1]["refused"] == refusals()
    assert tallies[None]["refused"] == refusals(missing=1, malformed=2, unknown_key=1)
    assert all(record["period_s"] >= 1 for record in tallies.values())
    text = (tmp_path / "audit.jsonl").read_text()
    for authorization in presented + refused[1:]:
        encoded = authorization.split('token="', 1)[1].rstrip('"')
        assert encoded not in text and encoded[:16] not in text
    for authorization in presented + [refused[2], refused[4], flipped]:
        token = parse_authorization(authorization)
        for secret in (token.nonce, token.encode(), token.authenticator, token.challenge_digest):
            assert secret.hex() not in text
    assert keys[2].token_key.key_id.hex() not in text  # an unlisted key's id is the client's to choose


def test_the_reporter_tallies_on_its_interval_and_at_stop(keys) -> None:
    clock = [1000.0]
    sink = MemorySink()
    gate = TokenGate(CHALLENGE, {keys[0].token_key.key_id: keys[0].token_key}, ProcessSpentTokens())
    reporter = TokenTallyReporter(gate.decisions, GatewayAuditor(sink, "ab" * 8), interval_s=0.05,
                                  clock=lambda: clock[0])

    async def run() -> None:
        reporter.start()
        gate.admit(_token(keys[0]))
        with pytest.raises(TokenRequiredError):
            gate.admit(None)
        clock[0] += 59.2
        while len(sink.events) < 2:  # the timer's tally
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # more timer ticks, with nothing counted: nothing emitted
        with pytest.raises(TokenRequiredError):
            gate.admit("PrivateToken token=AAAA")
        clock[0] += 0.3
        await reporter.stop()

    asyncio.run(run())
    events = sink.events
    assert [(e.key_id, e.period_s, e.accepted, dict(e.refused)) for e in events[:2]] == [
        (None, 60, 0, refusals(missing=1)), (keys[0].token_key.key_id.hex(), 60, 1, refusals())]
    assert [(e.key_id, e.period_s, e.accepted, dict(e.refused)) for e in events[2:]] == [
        (None, 1, 0, refusals(malformed=1))]


def test_a_request_refused_before_any_node_took_it_costs_no_token(gateway, node, keys) -> None:
    token = _token(keys[0])
    with client(gateway.url) as http:  # no admitted candidate: 404
        refused = http.post("/v1/infer", json={"candidates": [candidate("ab" * 8, b"sealed")]},
                            headers={"authorization": token})
    assert refused.status_code == 404
    limiter = gateway.runtime.forwarder.limiter
    held = [limiter.admit_request() for _ in range(limiter.max_total - limiter.in_flight)]  # the gateway is full
    try:
        overloaded = _infer(gateway, node, token)
    finally:
        for permit in held:
            permit.release()
    assert overloaded.status_code == 503 and overloaded.json()["error"]["code"] == "overloaded"
    before = len(node.servicer.received)
    assert _infer(gateway, node, token).status_code == 200, "the token was spent on a refused request"
    assert len(node.servicer.received) == before + 1
    assert _infer(gateway, node, token).status_code == 401  # served once, spent for good


def test_a_store_outage_answers_503_with_retry_after_and_spends_nothing(node, keys, policy_file: Path,
                                                                         tmp_path: Path) -> None:
    (tmp_path / "redis").mkdir()
    server = RedisServer(tmp_path / "redis")
    settings = gateway_settings([node.address], policy=str(policy_file), origin=ORIGIN, retry_after_s=2,
                                issuer_directory=str(write_directory(tmp_path / "directory.json", keys)),
                                spent_tokens=server.url)
    try:
        with LiveGateway(settings) as live:
            live.wait_for(lambda: len(live.runtime.pool) == 1)
            token = _token(keys[0])
            server.crash()
            outage = _infer(live, node, token)
            assert outage.status_code == 503 and outage.json()["error"]["code"] == "token_store_unavailable"
            assert outage.headers["retry-after"] == "2"
            server.restart()
            assert _infer(live, node, token).status_code == 200
    finally:
        server.stop()
