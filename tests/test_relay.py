"""`veil relay` in front of a real gateway: what the gateway receives, streaming, bounds, and the SDK through it.

The relay and the gateway run on real uvicorn servers on loopback; the gateway
records the address and headers of every request that reaches it. Clients
connect from 127.0.0.3, so an address that reaches the gateway from them would
show. The nodes are recording gRPC nodes, and for the SDK a real tiny node.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from relay.app import RelaySettings, create_relay_app
from tests.test_gateway_support import (  # noqa: F401  (sim_root is a fixture)
    GrpcNode,
    LiveGateway,
    LiveServer,
    SimEvidence,
    candidate,
    gateway_settings,
    recording_nodes,
    sim_root,
)
from tests.conftest import HANG_S

CLIENT_ADDRESS = "127.0.0.3"
CANARY = "canary-7f3e-client-identity"
IDENTIFYING_HEADERS = {
    "user-agent": f"browser {CANARY}", "cookie": f"session={CANARY}", "x-forwarded-for": "203.0.113.9",
    "forwarded": "for=203.0.113.9", "via": f"1.1 {CANARY}", "accept-language": "fr-CH", "x-client": CANARY,
    "authorization": f"Bearer {CANARY}",
}
MAX_BODY = 64 * 1024
MAX_IN_FLIGHT = 4


@dataclass(frozen=True)
class Arrival:
    """One request as it reached the gateway: the peer address and every header."""

    peer: str
    path: str
    query: bytes
    headers: tuple[tuple[str, str], ...]

    @property
    def header_names(self) -> set[str]:
        return {name for name, _ in self.headers}


class RecordArrivals:
    """ASGI middleware in front of the gateway application that records each request's address and headers."""

    def __init__(self, app, arrivals: list[Arrival]) -> None:
        self.app = app
        self.arrivals = arrivals

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            headers = tuple((name.decode("latin-1"), value.decode("latin-1")) for name, value in scope["headers"])
            self.arrivals.append(Arrival(scope["client"][0], scope["path"], scope["query_string"], headers))
        await self.app(scope, receive, send)


class SetsCookies:
    """ASGI middleware that sets a new cookie on every answer, as a gateway tagging its clients would."""

    def __init__(self, app) -> None:
        self.app = app
        self.set = 0

    async def __call__(self, scope, receive, send) -> None:
        async def tagged(message) -> None:
            if message["type"] == "http.response.start":
                self.set += 1
                cookie = f"tag=answer-{self.set}; Path=/; Max-Age=3600".encode()
                message = {**message, "headers": [*message["headers"], (b"set-cookie", cookie)]}
            await send(message)

        await self.app(scope, receive, tagged if scope["type"] == "http" else send)


def start_gateway(nodes: list[str], arrivals: list[Arrival], *, sets_cookies: bool = False,
                  **overrides) -> LiveGateway:
    live = LiveGateway(gateway_settings(nodes, **overrides))
    if sets_cookies:
        live.app.add_middleware(SetsCookies)
    live.app.add_middleware(RecordArrivals, arrivals=arrivals)
    return live


def start_relay(gateway_url: str, **overrides) -> LiveServer:
    settings = RelaySettings(gateway_url=gateway_url, **overrides)
    return LiveServer(create_relay_app(settings), settings.serving())


def from_client(url: str) -> httpx.Client:
    """An HTTP client whose connections come from CLIENT_ADDRESS, sending nothing of httpx's own but what we set."""
    return httpx.Client(base_url=url, timeout=20.0, trust_env=False,
                        transport=httpx.HTTPTransport(local_address=CLIENT_ADDRESS))


@pytest.fixture(scope="module")
def nodes(sim_root: Path) -> Iterator[list[GrpcNode]]:
    with recording_nodes([SimEvidence(), SimEvidence()]) as started:
        yield started


@pytest.fixture(scope="module")
def arrivals() -> list[Arrival]:
    return []


@pytest.fixture(scope="module")
def gateway(nodes: list[GrpcNode], arrivals: list[Arrival]) -> Iterator[LiveGateway]:
    with start_gateway([node.address for node in nodes], arrivals) as live:
        yield live


@pytest.fixture(scope="module")
def relay(gateway: LiveGateway) -> Iterator[LiveServer]:
    with start_relay(gateway.url, max_body_bytes=MAX_BODY, max_in_flight=MAX_IN_FLIGHT) as live:
        yield live


@pytest.fixture(autouse=True)
def echoing_nodes(nodes: list[GrpcNode], arrivals: list[Arrival]) -> Iterator[None]:
    arrivals.clear()
    yield
    for node in nodes:
        node.servicer.behaviour.release.set()
        node.servicer.behaviour = type(node.servicer.behaviour)()


def infer_body(nodes: list[GrpcNode], payload: bytes, media_type: str = "message/ohttp-req") -> dict:
    return {"candidates": [candidate(node.node_id, payload, media_type) for node in nodes]}


def test_the_gateway_receives_no_client_header_or_address_only_the_relays_own(relay, gateway, nodes, arrivals) -> None:
    with from_client(relay.url) as http:
        directory = http.get("/v1/nodes?who=" + CANARY, headers=IDENTIFYING_HEADERS)
        answer = http.post("/v1/infer", json=infer_body(nodes, b"sealed"), headers=IDENTIFYING_HEADERS)
        plain = http.post(f"/v1/nodes/{nodes[0].node_id}/ohttp", content=b"plain-ohttp",
                          headers={**IDENTIFYING_HEADERS, "content-type": "Message/OHTTP-req; x=1"})
    assert directory.status_code == 200 and {node["node_id"] for node in directory.json()["nodes"]} == {
        node.node_id for node in nodes}
    assert answer.status_code == 200 and answer.content.startswith(b"sealed|")
    assert answer.headers["veil-node-id"] in {node.node_id for node in nodes}
    assert plain.status_code == 200 and plain.content == b"plain-ohttp|" + nodes[0].node_id.encode()
    assert [arrival.path for arrival in arrivals] == [
        "/v1/nodes", "/v1/infer", f"/v1/nodes/{nodes[0].node_id}/ohttp"]
    for arrival in arrivals:
        assert arrival.peer == "127.0.0.1", "the gateway saw an address other than the relay's own"
        assert arrival.query == b""
        assert CANARY not in repr(arrival.headers) and "203.0.113.9" not in repr(arrival.headers)
    assert arrivals[0].header_names == {"host"}
    assert arrivals[1].header_names == arrivals[2].header_names == {"host", "content-length", "content-type"}
    assert dict(arrivals[1].headers)["content-type"] == "application/json"
    assert dict(arrivals[2].headers)["content-type"] == "message/ohttp-req"


def test_a_privacy_pass_credential_is_the_one_client_header_passed_on(relay, nodes, arrivals) -> None:
    credential = 'PrivateToken token="AAIAAQ"'
    with from_client(relay.url) as http:
        http.post("/v1/infer", json=infer_body(nodes, b"a"), headers={"authorization": credential})
        http.post("/v1/infer", json=infer_body(nodes, b"b"), headers={"authorization": "Basic dXNlcjpwYXNz"})
    assert dict(arrivals[0].headers).get("authorization") == credential
    assert "authorization" not in arrivals[1].header_names


def test_a_chunked_answer_comes_through_the_relay_while_the_node_is_still_answering(relay, gateway, nodes) -> None:
    for node in nodes:
        node.servicer.behaviour.mode = "hold_after_first"  # sends one chunk, then holds until the call is cancelled
    cancelled_before = sum(node.servicer.cancelled for node in nodes)
    with from_client(relay.url) as http:
        with http.stream("POST", "/v1/infer", json=infer_body(nodes, b"first-chunk", "message/ohttp-chunked-req")) as answer:
            assert answer.headers["content-type"] == "message/ohttp-chunked-res"
            assert answer.headers["incremental"] == "?1"
            first = next(answer.iter_raw())
            assert first == b"first-chunk", "the relay held the first chunk back"
            assert sum(node.servicer.cancelled for node in nodes) == cancelled_before, "the node had already finished"
    # The client left: the relay ends its call to the gateway, and the gateway its call to the node.
    gateway.wait_for(lambda: sum(node.servicer.cancelled for node in nodes) == cancelled_before + 1)


def test_a_body_over_the_bound_is_413_and_never_reaches_the_gateway(relay, nodes, arrivals) -> None:
    with from_client(relay.url) as http:
        answer = http.post(f"/v1/nodes/{nodes[0].node_id}/ohttp", content=os.urandom(MAX_BODY + 1),
                           headers={"content-type": "message/ohttp-req"})
    assert answer.status_code == 413 and answer.json()["error"]["code"] == "too_large"
    assert arrivals == []


def test_requests_past_the_in_flight_bound_are_503_with_retry_after(relay, nodes) -> None:
    for node in nodes:
        node.servicer.behaviour.mode = "hold"  # holds before its first byte until released
    entered = nodes[0].servicer.entered
    while entered.acquire(blocking=False):
        pass  # forget the calls of earlier tests
    statuses: list[int] = []

    def held_request() -> None:
        with from_client(relay.url) as http:
            statuses.append(http.post("/v1/infer", json=infer_body(nodes[:1], b"held")).status_code)

    threads = [threading.Thread(target=held_request) for _ in range(MAX_IN_FLIGHT)]
    for thread in threads:
        thread.start()
    for _ in range(MAX_IN_FLIGHT):
        assert entered.acquire(timeout=10), "a held request did not reach the node"
    with from_client(relay.url) as http:
        refused = http.post("/v1/infer", json=infer_body(nodes[:1], b"one-too-many"))
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "overloaded"
    nodes[0].servicer.behaviour.release.set()
    for thread in threads:
        thread.join(HANG_S)
    assert statuses == [200] * MAX_IN_FLIGHT


@pytest.mark.parametrize(("method", "path", "headers", "status"), [
    ("GET", "/v1/health", {}, 404),
    ("GET", "/v1/attestation-key", {}, 404),
    ("POST", "/v1/nodes/register", {"content-type": "application/json"}, 404),
    ("POST", "/v1/nodes/NOT-A-NODE/ohttp", {"content-type": "message/ohttp-req"}, 404),
    ("POST", "/v1/nodes/" + "a" * 16 + "/ohttp", {"content-type": "text/plain"}, 415),
    ("POST", "/v1/infer", {"expect": "100-continue"}, 417),
    ("DELETE", "/v1/nodes", {}, 405),
])
def test_only_the_clients_routes_are_forwarded(relay, arrivals, method, path, headers, status) -> None:
    with from_client(relay.url) as http:
        answer = http.request(method, path, content=b"{}", headers=headers)
    assert answer.status_code == status and "error" in answer.json()
    assert arrivals == []


def test_an_unreachable_gateway_is_502_gateway_unreachable(nodes) -> None:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    with start_relay(f"http://127.0.0.1:{closed_port}", connect_timeout_s=2) as relay:
        with from_client(relay.url) as http:
            answer = http.post("/v1/infer", json=infer_body(nodes, b"x"))
    assert answer.status_code == 502 and answer.json()["error"]["code"] == "gateway_unreachable"
    assert str(closed_port) not in answer.text


def test_metrics_are_served_on_their_own_listener_never_on_the_public_port(gateway, nodes) -> None:
    """The public port is open to anyone: its /metrics is 404; the operator's listener serves them."""
    with start_relay(gateway.url, metrics_listen="127.0.0.1:0") as live:
        with from_client(live.url) as http:
            assert http.post("/v1/infer", json=infer_body(nodes, b"x")).status_code == 200
            public = http.get("/metrics")
        scrape = httpx.get(f"http://127.0.0.1:{live.app.state.metrics_server.port}/metrics", timeout=20,
                           trust_env=False)
    assert public.status_code == 404 and "veil_relay" not in public.text
    assert scrape.status_code == 200
    assert 'veil_relay_requests_total{route="infer",status_class="2xx"} 1.0' in scrape.text


def test_a_relay_without_a_metrics_listener_serves_no_metrics_and_a_taken_address_fails_its_start(gateway) -> None:
    import socket

    from serving.errors import SettingsError

    with start_relay(gateway.url) as live, from_client(live.url) as http:
        assert live.app.state.metrics_server is None and http.get("/metrics").status_code == 404
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        with pytest.raises(SettingsError, match="cannot serve metrics on"):
            create_relay_app(RelaySettings(gateway_url=gateway.url, metrics_listen=address))


def test_the_relay_sends_no_cookie_the_gateway_set_and_passes_none_on(nodes) -> None:
    """A cookie set on one client's answer must never come back with a later request, whoever sends it."""
    cookie_arrivals: list[Arrival] = []
    with start_gateway([node.address for node in nodes], cookie_arrivals, sets_cookies=True) as live_gateway:
        with start_relay(live_gateway.url) as live_relay:
            answers = []
            for _ in range(2):  # two clients, one after the other, each on connections of its own
                with from_client(live_relay.url) as http:
                    answers.append(http.get("/v1/nodes"))
                    answers.append(http.post("/v1/infer", json=infer_body(nodes, b"sealed")))
                    answers.append(http.post(f"/v1/nodes/{nodes[0].node_id}/attest", json={"nonce": "00" * 32}))
    assert [answer.status_code for answer in answers[:2]] == [200, 200]
    assert len(cookie_arrivals) == 6, "a request did not reach the gateway"
    assert [arrival for arrival in cookie_arrivals if "cookie" in arrival.header_names] == []
    assert all("set-cookie" not in answer.headers for answer in answers)


@pytest.mark.parametrize("url", ["127.0.0.1:8000", "ftp://gateway", "http://", "http://gw/?a=1", "http://gw/#x"])
def test_the_gateway_url_must_be_http_or_https_to_a_host(url: str) -> None:
    from serving.errors import SettingsError

    with pytest.raises(SettingsError):
        RelaySettings(gateway_url=url)


@pytest.fixture(scope="module")
def real_fleet(sim_root: Path, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[tuple[LiveServer, LiveGateway, list[Arrival]]]:
    """A real tiny node behind a recording gateway (that sets a cookie on every answer) behind a relay."""
    from engine.tiny import write_tiny_model
    from tests.test_gateway_node import start_node

    node = start_node(write_tiny_model(tmp_path_factory.mktemp("model") / "tiny"))
    real_arrivals: list[Arrival] = []
    try:
        with start_gateway([f"127.0.0.1:{node.port}"], real_arrivals, sets_cookies=True) as live_gateway:
            with start_relay(live_gateway.url) as live_relay:
                yield live_relay, live_gateway, real_arrivals
    finally:
        node.stop(grace=0)


def test_the_sdk_works_through_the_relay_and_the_gateway_sees_only_the_relay(real_fleet) -> None:
    from client.sdk import Client

    relay_server, _, real_arrivals = real_fleet
    http = httpx.Client(base_url=relay_server.url, timeout=60.0, trust_env=False,
                        transport=httpx.HTTPTransport(local_address=CLIENT_ADDRESS))
    with Client(relay_server.url, policy="dev", fresh_evidence=True, http=http) as sdk:
        chunks = list(sdk.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}],
                                                  max_tokens=6, seed=3, stream=True))
        route = sdk.last_route
    assert chunks and route is not None and all(record.ok for record in route.candidates)
    paths = [arrival.path for arrival in real_arrivals]
    assert "/v1/nodes" in paths and "/v1/infer" in paths and any(path.endswith("/attest") for path in paths)
    assert all(arrival.peer == "127.0.0.1" for arrival in real_arrivals)
    assert all(arrival.header_names <= {"host", "content-length", "content-type"} for arrival in real_arrivals)


def test_the_sdk_sends_no_cookie_a_gateway_set_on_an_earlier_answer(real_fleet) -> None:
    """Straight to a gateway that sets cookies: sent back, one would link the client's requests."""
    from client.sdk import Client

    _, gateway_server, real_arrivals = real_fleet
    seen_before = len(real_arrivals)
    with Client(gateway_server.url, policy="dev", fresh_evidence=True, directory_ttl_s=0) as sdk:
        for _ in range(2):
            sdk.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    ours = real_arrivals[seen_before:]
    assert [arrival.path for arrival in ours].count("/v1/infer") == 2
    assert [arrival.path for arrival in ours if "cookie" in arrival.header_names] == []


def test_a_relay_only_gateway_refuses_direct_clients_and_serves_its_relay(nodes) -> None:
    received_before = sum(len(node.servicer.received) for node in nodes)
    node_id = nodes[0].node_id
    with start_gateway([node.address for node in nodes], [], relay_only=("127.0.0.0/31",)) as live_gateway:
        with from_client(live_gateway.url) as direct:
            refused = [
                direct.post("/v1/infer", json=infer_body(nodes, b"direct")),
                direct.post(f"/v1/nodes/{node_id}/ohttp", content=b"direct", headers={"content-type": "message/ohttp-req"}),
                direct.post(f"/v1/nodes/{node_id}/attest", json={"nonce": "00" * 32}),
            ]
            directory = direct.get("/v1/nodes")
        with start_relay(live_gateway.url) as live_relay, from_client(live_relay.url) as through:
            relayed = through.post("/v1/infer", json=infer_body(nodes, b"relayed"))
    assert [(answer.status_code, answer.json()["error"]["code"]) for answer in refused] == [(403, "relay_only")] * 3
    assert directory.status_code == 200
    assert relayed.status_code == 200 and relayed.content.startswith(b"relayed|")
    assert sum(len(node.servicer.received) for node in nodes) == received_before + 1, "a direct request reached a node"


@pytest.mark.parametrize("relay", ["relay.example.org", "127.0.0.1:8080", "10.0.0.0/33"])
def test_relay_only_takes_ip_addresses_or_networks_not_host_names(relay: str) -> None:
    from gateway.errors import GatewaySettingsError
    from gateway.settings import GatewaySettings

    with pytest.raises(GatewaySettingsError) as raised:
        GatewaySettings(relay_only=(relay,))
    assert relay not in raised.value.message


def test_veil_relay_serves_logs_no_client_and_stops_cleanly(gateway, nodes, tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys
    import time

    repo = Path(__file__).resolve().parents[1]
    port_file = tmp_path / "relay.port"
    process = subprocess.Popen(
        [sys.executable, "-m", "veil", "relay", "--gateway", gateway.url, "--listen", "127.0.0.1:0",
         "--port-file", str(port_file), "--metrics-listen", "127.0.0.1:0"], cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + HANG_S
        while not port_file.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        with from_client(f"http://127.0.0.1:{port_file.read_text().strip()}") as http:
            answer = http.post("/v1/infer", json=infer_body(nodes, CANARY.encode()), headers=IDENTIFYING_HEADERS)
            missing = http.get(f"/{CANARY}")
        assert answer.status_code == 200 and answer.content.startswith(CANARY.encode())
        assert missing.status_code == 404
    finally:
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=HANG_S)
    assert process.returncode == 0
    assert "veil relay: serving on 127.0.0.1:" in err and "veil relay: metrics on 127.0.0.1:" in err
    assert CANARY not in out + err and CLIENT_ADDRESS not in out + err and "POST" not in out + err


def test_veil_relay_refuses_a_bad_gateway_url_with_status_2() -> None:
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-m", "veil", "relay", "--gateway", "gateway.example:8000"],
                          cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)}, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "veil relay: cannot start: the gateway URL must look like" in done.stderr
