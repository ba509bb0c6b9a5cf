"""Slow answers are answers: a node that accepted a request keeps it, however long it works on it.

A node accepts a request as soon as it has decapsulated it, before any work on it; from then on the
gateway sends the response head, never times the answer out, never evicts the node for slowness and
never sends the request to a second node. Only a node that neither refuses nor accepts within the
accept timeout gets a 504, and then too the request goes nowhere else. Real uvicorn, real gRPC: first
recording nodes whose slowness the test controls, then real nodes whose answers a pass-through holds
until the test lets them go. Every slow answer is slow by construction, never by the machine's speed.
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from audit.events import NodeEvicted, RequestFinished, RouteDecision, RouteOutcome
from audit.records import read_audit_files
from client.sdk import Client
from enclave.node import NodeServer
from engine.tiny import write_tiny_model
from protocol import node_pb2_grpc
from tests.hardening_support import MODEL_NAME, node_settings
from tests.test_gateway_support import (  # noqa: F401  (sim_root is a fixture)
    GrpcNode,
    LiveGateway,
    SimEvidence,
    candidate,
    client,
    gateway_settings,
    recording_nodes,
    sim_root,
)
from tests.conftest import HANG_S

# Ample for a node to accept (it only decapsulates) on a slow machine, so that before a node accepted
# it is a real bound; every answer below is held for twice as long after it was accepted, so any
# timing of the answer would fail it.
ACCEPT_TIMEOUT_S = 2.0
HOLD_S = 2 * ACCEPT_TIMEOUT_S


@pytest.fixture(scope="module")
def nodes(sim_root: Path) -> Iterator[list[GrpcNode]]:
    with recording_nodes([SimEvidence(), SimEvidence()]) as started:
        yield started


@pytest.fixture(scope="module")
def gateway(nodes: list[GrpcNode]) -> Iterator[LiveGateway]:
    settings = gateway_settings([node.address for node in nodes], accept_timeout_s=ACCEPT_TIMEOUT_S)
    with LiveGateway(settings, rng=random.Random(7)) as live:
        yield live


@pytest.fixture(autouse=True)
def reset_nodes(nodes: list[GrpcNode], gateway: LiveGateway) -> Iterator[None]:
    for node in nodes:
        node.servicer.behaviour = type(node.servicer.behaviour)(mode="echo")
        node.servicer.received.clear()
    yield
    for node in nodes:
        node.servicer.behaviour.release.set()
    if len(gateway.runtime.pool) < len(nodes):
        gateway.run_round()


def evictions(gateway: LiveGateway) -> list[NodeEvicted]:
    return [event for event in gateway.audit.events if isinstance(event, NodeEvicted)]


def routes(gateway: LiveGateway) -> list[RouteDecision]:
    return [event for event in gateway.audit.events if isinstance(event, RouteDecision)]


def test_an_accepted_answer_slower_than_the_accept_timeout_is_relayed_from_its_one_node(gateway, nodes) -> None:
    for node in nodes:
        node.servicer.behaviour.mode = "accept_then_hold"
    evicted_before, routes_before = len(evictions(gateway)), len(routes(gateway))
    body = {"candidates": [candidate(node.node_id, f"sealed-{index}".encode()) for index, node in enumerate(nodes)]}
    with client(gateway.url) as http, http.stream("POST", "/v1/infer", json=body) as answer:
        # The head arrives while the node is still working: the answer is under way, not late.
        assert answer.status_code == 200
        chosen = next(node for node in nodes if node.node_id == answer.headers["veil-node-id"])
        assert chosen.servicer.received  # it has the request and holds its data back
        threading.Event().wait(HOLD_S)
        chosen.servicer.behaviour.release.set()
        content = answer.read()
    index = nodes.index(chosen)
    assert content == f"sealed-{index}|{chosen.node_id}".encode()
    assert [len(node.servicer.received) for node in nodes].count(0) == 1  # no second node ever saw it
    assert evictions(gateway)[evicted_before:] == []
    assert len(gateway.runtime.pool) == len(nodes)
    gateway.wait_for(lambda: len(routes(gateway)) > routes_before)
    [route] = routes(gateway)[routes_before:]
    assert (route.chosen, route.outcome) == (chosen.node_id, RouteOutcome.OK)


def test_a_node_that_never_accepts_is_a_504_and_the_request_goes_nowhere_else(gateway, nodes) -> None:
    for node in nodes:
        node.servicer.behaviour.mode = "hold"  # takes the call, never says it accepted
    evicted_before, routes_before = len(evictions(gateway)), len(routes(gateway))
    with client(gateway.url) as http:
        answer = http.post("/v1/infer", json={"candidates": [candidate(node.node_id, b"x") for node in nodes]})
    assert answer.status_code == 504
    assert answer.json()["error"]["code"] == "node_timeout"
    assert sorted(len(node.servicer.received) for node in nodes) == [0, 1]
    assert evictions(gateway)[evicted_before:] == []  # a slow node is not a broken one
    gateway.wait_for(lambda: len(routes(gateway)) > routes_before)
    [route] = routes(gateway)[routes_before:]
    assert route.outcome is RouteOutcome.NODE_ERROR and route.chosen is not None


# ----- real nodes, answers held by a pass-through -----------------------------------------------


class HeldAnswers(node_pb2_grpc.NodeServicer):
    """Stands between the gateway and a real node and passes everything on, except that it holds each
    answer's data, once the node has said it accepted the request, until `release` is set."""

    def __init__(self, target: str, accepted: threading.Event, release: threading.Event) -> None:
        self._stub = node_pb2_grpc.NodeStub(grpc.insecure_channel(target))
        self.accepted, self.release = accepted, release

    def Attest(self, request, context):
        return self._stub.Attest(request, timeout=30)

    def Health(self, request, context):
        return self._stub.Health(request, timeout=30)

    def Infer(self, request, context):
        for chunk in self._stub.Infer(request, timeout=120):
            if chunk.data and not self.release.is_set():
                self.accepted.set()
                self.release.wait(HANG_S)
            yield chunk


@dataclasses.dataclass
class Hold:
    """The pass-throughs in front of the real nodes: their addresses and the two events they share."""

    addresses: list[str]
    accepted: threading.Event
    release: threading.Event

    def release_after(self, seconds: float) -> threading.Thread:
        """Lets the held answers go `seconds` after a node first held one (the node had accepted by then)."""

        def wait_then_release() -> None:
            if self.accepted.wait(HANG_S):
                threading.Event().wait(seconds)
            self.release.set()

        thread = threading.Thread(target=wait_then_release, daemon=True)
        thread.start()
        return thread


@pytest.fixture(scope="module")
def real_nodes(sim_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[NodeServer]]:
    folder = tmp_path_factory.mktemp("slow-real")
    model_dir = write_tiny_model(folder / "tiny")
    started = []
    for index in range(2):
        settings = dataclasses.replace(node_settings(model_dir), audit=f"file:{folder / f'node{index}.jsonl'}")
        server = NodeServer(settings)
        server.start()
        server.audit_path = folder / f"node{index}.jsonl"
        started.append(server)
    yield started
    for server in started:
        server.stop(grace=0)


@pytest.fixture
def hold(real_nodes: list[NodeServer]) -> Iterator[Hold]:
    accepted, release = threading.Event(), threading.Event()
    servers, addresses = [], []
    for node in real_nodes:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        node_pb2_grpc.add_NodeServicer_to_server(HeldAnswers(f"127.0.0.1:{node.port}", accepted, release), server)
        addresses.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
        server.start()
        servers.append(server)
    yield Hold(addresses, accepted, release)
    release.set()
    for server in servers:
        server.stop(0).wait()


def finished_requests(nodes: list[NodeServer]) -> list[RequestFinished]:
    for node in nodes:
        node.audit.flush()
    log = read_audit_files(node.audit_path for node in nodes)
    return [record.event for record in log.records if isinstance(record.event, RequestFinished)]


def test_a_long_whole_answer_from_a_real_node_is_computed_once_and_evicts_nothing(real_nodes, hold) -> None:
    settings = gateway_settings(hold.addresses, accept_timeout_s=ACCEPT_TIMEOUT_S)
    with LiveGateway(settings) as gateway, Client(gateway.url, policy="dev", candidates=2) as sdk:
        before = len(finished_requests(real_nodes))
        # The answer is held for twice the accept timeout after the node accepted it.
        releaser = hold.release_after(HOLD_S)
        started = time.monotonic()
        answer = sdk.completions.create(model=MODEL_NAME, prompt="The story goes", max_tokens=64, n=4,
                                        temperature=1.0, seed=0)
        waited = time.monotonic() - started
        releaser.join(HANG_S)
        assert hold.accepted.is_set() and waited >= HOLD_S  # it was held: the premise, by construction
        assert len(answer.choices) == 4 and answer.usage.completion_tokens > 4
        assert evictions(gateway) == [] and len(gateway.runtime.pool) == 2
        gateway.wait_for(lambda: len(routes(gateway)) == 1)
        assert routes(gateway)[0].outcome is RouteOutcome.OK and routes(gateway)[0].chosen == answer.route.node_id
        gateway.wait_for(lambda: len(finished_requests(real_nodes)) > before)
        assert len(finished_requests(real_nodes)) == before + 1  # one node computed it, once


def test_the_sdk_waits_for_a_whole_answer_longer_than_its_connect_and_directory_timeout(hold) -> None:
    settings = gateway_settings(hold.addresses)
    short_s = 2.0  # ample for loopback connects and the directory on a slow machine; the answer is held twice as long
    with LiveGateway(settings) as gateway, Client(gateway.url, policy="dev", candidates=2, timeout=short_s) as sdk:
        releaser = hold.release_after(2 * short_s)
        started = time.monotonic()
        answer = sdk.completions.create(model=MODEL_NAME, prompt="The story goes", max_tokens=64, n=4,
                                        temperature=1.0, seed=1)
        waited = time.monotonic() - started
        releaser.join(HANG_S)
    # The premise, by construction: the body came 2 * `timeout` after the node accepted, and `timeout`
    # bounded every read of it before answers had their own bound.
    assert hold.accepted.is_set() and waited >= 2 * short_s
    assert len(answer.choices) == 4 and answer.usage.completion_tokens > 4
