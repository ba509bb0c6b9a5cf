"""Hostile input against the gateway's HTTP surface, on a real uvicorn server in front of real nodes.

Malformed, truncated, oversized and replayed bodies; wrong types, methods, paths,
media types and headers; garbage on the wire below HTTP. The contract: no 500 (a
5xx only as the deliberate 502 `node_failed` / 503 `overloaded` with the JSON error
body), every error in the `{"error": {"code", "message"}}` shape, no byte of the
request in any answer's body or headers, no unhandled exception in the server, no
node evicted by a client's bad input — and, every few fuzz cases, a well-formed
request through the SDK still gets the right answer.

Bounded by default (40 examples per property); for a longer barrage:

    VEIL_FUZZ_EXAMPLES=2000 .venv/bin/python -m pytest tests/test_hardening_gateway.py
"""

from __future__ import annotations

import base64
import json
import logging
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from client.sdk import Client
from engine.tiny import write_tiny_model
from ohttp.keys import KeyConfig
from ohttp.media_types import OHTTP_CHUNKED_REQUEST, OHTTP_REQUEST
from protocol.constants import MAX_ENCAPSULATED_BYTES
from tests.hardening_support import (
    CANARY,
    CANARY_BYTES,
    MODEL_NAME,
    Heartbeat,
    Sealed,
    assert_error_shape,
    assert_no_canary,
    canary_text,
    chat_body,
    chat_text,
    fuzz_settings,
    inner_request,
    mutate,
    mutations,
    reference_text,
    seal,
    start_node,
    streamed_text,
    with_canary,
)
from tests.conftest import HANG_S
from tests.test_gateway_support import LiveGateway, gateway_settings, sim_root  # noqa: F401  (sim_root: a fixture)

_MiB = 1 << 20
CHAT = "/v1/chat/completions"
# The deliberate 5xx answers of the contract; any other 5xx is a failure.
DELIBERATE_5XX = {(502, "node_failed"), (503, "overloaded")}
# What a ciphertext the node cannot open gets (RFC 9458 section 5.2: a 4xx, never the node's failure).
UNOPENED = {"undecryptable", "unknown_key"}
H11_HEAD_BOUND = 16 * 1024
MEDIA_TYPE_VARIANTS = ["", "MESSAGE/OHTTP-REQ", "message/ohttp-req; x=1", "message/ohttp-res", "application/json",
                       "text/plain", "multipart/form-data; boundary=" + CANARY, CANARY, "message/ohttp-chunked-res"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="module")
def nodes(sim_root: Path, model_dir: Path):  # noqa: F811
    started = [start_node(model_dir) for _ in range(2)]
    yield started
    for node in started:
        node.stop(grace=0)


@pytest.fixture(scope="module")
def gateway(nodes) -> Iterator[LiveGateway]:
    with LiveGateway(gateway_settings([f"127.0.0.1:{node.port}" for node in nodes])) as live:
        yield live


@pytest.fixture(scope="module")
def http(gateway) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway.url, timeout=60.0, trust_env=False) as session:
        yield session


@pytest.fixture(scope="module")
def sdk(gateway) -> Iterator[Client]:
    with Client(gateway.url, policy="dev", candidates=2) as veil:
        yield veil


def sdk_chat(sdk: Client) -> str:
    body = chat_body()
    answer = sdk.chat.completions.create(model=MODEL_NAME, messages=body["messages"], max_tokens=body["max_tokens"],
                                         temperature=body["temperature"], seed=body["seed"])
    return answer.choices[0].message.content


@pytest.fixture(scope="module")
def baseline(sdk, model_dir: Path) -> str:
    """The correct answer to one seeded request, as the SDK gets it before any hostile input."""
    text = reference_text(model_dir, chat_body())
    assert text and sdk_chat(sdk) == text
    return text


@pytest.fixture(scope="module")
def heartbeat(gateway, nodes, sdk, baseline) -> Heartbeat:
    def check() -> None:
        assert sdk_chat(sdk) == baseline
        assert {entry.node_id for entry in gateway.runtime.pool.entries()} >= {node.node_id for node in nodes}

    return Heartbeat(check)


class ErrorLog(logging.Handler):
    """Collects what the server logs at ERROR: an unhandled exception in the app shows up here."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(scope="module")
def server_errors(gateway) -> Iterator[ErrorLog]:
    handler = ErrorLog()
    logger = logging.getLogger("uvicorn.error")
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)


@pytest.fixture(autouse=True)
def no_crash_and_still_serving(request: pytest.FixtureRequest, server_errors: ErrorLog):
    """After every test: nothing unhandled in the server, and a well-formed request still served right."""
    server_errors.records.clear()
    yield
    assert [record.getMessage() for record in server_errors.records] == []
    if "heartbeat" in request.fixturenames:
        request.getfixturevalue("heartbeat").check()


def assert_refused(answer: httpx.Response, *statuses: int) -> dict:
    """A contract error: one of `statuses` (or a deliberate 5xx), the JSON shape, nothing of the request."""
    assert_no_canary(answer.content, *answer.headers.values(), *answer.headers.keys())
    assert answer.status_code != 200
    error = assert_error_shape(answer.content)
    if answer.status_code >= 500:
        assert (answer.status_code, error["code"]) in DELIBERATE_5XX
        if answer.status_code == 503:
            assert answer.headers["retry-after"].isdigit()
    else:
        assert answer.status_code in statuses, (answer.status_code, error["code"])
    return error


def key_configs(http: httpx.Client) -> dict[str, KeyConfig]:
    nodes = http.get("/v1/nodes").json()["nodes"]
    return {entry["node_id"]: KeyConfig.decode(base64.b64decode(entry["key_config"])) for entry in nodes}


def candidate(node_id: object, media_type: object, encapsulated: object) -> dict[str, object]:
    return {"node_id": node_id, "media_type": media_type, "encapsulated": encapsulated}


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def post_infer(http: httpx.Client, *candidates: dict) -> httpx.Response:
    return http.post("/v1/infer", json={"candidates": list(candidates)})


def post_ohttp(http: httpx.Client, node_id: str, media_type: str, body: bytes) -> httpx.Response:
    return http.post(f"/v1/nodes/{node_id}/ohttp", content=body, headers={"content-type": media_type})


# ----- /v1/infer: bodies ----------------------------------------------------------------------------


@fuzz_settings()
@given(body=with_canary(400) | st.binary(max_size=64),
       content_type=st.sampled_from(["application/json", *MEDIA_TYPE_VARIANTS]))
def test_arbitrary_bytes_posted_to_infer_are_a_fixed_400(http, heartbeat, body: bytes, content_type: str) -> None:
    heartbeat.beat()
    answer = http.post("/v1/infer", content=body, headers={"content-type": content_type})
    assert assert_refused(answer, 400)["code"] == "malformed"


hex_ids = st.text("0123456789abcdef", min_size=16, max_size=64)
node_ids = st.sampled_from(["<node 0>", "<node 1>"]) | hex_ids | canary_text() | st.integers() | st.none()
media_types = st.sampled_from([OHTTP_REQUEST, OHTTP_CHUNKED_REQUEST, *MEDIA_TYPE_VARIANTS]) | st.integers()
ciphertexts = (with_canary(120).map(b64) | canary_text() | st.just("") | st.just("====") | st.integers()
               | with_canary(60).map(lambda data: " " + b64(data) + "\n")
               | with_canary(60).map(lambda data: b64(data)[:-1]))
candidates = st.fixed_dictionaries({"node_id": node_ids, "media_type": media_types, "encapsulated": ciphertexts},
                                   optional={CANARY: canary_text()})
bodies = (st.fixed_dictionaries({"candidates": st.lists(candidates, max_size=10)}, optional={CANARY: canary_text()})
          | st.fixed_dictionaries({"candidates": canary_text() | st.integers() | st.none()})
          | st.lists(candidates, max_size=3) | canary_text())


@fuzz_settings()
@given(body=bodies)
def test_infer_bodies_of_wrong_shapes_and_types_are_refused(http, nodes, heartbeat, body: object) -> None:
    heartbeat.beat()
    real_ids = {f"<node {index}>": node.node_id for index, node in enumerate(nodes)}
    text = json.dumps(body)
    for placeholder, node_id in real_ids.items():
        text = text.replace(placeholder, node_id)
    answer = http.post("/v1/infer", content=text.encode(), headers={"content-type": "application/json"})
    assert_refused(answer, 400, 404)


@pytest.mark.parametrize("content", [
    b"[" * 200_000,
    b'{"candidates": [' * 50_000,
    b'{"candidates": ' + b"9" * 100_000 + b"}",
    b'{"candidates": [], "candidates": [{"node_id": "' + CANARY_BYTES + b'"}]}',
    b'{"candidates": [{"node_id": "\\ud800' + CANARY_BYTES +
    b'", "media_type": "message/ohttp-req", "encapsulated": "AA=="}]}',
    b'\xef\xbb\xbf{"candidates": []}' + CANARY_BYTES,
    b'{"candidates": [{"node_id": "' + b"a" * 32 + b'", "media_type": "message/ohttp-req", "encapsulated": "' +
    base64.b64encode(CANARY_BYTES) + b'=" }]}',
    json.dumps({"candidates": [candidate(f"{index:032x}", OHTTP_REQUEST, b64(CANARY_BYTES))
                               for index in range(9)]}).encode(),
    json.dumps({"candidates": [candidate("b" * 32, OHTTP_REQUEST, b64(CANARY_BYTES))] * 2}).encode(),
    json.dumps({"candidates": [candidate("c" * 65, OHTTP_REQUEST, b64(CANARY_BYTES))]}).encode(),
    json.dumps({"candidates": [candidate("C" * 32, OHTTP_REQUEST, b64(CANARY_BYTES))]}).encode(),
], ids=["deep-array", "deep-candidates", "huge-number", "duplicate-keys", "lone-surrogate", "bom", "bad-padding",
        "nine-candidates", "repeated-node", "long-id", "upper-case-id"])
def test_hand_written_malformed_infer_bodies_are_a_fixed_400(http, heartbeat, content: bytes) -> None:
    answer = http.post("/v1/infer", content=content, headers={"content-type": "application/json"})
    assert assert_refused(answer, 400)["code"] == "malformed"


def test_unknown_nodes_are_a_404_that_names_none_of_them(http, heartbeat) -> None:
    fake = [f"{CANARY.lower()[6:]}{index:04x}".ljust(32, "0") for index in range(3)]
    answer = post_infer(http, *(candidate(node_id, OHTTP_REQUEST, b64(CANARY_BYTES)) for node_id in fake))
    assert assert_refused(answer, 404)["code"] == "no_candidate"
    for node_id in fake:
        assert node_id not in answer.text


# ----- real ciphertexts: garbage, mangled, replayed -------------------------------------------------


@fuzz_settings()
@given(garbage=with_canary(300), node_index=st.integers(0, 1),
       media_type=st.sampled_from([OHTTP_REQUEST, OHTTP_CHUNKED_REQUEST]), raw_route=st.booleans())
def test_garbage_ciphertext_for_a_real_node_is_a_400_and_never_evicts_it(
        http, nodes, gateway, heartbeat, garbage: bytes, node_index: int, media_type: str, raw_route: bool) -> None:
    heartbeat.beat()
    node_id = nodes[node_index].node_id
    answer = post_ohttp(http, node_id, media_type, garbage) if raw_route else \
        post_infer(http, candidate(node_id, media_type, b64(garbage)))
    assert assert_refused(answer, 400)["code"] in UNOPENED
    assert gateway.runtime.pool.lookup(node_id) is not None


@fuzz_settings()
@given(mutation=mutations, chunked=st.booleans(), node_index=st.integers(0, 1), raw_route=st.booleans())
def test_truncated_or_flipped_real_ciphertexts_are_a_400(
        http, nodes, gateway, heartbeat, mutation: tuple, chunked: bool, node_index: int, raw_route: bool) -> None:
    heartbeat.beat()
    node_id = nodes[node_index].node_id
    sealed = seal(key_configs(http)[node_id], inner_request(CHAT, chat_body(content=CANARY)), chunked)
    mangled = mutate(sealed.encapsulated, mutation)
    if not mangled:
        return  # an empty body is a different case (a 400), covered below
    answer = post_ohttp(http, node_id, sealed.media_type, mangled) if raw_route else \
        post_infer(http, candidate(node_id, sealed.media_type, b64(mangled)))
    assert assert_refused(answer, 400)["code"] in UNOPENED
    assert gateway.runtime.pool.lookup(node_id) is not None


@pytest.mark.parametrize("raw_route", [False, True], ids=["infer", "ohttp"])
@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
def test_a_retired_key_id_is_400_unknown_key_and_a_forged_tag_400_undecryptable(
        http, nodes, gateway, heartbeat, chunked: bool, raw_route: bool) -> None:
    node_id = nodes[0].node_id
    sealed = seal(key_configs(http)[node_id], inner_request(CHAT, chat_body(content=CANARY)), chunked)
    other_key = bytes([(sealed.encapsulated[0] + 128) % 256]) + sealed.encapsulated[1:]
    forged_tag = sealed.encapsulated[:-1] + bytes([sealed.encapsulated[-1] ^ 1])
    for mangled, code in ((other_key, "unknown_key"), (forged_tag, "undecryptable")):
        answer = post_ohttp(http, node_id, sealed.media_type, mangled) if raw_route else \
            post_infer(http, candidate(node_id, sealed.media_type, b64(mangled)))
        assert assert_refused(answer, 400)["code"] == code
    assert gateway.runtime.pool.lookup(node_id) is not None


@pytest.mark.parametrize("raw_route", [False, True], ids=["infer", "ohttp"])
@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
def test_a_replayed_ciphertext_is_served_again_and_only_its_sender_can_read_either_answer(
        http, nodes, baseline, heartbeat, chunked: bool, raw_route: bool) -> None:
    """OHTTP has no replay protection, and neither the gateway nor the node adds one: a replay is served.

    The gateway cannot tell a replay from a retry (it never sees plaintext). What holds is
    that each answer is sealed under a fresh response nonce, so the two ciphertexts differ,
    and both open only with the original sender's context.
    """
    node_id = nodes[0].node_id
    sealed = seal(key_configs(http)[node_id], inner_request(CHAT, chat_body(stream=chunked)), chunked)
    send = (lambda: post_ohttp(http, node_id, sealed.media_type, sealed.encapsulated)) if raw_route else \
        (lambda: post_infer(http, candidate(node_id, sealed.media_type, b64(sealed.encapsulated))))
    first, replay = send(), send()
    assert first.status_code == replay.status_code == 200
    assert first.headers["veil-node-id"] == replay.headers["veil-node-id"] == node_id
    assert first.content != replay.content
    assert [answer_text(sealed, answer.content, chunked) for answer in (first, replay)] == [baseline, baseline]


def answer_text(sealed: Sealed, data: bytes, chunked: bool) -> str:
    return (streamed_text if chunked else chat_text)(sealed.open(data))


# ----- bounds -----------------------------------------------------------------------------------


def test_the_gateway_bounds_one_ciphertext_as_the_node_does(http, nodes, heartbeat) -> None:
    """A ciphertext at the bound reaches the node, which opens nothing and says so; one byte more is 413."""
    at_bound = (CANARY_BYTES * (MAX_ENCAPSULATED_BYTES // len(CANARY_BYTES) + 1))[:MAX_ENCAPSULATED_BYTES]
    forwarded = post_ohttp(http, nodes[0].node_id, OHTTP_REQUEST, at_bound)
    assert forwarded.status_code == 400 and assert_refused(forwarded, 400)["code"] in UNOPENED
    over = post_ohttp(http, nodes[0].node_id, OHTTP_REQUEST, at_bound + CANARY_BYTES[:1])
    assert assert_refused(over, 413)["code"] == "too_large"


def test_bodies_over_the_bounds_are_413_never_5xx(http, gateway, nodes, heartbeat) -> None:
    limit = gateway.runtime.settings.max_body_bytes
    node_id = nodes[0].node_id
    over_body = CANARY_BYTES * (limit // len(CANARY_BYTES) + 1)
    one_big_ciphertext = CANARY_BYTES * (MAX_ENCAPSULATED_BYTES // len(CANARY_BYTES) + 1)
    answers = [
        http.post("/v1/infer", content=over_body),
        http.post("/v1/infer", content=iter([over_body[:limit], over_body[limit:]])),  # chunked upload, no length
        post_infer(http, candidate(node_id, OHTTP_REQUEST, b64(one_big_ciphertext))),
        post_ohttp(http, node_id, OHTTP_REQUEST, one_big_ciphertext),
        post_ohttp(http, node_id, OHTTP_CHUNKED_REQUEST, over_body),
    ]
    for answer in answers:
        assert assert_refused(answer, 413)["code"] == "too_large"


@pytest.mark.parametrize("length", ["-1", "1e9", "0x10", " 12", "99999999999999999999999", CANARY])
def test_odd_content_lengths_are_refused_without_a_crash(gateway, heartbeat, length: str) -> None:
    reply = raw_exchange(gateway.port, b"POST /v1/infer HTTP/1.1\r\nHost: veil\r\nContent-Length: " +
                         length.encode() + b"\r\n\r\n{}")
    assert_wire_refusal(reply)


# ----- methods, paths, media types, headers ----------------------------------------------------------


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", CANARY])
@pytest.mark.parametrize("path", ["/v1/infer", "/v1/nodes", "/v1/health", "/v1/nodes/register",
                                  f"/v1/nodes/{'a' * 32}/ohttp"])
def test_wrong_methods_get_a_fixed_405_or_404(http, method: str, path: str) -> None:
    if method == "GET" and path in ("/v1/nodes", "/v1/health"):
        return  # those are the right method
    answer = http.request(method, path, content=CANARY_BYTES)
    assert_refused(answer, 404, 405)


@pytest.mark.parametrize("path", [
    "/" + CANARY, "/v1/" + CANARY, "/v1/%00" + CANARY, "/v1/nodes/" + CANARY, "/v1/infer/" + CANARY,
    "/v1/%2e%2e/" + CANARY, "/v1/" + CANARY * 2000, "/v1/nodés/" + CANARY, "//v1//infer" + CANARY,
    "/v1/nodes/%2F" + CANARY + "/ohttp",
])
def test_odd_paths_get_a_fixed_404(http, heartbeat, path: str) -> None:
    assert_refused(http.post(path, content=CANARY_BYTES), 404, 405)
    assert_refused(http.get(path), 404, 405)


@fuzz_settings()
@given(content_type=canary_text() | st.sampled_from(MEDIA_TYPE_VARIANTS), body=with_canary(64))
def test_the_ohttp_route_refuses_other_media_types_with_415(http, nodes, heartbeat, content_type: str,
                                                            body: bytes) -> None:
    heartbeat.beat()
    try:
        answer = post_ohttp(http, nodes[0].node_id, content_type, body)
    except (UnicodeEncodeError, httpx.LocalProtocolError):
        return  # not a header value an HTTP client can send at all
    # Media types are case-insensitive and may carry parameters: those name an OHTTP request and are forwarded.
    forwarded = content_type.split(";", 1)[0].strip().lower() in (OHTTP_REQUEST, OHTTP_CHUNKED_REQUEST)
    code = assert_refused(answer, 400, 415)["code"]
    if forwarded:
        assert answer.status_code == 400 and code in UNOPENED
    else:
        assert (answer.status_code, code) == (415, "unsupported_media_type")


@pytest.mark.parametrize("node_id", [CANARY, "a" * 65, "A" * 32, "0" * 15, "%00" + CANARY])
def test_the_ohttp_route_refuses_what_is_not_a_node_id(http, heartbeat, node_id: str) -> None:
    assert_refused(post_ohttp(http, node_id, OHTTP_REQUEST, CANARY_BYTES), 400, 404)


def test_the_ohttp_route_refuses_an_empty_body(http, nodes, heartbeat) -> None:
    assert assert_refused(post_ohttp(http, nodes[0].node_id, OHTTP_REQUEST, b""), 400)["code"] == "malformed"


@pytest.mark.parametrize("headers", [
    {"x-veil-big": CANARY * 10_000},
    {f"x-{CANARY.lower()}-{index}": CANARY for index in range(500)},
    {"content-type": "application/json; charset=" + CANARY, "accept": CANARY, "cookie": CANARY},
    {"authorization": "PrivateToken token=" + CANARY, "x-forwarded-for": CANARY, "forwarded": CANARY},
], ids=["one-huge", "many", "odd-types", "identity"])
def test_oversized_or_odd_headers_change_nothing(gateway, nodes, heartbeat, headers: dict[str, str]) -> None:
    head_bytes = sum(len(name) + len(value) + 4 for name, value in headers.items())
    for method, path in (("GET", "/v1/health"), ("POST", "/v1/infer")):
        with httpx.Client(base_url=gateway.url, timeout=60.0, trust_env=False) as fresh:
            try:
                answer = fresh.request(method, path, content=b"{" + CANARY_BYTES, headers=headers)
            except (httpx.ReadError, httpx.RemoteProtocolError):
                # Over h11's 16 KiB bound the server refuses the head and closes before reading the
                # body, so the client may see a reset instead of uvicorn's 400.
                assert head_bytes > H11_HEAD_BOUND
                continue
        assert_no_canary(answer.content, *answer.headers.values(), *answer.headers.keys())
        assert answer.status_code < 500
        if answer.status_code != 200 and answer.headers.get("content-type") == "application/json":
            assert_error_shape(answer.content)


def test_registration_is_not_served_when_it_is_off(http, heartbeat) -> None:
    for body in (json.dumps({"address": CANARY + ":1"}).encode(), CANARY_BYTES, b""):
        assert assert_refused(http.post("/v1/nodes/register", content=body), 404)["code"] == "not_found"


# ----- below HTTP: bytes on the socket --------------------------------------------------------------


def raw_exchange(port: int, data: bytes, *, half_close: bool = True) -> bytes:
    """Send `data` on a fresh connection and return everything the server answers until it closes."""
    received = bytearray()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as connection:
        try:
            connection.sendall(data)
            if half_close:
                connection.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the server may answer and close before it has read everything (a huge head)
        try:
            while chunk := connection.recv(65536):
                received += chunk
        except (TimeoutError, ConnectionResetError):
            pass
    # The server may log a failure only after it closed the connection; give it that moment.
    threading.Event().wait(0.2)
    return bytes(received)


def assert_wire_refusal(reply: bytes) -> None:
    """Whatever the server answered to bytes that are not valid HTTP: no 5xx, nothing reflected."""
    assert_no_canary(reply)
    if reply:
        status = int(reply.split(b" ", 2)[1])
        assert 400 <= status < 500, status


@pytest.mark.parametrize("data", [
    b"\x16\x03\x01\x02\x00" + CANARY_BYTES + b"\r\n\r\n",
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + CANARY_BYTES,
    CANARY_BYTES + b" /v1/health HTTP/1.1\r\nHost: veil\r\n\r\n",
    b"GET /" + CANARY_BYTES + b" HTTP/9.9\r\nHost: veil\r\n\r\n",
    b"GET /v1/health HTTP/1.1\r\nHost: veil\r\nX-Canary: \x00" + CANARY_BYTES + b"\r\n\r\n",
    b"GET /v1/health HTTP/1.1\r\nHost: veil\r\n" + CANARY_BYTES + b"\r\n\r\n",
    b"POST /v1/infer HTTP/1.1\r\nHost: veil\r\nTransfer-Encoding: chunked\r\n\r\nZZ\r\n" + CANARY_BYTES +
    b"\r\n0\r\n\r\n",
    b"POST /v1/infer HTTP/1.1\r\nHost: veil\r\nTransfer-Encoding: chunked\r\nContent-Length: 4\r\n\r\n" + CANARY_BYTES,
    b"POST /v1/infer HTTP/1.1\r\nHost: veil\r\nContent-Length: 1000\r\n\r\n{\"candidates\": \"" + CANARY_BYTES,
    b"POST /v1/infer HTTP/1.1\r\nHost: veil\r\nTransfer-Encoding: chunked\r\n\r\n10\r\n" + CANARY_BYTES[:16],
    b"GET /v1/health HTTP/1.1\r\nHost: veil\r\nX-Long: " + CANARY_BYTES * 20_000 + b"\r\n\r\n",
], ids=["tls-hello", "http2-preface", "bad-method", "bad-version", "nul-in-header", "bad-header-line",
        "bad-chunk-size", "length-and-chunked", "body-cut-short", "chunk-cut-short", "huge-header"])
def test_bytes_that_are_not_http_get_no_5xx_and_no_echo(gateway, heartbeat, data: bytes) -> None:
    assert_wire_refusal(raw_exchange(gateway.port, data))


# ----- a bad inner request, and the barrage all at once ---------------------------------------------


@pytest.mark.parametrize("content", [
    b'{"messages": [{"role": "user", "content": "' + CANARY_BYTES + b'"}], "stop": 5, "max_tokens": 2}',
    b'{"messages": [{"role": "user", "content": "' + CANARY_BYTES + b'"}], "seed": ' + b"7" * 5000 + b"}",
], ids=["stop-number", "huge-seed-literal"])
def test_a_bad_inner_request_does_not_evict_its_node(http, nodes, gateway, heartbeat, content: bytes) -> None:
    """The gateway cannot read the inner request, so a client's bad one must not cost the node its place."""
    node_id = nodes[1].node_id
    sealed = seal(key_configs(http)[node_id], inner_request(CHAT, content), False)
    try:
        answer = post_infer(http, candidate(node_id, OHTTP_REQUEST, b64(sealed.encapsulated)))
        kept = gateway.runtime.pool.lookup(node_id) is not None
    finally:
        gateway.run_round()  # re-admit the node if it was evicted, so that later tests start whole
    assert kept, "a client's encrypted request got the node evicted"
    assert answer.status_code == 200
    inner = sealed.open(answer.content)
    assert inner.status == 400
    assert_error_shape(inner.content)
    assert_no_canary(inner.content)


def test_well_formed_requests_are_served_during_a_concurrent_barrage(http, gateway, nodes, sdk, baseline) -> None:
    stop = threading.Event()
    statuses: list[int] = []
    reflected: list[bytes] = []

    def barrage(seed: int) -> None:
        import random

        rng = random.Random(seed)
        with httpx.Client(base_url=gateway.url, timeout=60.0, trust_env=False) as hostile:
            while not stop.is_set():
                garbage = rng.randbytes(rng.randrange(200)) + CANARY_BYTES
                node_id = nodes[rng.randrange(2)].node_id
                answer = rng.choice([
                    lambda: hostile.post("/v1/infer", content=garbage),
                    lambda: post_infer(hostile, candidate(node_id, OHTTP_REQUEST, b64(garbage))),
                    lambda: post_ohttp(hostile, node_id, OHTTP_CHUNKED_REQUEST, garbage),
                ])()
                statuses.append(answer.status_code)
                if CANARY_BYTES in answer.content:
                    reflected.append(answer.content)

    threads = [threading.Thread(target=barrage, args=(seed,)) for seed in range(3)]
    for thread in threads:
        thread.start()
    try:
        served = [sdk_chat(sdk) for _ in range(6)]
    finally:
        stop.set()
        for thread in threads:
            thread.join(HANG_S)
    assert served == [baseline] * 6
    assert statuses and set(statuses) <= {400, 502} and not reflected
    assert {entry.node_id for entry in gateway.runtime.pool.entries()} >= {node.node_id for node in nodes}
