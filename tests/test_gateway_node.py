"""The gateway in front of real enclave nodes (in-process gRPC servers, simulated attestation, tiny model)."""

from __future__ import annotations

import base64
import json
import os
import signal
from pathlib import Path

import httpx
import pytest

from attestation.bundle import EvidenceBundle
from attestation.verifier import verify
from audit.events import EvictionReason, NodeAdmitted, NodeEvicted
from client.sdk import Client
from enclave.node import NodeServer
from enclave.settings import NodeSettings
from engine.tiny import write_tiny_model
from ohttp import ChunkedRequestSealer, ClientRequest, bhttp
from ohttp.bhttp_stream import StreamingResponseDecoder
from ohttp.keys import KeyConfig
from policy import shipped_policy
from tests.policy_support import write_filled_strict
from tests.test_gateway_support import LiveGateway, candidate, client, gateway_settings, sim_root  # noqa: F401


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def start_node(model_dir: Path, key_grace_s: float = 3600) -> NodeServer:
    settings = NodeSettings(model=model_dir, policy="dev", attestation="sim", capacity=4, audit="none",
                            key_rotation_s=0, key_grace_s=key_grace_s, kv_cache_gib=0.05, model_name="tiny")
    server = NodeServer(settings)
    server.start()
    return server


@pytest.fixture(scope="module")
def nodes(sim_root: Path, model_dir: Path):
    started = [start_node(model_dir) for _ in range(2)]
    yield started
    for node in started:
        if node.service.serving:
            node.stop(grace=0)


@pytest.fixture(scope="module")
def gateway(nodes):
    with LiveGateway(gateway_settings([f"127.0.0.1:{node.port}" for node in nodes])) as live:
        yield live


def directory(http: httpx.Client) -> dict[str, dict]:
    return {entry["node_id"]: entry for entry in http.get("/v1/nodes").json()["nodes"]}


def inner_request(path: str, body: dict | None = None) -> bytes:
    method = b"GET" if body is None else b"POST"
    content = b"" if body is None else json.dumps(body).encode()
    return bhttp.encode_request(bhttp.Request(method, b"https", b"veil.node", path.encode(),
                                              [(b"content-type", b"application/json")], content))


def models_via_infer(http: httpx.Client, node_id: str, config: KeyConfig) -> httpx.Response:
    encapsulated, context = ClientRequest.encapsulate(config, inner_request("/v1/models"))
    answer = http.post("/v1/infer", json={"candidates": [candidate(node_id, encapsulated)]})
    answer.context = context  # type: ignore[attr-defined]
    return answer


def test_real_nodes_are_admitted_with_verifiable_evidence(gateway, nodes) -> None:
    with client(gateway.url) as http:
        listed = directory(http)
    assert set(listed) == {node.node_id for node in nodes}
    for node in nodes:
        entry = listed[node.node_id]
        verified = verify(EvidenceBundle.from_json(entry["evidence"]), shipped_policy("dev"))
        assert verified.node_id == node.node_id
        assert base64.b64decode(entry["key_config"]) == node.keys.current.config.encode()
        assert entry["capacity"] == 4


def test_an_encrypted_request_reaches_the_node_and_only_the_client_can_read_the_answer(gateway, nodes) -> None:
    node = nodes[0]
    with client(gateway.url) as http:
        config = KeyConfig.decode(base64.b64decode(directory(http)[node.node_id]["key_config"]))
        answer = models_via_infer(http, node.node_id, config)
    assert answer.status_code == 200 and answer.headers["veil-node-id"] == node.node_id
    response = bhttp.decode_response(answer.context.open_response(answer.content))
    assert response.status == 200
    assert json.loads(response.content)["data"][0]["id"] == "tiny"
    assert b"tiny" not in answer.content  # the gateway relayed ciphertext


def test_a_streamed_completion_passes_through_chunk_by_chunk(gateway, nodes) -> None:
    node = nodes[1]
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8, "seed": 6,
            "temperature": 0.8, "stream": True}
    with client(gateway.url) as http:
        config = KeyConfig.decode(base64.b64decode(directory(http)[node.node_id]["key_config"]))
        sealer = ChunkedRequestSealer(config)
        encapsulated = sealer.seal_chunk(inner_request("/v1/chat/completions", body), final=True)
        opener, decoder, events = sealer.response_opener(), StreamingResponseDecoder(), []
        with http.stream("POST", "/v1/infer", json={"candidates": [
                candidate(node.node_id, encapsulated, "message/ohttp-chunked-req")]}) as answer:
            assert answer.headers["content-type"] == "message/ohttp-chunked-res"
            for data in answer.iter_raw():
                for piece in opener.feed(data):
                    events += decoder.feed(piece)
    opener.finish()
    decoder.finish()
    assert decoder.head.status == 200
    events = [frame for frame in b"".join(events).split(b"\n\n") if frame]  # pieces may carry several
    assert events[-1] == b"data: [DONE]" and len(events) >= 2
    assert all(json.loads(event.removeprefix(b"data: "))["object"] == "chat.completion.chunk" for event in events[:-1])


def test_plain_ohttp_clients_reach_a_real_node(gateway, nodes) -> None:
    node = nodes[0]
    with client(gateway.url) as http:
        config = KeyConfig.decode(base64.b64decode(directory(http)[node.node_id]["key_config"]))
        encapsulated, context = ClientRequest.encapsulate(config, inner_request("/v1/models"))
        answer = http.post(f"/v1/nodes/{node.node_id}/ohttp", content=encapsulated,
                           headers={"content-type": "message/ohttp-req"})
    assert answer.status_code == 200 and answer.headers["content-type"] == "message/ohttp-res"
    assert bhttp.decode_response(context.open_response(answer.content)).status == 200


def test_a_rotated_node_keeps_serving_clients_holding_the_old_directory(gateway, nodes) -> None:
    node = nodes[0]
    with client(gateway.url) as http:
        old_id = node.node_id
        old_config = KeyConfig.decode(base64.b64decode(directory(http)[old_id]["key_config"]))
        node.rotate_key()
        gateway.run_round()  # the health check sees the new id and re-attests at once
        listed = directory(http)
        assert node.node_id in listed and old_id not in listed
        answer = models_via_infer(http, old_id, old_config)
        assert answer.status_code == 200 and answer.headers["veil-node-id"] == old_id
        assert bhttp.decode_response(answer.context.open_response(answer.content)).status == 200
        new_config = KeyConfig.decode(base64.b64decode(listed[node.node_id]["key_config"]))
        assert models_via_infer(http, node.node_id, new_config).status_code == 200


def test_a_key_retired_past_its_grace_is_400_unknown_key_and_the_sdk_refetches_the_directory_once(
        sim_root: Path, model_dir: Path) -> None:
    node = start_node(model_dir, key_grace_s=0)
    try:
        with LiveGateway(gateway_settings([f"127.0.0.1:{node.port}"])) as gateway, client(gateway.url) as http, \
                Client(gateway.url, policy="dev", candidates=1, directory_ttl_s=3600) as sdk:
            assert sdk.models.list().data  # the directory is cached from here on
            old_id = node.node_id
            old_config = KeyConfig.decode(base64.b64decode(directory(http)[old_id]["key_config"]))
            node.rotate_key()
            node.keys.expire_previous()  # no grace: the old key opens nothing any more
            gateway.run_round()  # the gateway lists the new id, and still routes the old one to the node
            stale = http.post(f"/v1/nodes/{old_id}/ohttp", headers={"content-type": "message/ohttp-req"},
                              content=ClientRequest.encapsulate(old_config, inner_request("/v1/models"))[0])
            assert stale.status_code == 400 and stale.json()["error"]["code"] == "unknown_key"
            answer = sdk.completions.create(model="tiny", prompt="Once upon", max_tokens=3)
            assert answer.route.node_id == node.node_id != old_id
            assert gateway.runtime.pool.lookup(old_id) is not None  # a stale key is not the node's failure
            assert not any(isinstance(event, NodeEvicted) for event in gateway.audit.events)
    finally:
        node.stop(grace=0)


def test_a_strict_gateway_never_admits_simulated_nodes(nodes, tmp_path: Path) -> None:
    strict = str(write_filled_strict(tmp_path / "strict.toml"))
    settings = gateway_settings([f"127.0.0.1:{nodes[1].port}"], policy=strict)
    with LiveGateway(settings) as strict, client(strict.url) as http:
        assert http.get("/v1/nodes").json()["nodes"] == []
        answer = http.post("/v1/infer", json={"candidates": [candidate(nodes[1].node_id, b"x")]})
    assert answer.status_code == 404 and answer.json()["error"]["code"] == "no_candidate"


def test_a_dead_node_is_evicted_and_traffic_fails_over(gateway, nodes) -> None:
    dead, alive = nodes
    with client(gateway.url) as http:
        listed = directory(http)
        configs = {node_id: KeyConfig.decode(base64.b64decode(entry["key_config"])) for node_id, entry in listed.items()}
        dead_id = dead.node_id
        dead.stop(grace=0)
        for _ in range(6):
            candidates, contexts = [], {}
            for node_id, config in configs.items():
                encapsulated, contexts[node_id] = ClientRequest.encapsulate(config, inner_request("/v1/models"))
                candidates.append(candidate(node_id, encapsulated))
            answer = http.post("/v1/infer", json={"candidates": candidates})
            assert answer.status_code == 200 and answer.headers["veil-node-id"] == alive.node_id
            served_by = answer.headers["veil-node-id"]
            assert bhttp.decode_response(contexts[served_by].open_response(answer.content)).status == 200
        gateway.run_round()
    assert gateway.runtime.pool.lookup(dead_id) is None
    assert [node.node_id for node in gateway.runtime.pool.entries()] == [alive.node_id]
    assert any(isinstance(event, NodeEvicted) and event.node_id == dead_id for event in gateway.audit.events)


def test_a_node_whose_engine_core_died_is_evicted_and_stays_out(sim_root, model_dir) -> None:
    node = start_node(model_dir)
    try:
        with LiveGateway(gateway_settings([f"127.0.0.1:{node.port}"])) as gateway:
            assert [entry.node_id for entry in gateway.runtime.pool.entries()] == [node.node_id]
            os.kill(node.engine._process.pid, signal.SIGKILL)
            gateway.wait_for(lambda: not node.service.serving)
            for _ in range(4):  # it still answers Attest: only its health keeps it out
                gateway.run_round()
            assert gateway.runtime.pool.entries() == ()
            events = gateway.audit.events
            assert [event.reason for event in events if isinstance(event, NodeEvicted)] == [EvictionReason.DRAINED]
            assert sum(isinstance(event, NodeAdmitted) for event in events) == 1
    finally:
        node.stop(grace=0)


def test_attestation_results_verify_under_the_gateways_published_key(gateway, nodes) -> None:
    from cryptography.hazmat.primitives.serialization import load_pem_public_key

    from attestation.errors import ResultTokenError
    from attestation.results import verify_result

    with client(gateway.url) as http:
        key = http.get("/v1/attestation-key").json()
        listed = directory(http)
    public_key = load_pem_public_key(key["public_key_pem"].encode())
    for node_id, entry in listed.items():
        result = verify_result(entry["attestation_result"], {key["kid"]: public_key}, issuer=key["issuer"])
        assert result.node_id == node_id
    forged = next(iter(listed.values()))["attestation_result"][:-4] + "AAAA"
    with pytest.raises(ResultTokenError):
        verify_result(forged, {key["kid"]: public_key}, issuer=key["issuer"])


def test_a_node_attests_on_demand_over_the_clients_own_nonce(gateway, nodes) -> None:
    import os

    nonce = os.urandom(32)
    with client(gateway.url) as http:
        listed = directory(http)
        node = next(node for node in nodes if node.node_id in listed)  # earlier tests may have evicted one
        answer = http.post(f"/v1/nodes/{node.node_id}/attest", json={"nonce": nonce.hex()})
        assert answer.status_code == 200
        bundle = EvidenceBundle.from_json(answer.json()["evidence"])
        assert verify(bundle, shipped_policy("dev"), expected_nonce=nonce).node_id == node.node_id
        with pytest.raises(Exception):  # bound to that nonce, not to any other
            verify(bundle, shipped_policy("dev"), expected_nonce=os.urandom(32))
        assert http.post(f"/v1/nodes/{node.node_id}/attest", json={"nonce": "00" * 31}).status_code == 400
        assert http.post(f"/v1/nodes/{'ab' * 16}/attest", json={"nonce": nonce.hex()}).status_code == 404


def test_a_client_asking_for_fresh_evidence_verifies_its_own_nonce_and_is_served(gateway, nodes) -> None:
    from client.sdk import Client

    with Client(gateway.url, policy="dev", fresh_evidence=True) as sdk:
        answer = sdk.models.list()
        route = sdk.last_route
    assert answer.data[0].id == "tiny"
    assert route.candidates and all(record.ok for record in route.candidates)
    assert all("nonce" in check.detail and "no nonce" not in check.detail
               for record in route.candidates for check in record.verified.checks if check.name == "freshness")
