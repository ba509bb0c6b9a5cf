"""The gateway over real HTTP (uvicorn) in front of real gRPC nodes that record what they receive."""

from __future__ import annotations

import json
import random
import threading
from collections import Counter
from pathlib import Path

import httpx
import pytest
from scipy.stats import chisquare

from audit.events import NodeAdmitted, NodeEvicted, RouteDecision, RouteOutcome
from tests.test_gateway_support import (  # noqa: F401  (sim_root is a fixture)
    GrpcNode,
    LiveGateway,
    RecordingNode,
    SimEvidence,
    candidate,
    client,
    gateway_settings,
    sim_root,
)
from tests.conftest import HANG_S

CANARY = "CANARY-gw-5d1e-ORANGE-OTTER"
# What gRPC itself puts on every call; anything else reaching a node would have come from somewhere.
GRPC_OWN_FIELDS = {"user-agent"}


@pytest.fixture(scope="module")
def nodes(sim_root: Path):
    started = [GrpcNode(RecordingNode(SimEvidence())) for _ in range(3)]
    yield started
    for node in started:
        node.stop()


@pytest.fixture(scope="module")
def forged(tmp_path_factory: pytest.TempPathFactory, sim_root: Path):
    node = GrpcNode(RecordingNode(SimEvidence(tmp_path_factory.mktemp("forged-root"))))
    yield node
    node.stop()


@pytest.fixture(scope="module")
def gateway(nodes, forged):
    settings = gateway_settings([node.address for node in nodes] + [forged.address], max_in_flight=4)
    with LiveGateway(settings, rng=random.Random(1121)) as live:
        yield live


@pytest.fixture(autouse=True)
def reset_nodes(nodes, gateway):
    for node in nodes:
        node.servicer.behaviour.mode = "echo"
        node.servicer.behaviour.release.set()
        node.servicer.entered = threading.Semaphore(0)
    yield
    for node in nodes:
        node.servicer.behaviour.mode = "echo"
        node.servicer.behaviour.release.set()
    if len(gateway.runtime.pool) < len(nodes):
        gateway.run_round()  # readmit anything a test evicted
    assert len(gateway.runtime.pool) == len(nodes)


def infer(http: httpx.Client, *candidates: dict, **kwargs) -> httpx.Response:
    return http.post("/v1/infer", json={"candidates": list(candidates)}, **kwargs)


def routes(gateway: LiveGateway) -> list[RouteDecision]:
    return [event for event in gateway.audit.events if isinstance(event, RouteDecision)]


def test_directory_lists_the_verified_nodes_identically_for_every_caller(gateway, nodes, forged) -> None:
    with client(gateway.url) as http:
        plain = http.get("/v1/nodes")
        dressed = http.get("/v1/nodes", headers={"user-agent": CANARY, "x-forwarded-for": "203.0.113.9",
                                                 "cookie": f"session={CANARY}", "accept-language": "fr"})
    assert plain.status_code == dressed.status_code == 200
    assert plain.content == dressed.content
    directory = plain.json()
    assert directory["version"] == 1
    assert directory["policy_digest"] == gateway.runtime.pool.policy.digest.hex()
    assert sorted(node["node_id"] for node in directory["nodes"]) == sorted(node.node_id for node in nodes)
    assert forged.node_id not in plain.text
    for entry in directory["nodes"]:
        assert set(entry) == {"node_id", "key_config", "evidence", "capacity", "attestation_result", "models",
                              "transparency", "task"}
        assert entry["task"] == "generate"
        assert entry["capacity"] == 4
    assert all(str(node.port) not in plain.text for node in nodes)  # never an address
    assert "set-cookie" not in plain.headers and "server" not in plain.headers and "date" not in plain.headers


def test_health_counts_admitted_nodes(gateway, nodes) -> None:
    with client(gateway.url) as http:
        assert http.get("/v1/health").json() == {"status": "ok", "nodes": len(nodes)}


def test_admission_audited_and_forged_node_never_admitted(gateway, nodes, forged) -> None:
    admitted = {event.node_id for event in gateway.audit.events if isinstance(event, NodeAdmitted)}
    assert {node.node_id for node in nodes} <= admitted
    assert forged.node_id not in admitted
    assert forged.servicer.attest_calls  # it was asked, and refused


def test_relays_the_chosen_nodes_bytes_with_its_id(gateway, nodes) -> None:
    payload = b"\x00ciphertext\xff" * 5
    with client(gateway.url) as http:
        answer = infer(http, candidate(nodes[0].node_id, payload))
    assert answer.status_code == 200
    assert answer.headers["content-type"] == "message/ohttp-res"
    assert answer.headers["veil-node-id"] == nodes[0].node_id
    assert answer.content == payload + b"|" + nodes[0].node_id.encode()
    assert answer.headers["cache-control"] == "no-store"
    assert "incremental" not in answer.headers  # a whole answer is one message; nothing to deliver early


def test_chunked_requests_get_the_chunked_response_media_type(gateway, nodes) -> None:
    with client(gateway.url) as http:
        answer = infer(http, candidate(nodes[1].node_id, b"chunked", "message/ohttp-chunked-req"))
    assert answer.headers["content-type"] == "message/ohttp-chunked-res"
    assert answer.headers["incremental"] == "?1"  # RFC 9842: intermediaries must not buffer it
    assert nodes[1].servicer.received[-1].media_type == "message/ohttp-chunked-req"


def test_the_node_receives_only_the_ciphertext_and_the_gateways_own_fields(gateway, nodes) -> None:
    target = nodes[2]
    payload = b"sealed-" + CANARY.encode()
    headers = {
        "user-agent": f"agent-{CANARY}", "cookie": f"id={CANARY}", "x-forwarded-for": "198.51.100.7",
        "forwarded": "for=198.51.100.7", "x-real-ip": "198.51.100.7", "authorization": f"Bearer {CANARY}",
        "x-request-id": CANARY, "referer": f"https://{CANARY}.example/", "accept-language": "de-CH",
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    }
    before = len(target.servicer.received)
    with client(gateway.url) as http:
        answer = http.post("/v1/infer?trace=" + CANARY, headers=headers,
                           content=json.dumps({"candidates": [candidate(target.node_id, payload)]}))
    assert answer.status_code == 200
    [received] = target.servicer.received[before:]
    assert received.fields == ("media_type", "encapsulated")
    assert received.encapsulated == payload and received.media_type == "message/ohttp-req"
    assert {key for key, _ in received.metadata} <= GRPC_OWN_FIELDS
    assert dict(received.metadata)["user-agent"].startswith("veil-gateway")
    flat = repr(received.metadata)
    for secret in (CANARY, "198.51.100.7", "de-CH", "0af7651916cd43dd"):
        assert secret not in flat
    assert all(key in GRPC_OWN_FIELDS for call in target.servicer.attest_calls for key, _ in call)


def test_failover_when_the_chosen_node_fails_before_its_first_byte(gateway, nodes) -> None:
    failing, healthy = nodes[0], nodes[1]
    failing.servicer.behaviour.mode = "fail"
    with client(gateway.url) as http:
        for _ in range(12):  # the failing node is evicted at its first failure; go on until it was tried
            answer = infer(http, candidate(failing.node_id, b"one"), candidate(healthy.node_id, b"two"))
            assert answer.status_code == 200
            assert answer.headers["veil-node-id"] == healthy.node_id
            if gateway.runtime.pool.lookup(failing.node_id) is None:
                break
    assert gateway.runtime.pool.lookup(failing.node_id) is None
    evicted = [event for event in gateway.audit.events if isinstance(event, NodeEvicted)]
    assert evicted[-1].node_id == failing.node_id
    # A route is audited once its answer has been relayed completely, just after the client has it.
    gateway.wait_for(lambda: any(r.outcome is RouteOutcome.FAILOVER and r.chosen == healthy.node_id for r in routes(gateway)))


def test_every_candidate_failing_is_a_502_that_echoes_nothing(gateway, nodes) -> None:
    nodes[0].servicer.behaviour.mode = "fail"
    nodes[1].servicer.behaviour.mode = "fail"
    before = len(routes(gateway))
    with client(gateway.url) as http:
        answer = infer(http, candidate(nodes[0].node_id, CANARY.encode()), candidate(nodes[1].node_id, CANARY.encode()))
    assert answer.status_code == 502
    assert answer.json()["error"]["code"] == "node_failed"
    assert CANARY not in answer.text and nodes[0].node_id not in answer.text
    gateway.wait_for(lambda: RouteOutcome.NODE_ERROR in {route.outcome for route in routes(gateway)[before:]})


@pytest.mark.parametrize(("mode", "code"), [("reject", "undecryptable"), ("unknown_key", "unknown_key")])
def test_a_ciphertext_the_node_cannot_open_is_a_400_sent_to_no_other_node(gateway, nodes, mode, code) -> None:
    for node in nodes[:2]:
        node.servicer.behaviour.mode = mode
    received = [len(node.servicer.received) for node in nodes[:2]]
    before = len(routes(gateway))
    with client(gateway.url) as http:
        answer = infer(http, candidate(nodes[0].node_id, CANARY.encode()), candidate(nodes[1].node_id, CANARY.encode()))
        raw = http.post(f"/v1/nodes/{nodes[0].node_id}/ohttp", content=CANARY.encode(),
                        headers={"content-type": "message/ohttp-req"})
    for refused in (answer, raw):
        assert refused.status_code == 400  # RFC 9458 section 5.2: the node is not at fault
        assert refused.json()["error"]["code"] == code
        assert CANARY not in refused.text and nodes[0].node_id not in refused.text
        if code == "unknown_key":  # RFC 9458 section 5.3's problem detail, for any OHTTP client
            assert refused.headers["content-type"] == "application/problem+json"
            assert refused.json()["type"] == "https://iana.org/assignments/http-problem-types#ohttp-key"
        else:
            assert refused.headers["content-type"] == "application/json"
    tried = [len(node.servicer.received) - count for node, count in zip(nodes[:2], received)]
    assert sum(tried) == 2 and tried[0] >= 1  # one node per request: no failover to the other candidate
    assert all(gateway.runtime.pool.lookup(node.node_id) is not None for node in nodes)  # nothing evicted
    gateway.wait_for(lambda: len(routes(gateway)) - before == 2)
    assert {route.outcome for route in routes(gateway)[before:]} == {RouteOutcome.NODE_ERROR}


def test_a_node_dying_mid_stream_ends_that_stream_and_is_evicted(gateway, nodes) -> None:
    dying, other = nodes[2], nodes[0]
    dying.servicer.behaviour.mode = "die_mid_stream"
    with client(gateway.url) as http:
        answer = infer(http, candidate(dying.node_id, b"partial"))
        assert answer.status_code == 200
        assert answer.content == b"partial"  # the first chunk only; the client's opener reports truncation
        assert infer(http, candidate(other.node_id, b"fine")).status_code == 200
    gateway.wait_for(lambda: gateway.runtime.pool.lookup(dying.node_id) is None)
    gateway.wait_for(lambda: any(r.outcome is RouteOutcome.NODE_ERROR and r.chosen == dying.node_id for r in routes(gateway)))


def test_a_client_leaving_mid_stream_cancels_the_node_call_and_frees_its_slots(gateway, nodes) -> None:
    streaming = nodes[0]
    streaming.servicer.behaviour.mode = "hold_after_first"
    before = streaming.servicer.cancelled
    with client(gateway.url) as http:
        with http.stream("POST", "/v1/infer", json={"candidates": [candidate(streaming.node_id, b"first")]}) as answer:
            assert next(answer.iter_raw()) == b"first"
    gateway.wait_for(lambda: streaming.servicer.cancelled == before + 1)
    limiter = gateway.runtime.forwarder.limiter
    gateway.wait_for(lambda: limiter.in_flight == 0 and limiter.node_in_flight(streaming.address) == 0)
    assert gateway.runtime.pool.lookup(streaming.node_id) is not None  # leaving is not the node's failure


def test_busy_nodes_fail_over_and_all_busy_is_503_with_retry_after(gateway, nodes) -> None:
    nodes[0].servicer.behaviour.mode = "busy"
    with client(gateway.url) as http:
        for _ in range(6):
            answer = infer(http, candidate(nodes[0].node_id, b"x"), candidate(nodes[1].node_id, b"y"))
            assert answer.status_code == 200 and answer.headers["veil-node-id"] == nodes[1].node_id
        answer = infer(http, candidate(nodes[0].node_id, b"x"))
    assert answer.status_code == 503
    assert answer.headers["retry-after"] == "1"
    assert answer.json()["error"]["code"] == "overloaded"
    assert gateway.runtime.pool.lookup(nodes[0].node_id) is not None  # busy is not broken


def test_overall_bound_gives_503_with_retry_after_and_never_queues(gateway, nodes) -> None:
    holder = nodes[1]
    holder.servicer.behaviour = type(holder.servicer.behaviour)(mode="hold")
    bound = gateway.runtime.settings.max_in_flight
    results: list[int] = []

    def hold_one() -> None:
        with client(gateway.url) as http:
            results.append(infer(http, candidate(holder.node_id, b"held")).status_code)

    threads = [threading.Thread(target=hold_one) for _ in range(bound)]
    for thread in threads:
        thread.start()
    for _ in range(bound):
        assert holder.servicer.entered.acquire(timeout=10)
    with client(gateway.url) as http:
        refused = infer(http, candidate(nodes[0].node_id, b"one more"))
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        holder.servicer.behaviour.release.set()
        for thread in threads:
            thread.join(HANG_S)
        assert results == [200] * bound
        assert infer(http, candidate(nodes[0].node_id, b"after")).status_code == 200
    gateway.wait_for(lambda: any(r.outcome is RouteOutcome.OVERLOADED and r.chosen is None for r in routes(gateway)))


def test_unknown_and_forged_candidates_are_404_no_candidate(gateway, forged) -> None:
    with client(gateway.url) as http:
        for node_id in (forged.node_id, "0123456789abcdef" * 2):
            answer = infer(http, candidate(node_id, b"x"))
            assert answer.status_code == 404 and answer.json()["error"]["code"] == "no_candidate"
            assert node_id not in answer.text
    assert not forged.servicer.received


@pytest.mark.parametrize("body", [
    b"not json " + CANARY.encode(),
    json.dumps({"candidates": []}).encode(),
    json.dumps({"candidates": [{"node_id": CANARY, "media_type": "message/ohttp-req", "encapsulated": "AA=="}]}).encode(),
    json.dumps({"candidates": [{"node_id": "a" * 32, "media_type": CANARY, "encapsulated": "AA=="}]}).encode(),
    json.dumps({"candidates": [{"node_id": "a" * 32, "media_type": "message/ohttp-req", "encapsulated": CANARY}]}).encode(),
    json.dumps({"candidates": [{"node_id": "a" * 32, "media_type": "message/ohttp-req", "encapsulated": "AA==",
                                "extra": CANARY}]}).encode(),
    json.dumps({"candidates": [candidate("a" * 32, b"x")] * 2}).encode(),
    json.dumps({"candidates": [candidate(f"{index:032x}", b"x") for index in range(9)]}).encode(),
])
def test_malformed_bodies_are_400_and_never_echoed(gateway, body: bytes) -> None:
    with client(gateway.url) as http:
        answer = http.post("/v1/infer", content=body, headers={"content-type": "application/json"})
    assert answer.status_code == 400
    assert answer.json()["error"]["code"] == "malformed"
    assert CANARY not in answer.text


def test_oversized_bodies_are_413(gateway) -> None:
    limit = gateway.runtime.settings.max_body_bytes
    with client(gateway.url) as http:
        declared = http.post("/v1/infer", content=b"x" * (limit + 1))
        streamed = http.post("/v1/infer", content=iter([b"x" * limit, b"x"]))  # no content-length: chunked upload
    assert declared.status_code == streamed.status_code == 413
    assert declared.json()["error"]["code"] == "too_large"


def test_unknown_paths_and_methods_answer_fixed_errors(gateway) -> None:
    with client(gateway.url) as http:
        missing = http.get(f"/v1/{CANARY}")
        wrong_method = http.get("/v1/infer")
        registration = http.post("/v1/nodes/register", json={"address": "127.0.0.1:1"})
    assert missing.status_code == 404 and CANARY not in missing.text
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["code"] == "method_not_allowed"
    assert registration.status_code in (404, 405)  # registration is off by default


def test_plain_ohttp_forwarding_to_a_named_node(gateway, nodes) -> None:
    target = nodes[0]
    with client(gateway.url) as http:
        answer = http.post(f"/v1/nodes/{target.node_id}/ohttp", content=b"raw-ohttp",
                           headers={"content-type": "message/ohttp-chunked-req", "user-agent": CANARY})
        wrong_type = http.post(f"/v1/nodes/{target.node_id}/ohttp", content=b"raw",
                               headers={"content-type": "application/json"})
        unknown = http.post(f"/v1/nodes/{'f' * 32}/ohttp", content=b"raw", headers={"content-type": "message/ohttp-req"})
        bad_id = http.post(f"/v1/nodes/{CANARY}/ohttp", content=b"raw", headers={"content-type": "message/ohttp-req"})
    assert answer.status_code == 200
    assert answer.headers["content-type"] == "message/ohttp-chunked-res"
    assert answer.content == b"raw-ohttp|" + target.node_id.encode()
    received = target.servicer.received[-1]
    assert received.encapsulated == b"raw-ohttp" and CANARY not in repr(received.metadata)
    assert wrong_type.status_code == 415
    assert unknown.status_code == 404 and bad_id.status_code == 404 and CANARY not in bad_id.text


def test_routing_over_many_requests_is_uniform_among_candidates(gateway, nodes) -> None:
    before = len(routes(gateway))
    ids = [node.node_id for node in nodes]
    served: Counter[str] = Counter()
    with client(gateway.url) as http:
        for index in range(240):
            order = ids[index % 3:] + ids[:index % 3]  # the request's order must not matter
            answer = infer(http, *(candidate(node_id, b"u") for node_id in order))
            served[answer.headers["veil-node-id"]] += 1
    assert sum(served.values()) == 240 and set(served) == set(ids)
    assert chisquare([served[node_id] for node_id in ids]).pvalue > 0.001
    gateway.wait_for(lambda: len(routes(gateway)) - before == 240)
    assert Counter(route.chosen for route in routes(gateway)[before:]) == served
