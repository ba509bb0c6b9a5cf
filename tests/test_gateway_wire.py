"""The gateway below its REST API, on raw sockets against a real uvicorn server.

What an HTTP client library never sends: an `Expect: 100-continue` on an OHTTP request (refused
with 417 before a byte of the body is read), and connections that send their head or body byte by
byte (closed within the configured timeouts while every other client is still served).
"""

from __future__ import annotations

import random
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

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

HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 1.5
# How long past its timeout a slow connection may stay open. The test notices a close only between
# rounds of 64 drips and two requests, which a loaded machine can stretch to seconds; a connection the
# gateway never closed would still drip past 30 s, so this bound tells the two apart on any machine.
SLACK_S = 30.0


@pytest.fixture(scope="module")
def node(sim_root: Path) -> Iterator[GrpcNode]:
    started = GrpcNode(RecordingNode(SimEvidence()))
    yield started
    started.stop()


@pytest.fixture(scope="module")
def gateway(node: GrpcNode) -> Iterator[LiveGateway]:
    settings = gateway_settings([node.address], header_timeout_s=HEADER_TIMEOUT_S, body_timeout_s=BODY_TIMEOUT_S)
    with LiveGateway(settings, rng=random.Random(3)) as live:
        yield live


def read_head(connection: socket.socket) -> bytes:
    """Everything up to the end of the first response head the server sends (or until it closes)."""
    received = bytearray()
    while b"\r\n\r\n" not in received:
        chunk = connection.recv(4096)
        if not chunk:
            break
        received += chunk
    return bytes(received)


@pytest.mark.parametrize("route", ["infer", "ohttp"])
def test_an_ohttp_request_expecting_100_continue_is_refused_with_417_before_its_body(gateway, node, route) -> None:
    path, media_type = ("/v1/infer", "application/json") if route == "infer" else \
        (f"/v1/nodes/{node.node_id}/ohttp", "message/ohttp-req")
    head = (f"POST {path} HTTP/1.1\r\nHost: veil\r\nContent-Type: {media_type}\r\nContent-Length: 64\r\n"
            "Expect: 100-continue\r\n\r\n").encode()
    before = len(node.servicer.received)
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=10) as connection:
        connection.sendall(head)  # and no body: a client expecting 100 waits for it
        reply = read_head(connection)
    assert reply.startswith(b"HTTP/1.1 417 "), reply[:40]
    assert b"100 Continue" not in reply
    assert len(node.servicer.received) == before
    with client(gateway.url) as http:  # the same request without the expectation is served
        answer = http.post(f"/v1/nodes/{node.node_id}/ohttp", content=b"x" * 64,
                           headers={"content-type": "message/ohttp-req"})
    assert answer.status_code == 200


class SlowClient:
    """One raw connection that sends `opening` and then one more byte of `drip` per tick, forever."""

    def __init__(self, port: int, opening: bytes, drip: bytes, timeout_s: float) -> None:
        self.connection = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.connection.setblocking(False)
        self.connection.sendall(opening)
        self.drip = drip
        self.deadline = time.monotonic() + timeout_s + SLACK_S
        self.reply = bytearray()
        self.closed_at: float | None = None

    def tick(self) -> None:
        """Send one more byte and read what came back; note when the server closed the connection."""
        if self.closed_at is not None:
            return
        try:
            while chunk := self.connection.recv(4096):
                self.reply += chunk
            self._closed()  # an empty read: the server closed it
        except BlockingIOError:
            try:
                self.connection.send(self.drip)
            except OSError:
                self._closed()
        except OSError:
            self._closed()

    def _closed(self) -> None:
        self.closed_at = time.monotonic()
        self.connection.close()


def test_slow_heads_and_bodies_are_closed_within_their_timeouts_while_others_are_served(gateway, node) -> None:
    slow_head = b"POST /v1/infer HTTP/1.1\r\nHost: veil\r\nX-Padding: "
    slow_body = (f"POST /v1/nodes/{node.node_id}/ohttp HTTP/1.1\r\nHost: veil\r\n"
                 "Content-Type: message/ohttp-req\r\nContent-Length: 100000\r\n\r\n").encode()
    clients = [SlowClient(gateway.port, slow_head, b"a", HEADER_TIMEOUT_S) for _ in range(48)]
    clients += [SlowClient(gateway.port, slow_body, b"b", BODY_TIMEOUT_S) for _ in range(16)]
    served: list[int] = []
    with client(gateway.url) as http:
        while any(slow.closed_at is None for slow in clients) and time.monotonic() < clients[-1].deadline:
            for slow in clients:
                slow.tick()
            served.append(http.get("/v1/health").status_code)
            served.append(http.post(f"/v1/nodes/{node.node_id}/ohttp", content=b"sealed",
                                    headers={"content-type": "message/ohttp-req"}).status_code)
            threading.Event().wait(0.1)
    still_open = [slow for slow in clients if slow.closed_at is None]
    for slow in still_open:
        slow.connection.close()
    assert not still_open, f"{len(still_open)} slow connections were still open past their timeouts"
    assert all(slow.closed_at <= slow.deadline for slow in clients)
    answered = [bytes(slow.reply) for slow in clients if slow.reply]
    assert answered and all(reply.startswith(b"HTTP/1.1 408 ") for reply in answered)
    assert served and set(served) == {200}  # everyone else was served all along


@pytest.fixture(scope="module")
def capped_gateway(node: GrpcNode) -> Iterator[LiveGateway]:
    settings = gateway_settings([node.address], header_timeout_s=HEADER_TIMEOUT_S, max_connections=8)
    with LiveGateway(settings) as live:
        yield live


def test_past_the_connection_cap_requests_get_503_until_idle_connections_time_out(capped_gateway) -> None:
    idle = [socket.create_connection(("127.0.0.1", capped_gateway.port), timeout=10) for _ in range(8)]
    try:
        threading.Event().wait(0.2)  # the server has accepted them
        with client(capped_gateway.url) as http:
            assert http.get("/v1/health").status_code == 503
        for connection in idle:  # the head timeout closes each idle connection
            assert read_head(connection).startswith(b"HTTP/1.1 408 ")
        with client(capped_gateway.url) as http:
            assert http.get("/v1/health").status_code == 200
    finally:
        for connection in idle:
            connection.close()
