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
# How long past its timeout a slow connection may stay open: scheduling on a busy machine, never more.
SLACK_S = 5.0


@pytest.fixture(scope="module")
def node(sim_root: Path) -> Iterator[GrpcNode]:
    started = GrpcNode(RecordingNode(SimEvidence()))
    yield started
    started.stop()


@pytest.fixture(scope="module")
def gateway(node: GrpcNode) -> Iterator[LiveGateway]:
    settings = gateway_settings([node.address])
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
