"""Kubernetes-style probes: grpc.health.v1 on a real node, /livez and /readyz on the gateway, relay and issuer."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from enclave.health import NODE_SERVICE, NodeHealth
from enclave.node import NodeServer
from enclave.service import NOT_ADMITTING
from enclave.settings import NodeSettings
from engine.tiny import write_tiny_model
from issuer.app import create_issuer_app
from issuer.keys import add_key, load_keyring
from relay.app import RelaySettings, create_relay_app
from protocol import node_pb2, node_pb2_grpc
from serving.settings import ServerSettings
from tests.issuer_support import es256_account, issuer_config
from tests.test_gateway_support import (  # noqa: F401  (sim_root is a fixture)
    GrpcNode,
    LiveGateway,
    LiveServer,
    RecordingNode,
    SimEvidence,
    gateway_settings,
    sim_root,
)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# Generous bounds for "eventually": they only stop a broken test from hanging; the premise is only that it happens.
EVENTUALLY_S = 15.0


def poll_until(condition: Callable[[], bool], bound_s: float = EVENTUALLY_S) -> bool:
    deadline = time.monotonic() + bound_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def check(channel: grpc.Channel, service: str = "") -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


# ----- the node --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def test_a_node_serves_grpc_health_and_turns_not_serving_when_its_core_dies(sim_root, model_dir, tmp_path):
    node = NodeServer(NodeSettings(model=model_dir, policy="dev", attestation="sim", kv_cache_gib=0.05,
                                   audit="none"))
    node.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{node.port}") as channel:
            assert check(channel) == SERVING
            assert check(channel, NODE_SERVICE) == SERVING
            with pytest.raises(grpc.RpcError) as unknown:
                check(channel, "no.such.Service")
            assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
            os.kill(node.engine._process.pid, signal.SIGKILL)
            assert poll_until(lambda: check(channel) == NOT_SERVING)
            assert check(channel, NODE_SERVICE) == NOT_SERVING
            stub = node_pb2_grpc.NodeStub(channel)
            assert not stub.Health(node_pb2.HealthRequest()).serving
            with pytest.raises(grpc.RpcError) as refused:
                list(stub.Infer(node_pb2.InferRequest(media_type="message/ohttp-req", encapsulated=b"x")))
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert refused.value.details() == NOT_ADMITTING
    finally:
        node.stop()


class _Evidence:
    """An evidence check that passes until told to fail, as a node's self-attestation would."""

    def __init__(self) -> None:
        self.fail = False
        self.checks = 0

    def __call__(self) -> None:
        self.checks += 1
        if self.fail:
            raise RuntimeError("the backend could not collect evidence")


@pytest.fixture
def health_server() -> Iterator[Callable[..., tuple[NodeHealth, grpc.Channel]]]:
    started: list[tuple[grpc.Server, NodeHealth, grpc.Channel]] = []

    def start(core_alive: Callable[[], bool], evidence: _Evidence, evidence_check_s: float) -> tuple[NodeHealth, grpc.Channel]:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        health = NodeHealth(core_alive, evidence, evidence_check_s)
        health.add_to(server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        health.start()
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        started.append((server, health, channel))
        return health, channel

    yield start
    for server, health, channel in started:
        channel.close()
        health.stop()
        server.stop(0).wait()


def test_stale_evidence_is_not_serving_and_fresh_evidence_serves_again(health_server) -> None:
    evidence = _Evidence()
    health, channel = health_server(lambda: True, evidence, 0.05)
    assert check(channel) == SERVING
    evidence.fail = True
    assert poll_until(lambda: check(channel) == NOT_SERVING)
    assert evidence.checks >= 1
    evidence.fail = False
    assert poll_until(lambda: check(channel) == SERVING)


def test_draining_is_not_serving_for_good(health_server) -> None:
    health, channel = health_server(lambda: True, _Evidence(), 300.0)
    assert check(channel, NODE_SERVICE) == SERVING
    health.drain()
    assert check(channel) == NOT_SERVING and check(channel, NODE_SERVICE) == NOT_SERVING
    time.sleep(0.3)  # the watcher's next rounds must not bring it back
    assert check(channel) == NOT_SERVING


def test_a_health_check_before_start_is_not_serving() -> None:
    health = NodeHealth(lambda: True, _Evidence(), 300.0)
    assert not health.serving  # no self-attestation has passed yet


# ----- the gateway, the relay and the issuer -----------------------------------------------------


def http(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=10.0, trust_env=False)


def test_a_gateway_without_nodes_is_alive_but_not_ready(sim_root) -> None:
    with LiveGateway(gateway_settings([])) as gateway, http(gateway.url) as client:
        assert client.get("/livez").status_code == 200
        ready = client.get("/readyz")
        assert ready.status_code == 503 and ready.json() == {"status": "not_ready"}
        assert client.get("/v1/health").json() == {"status": "ok", "nodes": 0}


def test_a_gateway_is_ready_once_a_node_is_admitted_and_not_after_it_is_evicted(sim_root) -> None:
    node = GrpcNode(RecordingNode(SimEvidence()))
    try:
        with LiveGateway(gateway_settings([node.address])) as gateway, http(gateway.url) as client:
            assert client.get("/readyz").status_code == 200
            node.servicer.serving = False
            gateway.run_round()
            assert len(gateway.runtime.pool) == 0
            assert client.get("/readyz").status_code == 503
            assert client.get("/livez").status_code == 200
    finally:
        node.stop()


def start_relay(gateway_url: str) -> LiveServer:
    settings = RelaySettings(gateway_url=gateway_url, connect_timeout_s=2.0)
    return LiveServer(create_relay_app(settings), settings.serving())


def test_a_relay_is_ready_only_while_its_gateway_is(sim_root) -> None:
    node = GrpcNode(RecordingNode(SimEvidence()))
    try:
        with LiveGateway(gateway_settings([])) as empty, start_relay(empty.url) as relay, http(relay.url) as client:
            assert client.get("/livez").status_code == 200
            assert client.get("/readyz").status_code == 503
        with LiveGateway(gateway_settings([node.address])) as gateway, start_relay(gateway.url) as relay, \
                http(relay.url) as client:
            assert client.get("/readyz").status_code == 200
    finally:
        node.stop()
    unreachable = ServerSettings().listen.replace(":0", ":9")  # the discard port: nothing listens there
    with start_relay(f"http://{unreachable}") as relay, http(relay.url) as client:
        assert client.get("/livez").status_code == 200
        assert client.get("/readyz").status_code == 503


@pytest.mark.parametrize(("not_before_offset_s", "ready"), [(-60, True), (3600, False)])
def test_an_issuer_is_ready_only_while_a_key_signs_now(tmp_path: Path, not_before_offset_s: int, ready: bool) -> None:
    add_key(tmp_path / "keys", int(time.time()) + not_before_offset_s)
    app = create_issuer_app(issuer_config([es256_account("alice")]), load_keyring(tmp_path / "keys"))
    with LiveServer(app, ServerSettings()) as issuer, http(issuer.url) as client:
        assert client.get("/livez").status_code == 200
        assert client.get("/readyz").status_code == (200 if ready else 503)
