"""The enclave node in-process: a real gRPC server on loopback, simulated attestation, the tiny model."""

from __future__ import annotations

import json
import os
import signal
import time
from email.utils import formatdate, parsedate_to_datetime
from pathlib import Path

import grpc
import pytest

from attestation.bundle import EvidenceBundle
from attestation.verifier import verify
from client import wire
from enclave.api import REQUEST_DATE_WINDOW_S, ApiError
from enclave.request_fields import sampling_params
from enclave.errors import SelfCheckError
from enclave.node import NodeServer
from enclave.service import KEY_UNKNOWN, NOT_DECAPSULATED
from enclave.settings import NodeSettings
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.tiny import write_tiny_model
from engine.tokenizer import ChatMessage
from ohttp import ChunkedRequestSealer, ClientRequest, bhttp
from ohttp.bhttp_stream import StreamingResponseDecoder
from ohttp.keys import KeyConfig
from policy import shipped_policy
from protocol import node_pb2, node_pb2_grpc
from tests.conftest import HANG_S
from tests.policy_support import write_filled_strict

CANARY = "CANARY-7f3a9c-PURPLE-GIRAFFE"


@pytest.fixture(scope="module")
def sim_root(tmp_path_factory: pytest.TempPathFactory):
    previous = os.environ.get("VEIL_SIM_ROOT_DIR")
    os.environ["VEIL_SIM_ROOT_DIR"] = str(tmp_path_factory.mktemp("sim-root"))
    yield
    if previous is None:
        os.environ.pop("VEIL_SIM_ROOT_DIR", None)
    else:
        os.environ["VEIL_SIM_ROOT_DIR"] = previous


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="module")
def node(sim_root, model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    audit_path = tmp_path_factory.mktemp("audit") / "node.jsonl"
    settings = NodeSettings(
        model=model_dir, policy="dev", attestation="sim", capacity=2, audit=f"file:{audit_path}",
        key_rotation_s=0, key_grace_s=3600, kv_cache_gib=0.05, model_name="tiny",
    )
    server = NodeServer(settings)
    server.start()
    server.audit_path = audit_path
    yield server
    server.stop()


@pytest.fixture(scope="module")
def stub(node: NodeServer):
    channel = grpc.insecure_channel(f"127.0.0.1:{node.port}")
    yield node_pb2_grpc.NodeStub(channel)
    channel.close()


def attest(stub) -> KeyConfig:
    nonce = os.urandom(32)
    reply = stub.Attest(node_pb2.AttestRequest(nonce=nonce))
    verified = verify(EvidenceBundle.from_json(reply.evidence_bundle), shipped_policy("dev"), expected_nonce=nonce)
    return KeyConfig.decode(verified.key_config)


def inner_request(path: str, body: dict | bytes | None, method: bytes = b"POST") -> bytes:
    content = body if isinstance(body, bytes) else json.dumps(body).encode() if body is not None else b""
    request = bhttp.Request(method, b"https", b"veil.node", path.encode(), [(b"content-type", b"application/json")], content)
    return bhttp.encode_request(request)


def call_whole(stub, config: KeyConfig, plaintext: bytes) -> bhttp.Response:
    encapsulated, context = ClientRequest.encapsulate(config, plaintext)
    reply = stub.Infer(node_pb2.InferRequest(media_type="message/ohttp-req", encapsulated=encapsulated))
    return bhttp.decode_response(context.open_response(b"".join(chunk.data for chunk in reply)))


def call_streaming(stub, config: KeyConfig, plaintext: bytes) -> tuple[int, list[bytes], int]:
    sealer = ChunkedRequestSealer(config)
    encapsulated = sealer.seal_chunk(plaintext, final=True)
    opener, decoder = sealer.response_opener(), StreamingResponseDecoder()
    events, grpc_messages = [], 0
    for chunk in stub.Infer(node_pb2.InferRequest(media_type="message/ohttp-chunked-req", encapsulated=encapsulated)):
        grpc_messages += 1
        for piece in opener.feed(chunk.data):
            events += decoder.feed(piece)
    opener.finish()
    decoder.finish()
    return decoder.head.status, sse_events(b"".join(events)), grpc_messages


def sse_events(content: bytes) -> list[bytes]:
    """One item per server-sent event: a content piece may carry several that waited together."""
    return [frame + b"\n\n" for frame in content.split(b"\n\n") if frame]


def chat_body(max_tokens: int = 12, seed: int = 6, **extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": f"say {CANARY}"}], "max_tokens": max_tokens,
            "temperature": 0.8, "seed": seed, **extra}


def expected_text(model_dir: Path, body: dict) -> str:
    engine = LLMEngine(model_dir, EngineConfig(kv_cache_gib=0.02))
    prompt = engine.tokenizer.encode_chat([ChatMessage(m["role"], m["content"]) for m in body["messages"]])
    params = SamplingParams(max_tokens=body["max_tokens"], temperature=body["temperature"], seed=body["seed"])
    return engine.generate([prompt], params)[0].outputs[0].text


def test_attest_binds_the_nonce_and_the_current_key(stub):
    nonce = os.urandom(32)
    reply = stub.Attest(node_pb2.AttestRequest(nonce=nonce))
    bundle = EvidenceBundle.from_json(reply.evidence_bundle)
    verify(bundle, shipped_policy("dev"), expected_nonce=nonce)
    with pytest.raises(Exception):
        verify(bundle, shipped_policy("dev"), expected_nonce=os.urandom(32))
    with pytest.raises(grpc.RpcError) as error:
        stub.Attest(node_pb2.AttestRequest(nonce=b"short"))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_whole_and_streamed_answers_equal_the_engine_output(stub, model_dir):
    config = attest(stub)
    body = chat_body()
    want = expected_text(model_dir, body)
    assert want  # this seed makes the tiny model speak rather than stop at once
    response = call_whole(stub, config, inner_request("/v1/chat/completions", body))
    assert response.status == 200
    answer = json.loads(response.content)
    assert answer["choices"][0]["message"]["content"] == want
    assert answer["usage"]["completion_tokens"] == 12

    status, events, messages = call_streaming(stub, config, inner_request("/v1/chat/completions", {**body, "stream": True}))
    assert status == 200 and events[-1] == b"data: [DONE]\n\n"
    chunks = [json.loads(e.removeprefix(b"data: ")) for e in events[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == want
    assert messages >= 3  # head with the first delta, later deltas and [DONE], end: never one sealed blob


def test_text_completions_and_model_listing(stub):
    config = attest(stub)
    models = call_whole(stub, config, inner_request("/v1/models", None, method=b"GET"))
    assert json.loads(models.content)["data"][0]["id"] == "tiny"
    reply = call_whole(stub, config, inner_request("/v1/completions", {"prompt": "Once upon", "max_tokens": 5, "n": 2, "seed": 1}))
    choices = json.loads(reply.content)["choices"]
    assert [c["index"] for c in choices] == [0, 1]


@pytest.mark.parametrize(
    ("path", "body", "status", "code"),
    [
        ("/v1/chat/completions", b"{not json " + CANARY.encode(), 400, "invalid_json"),
        ("/v1/chat/completions", {"model": "other-" + CANARY, "messages": [{"role": "user", "content": "x"}]}, 404, "model_not_found"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": CANARY}], "temperature": -1}, 400, "invalid_sampling"),
        ("/v1/completions", {"prompt": CANARY * 400, "max_tokens": 8}, 400, "prompt_too_long"),
        ("/v1/completions", {"prompt": ""}, 400, "empty_prompt"),
        ("/v1/nowhere", {}, 404, "not_found"),
    ],
)
def test_errors_after_decapsulation_travel_encrypted_and_echo_nothing(stub, path, body, status, code):
    config = attest(stub)
    response = call_whole(stub, config, inner_request(path, body))
    assert response.status == status
    error = json.loads(response.content)["error"]
    assert error["code"] == code
    assert CANARY not in response.content.decode()


@pytest.mark.parametrize(("mangle", "code", "details"), [
    ("garbage", grpc.StatusCode.NOT_FOUND, KEY_UNKNOWN),  # its first byte, as a key id, names no key of the node
    ("flip", grpc.StatusCode.INVALID_ARGUMENT, NOT_DECAPSULATED),
    ("unknown_key", grpc.StatusCode.NOT_FOUND, KEY_UNKNOWN),
    ("media_type", grpc.StatusCode.INVALID_ARGUMENT, NOT_DECAPSULATED),
])
def test_errors_before_decapsulation_are_generic(stub, mangle, code, details):
    config = attest(stub)
    encapsulated, _ = ClientRequest.encapsulate(config, inner_request("/v1/models", None, method=b"GET"))
    media_type = "message/ohttp-req"
    if mangle == "garbage":
        encapsulated = CANARY.encode()
    elif mangle == "flip":
        encapsulated = encapsulated[:-1] + bytes([encapsulated[-1] ^ 1])
    elif mangle == "unknown_key":
        encapsulated = bytes([(encapsulated[0] + 7) % 256]) + encapsulated[1:]
    else:
        media_type = "text/plain"
    with pytest.raises(grpc.RpcError) as error:
        list(stub.Infer(node_pb2.InferRequest(media_type=media_type, encapsulated=encapsulated)))
    assert (error.value.code(), error.value.details()) == (code, details)
    # ... and the node keeps serving.
    assert call_whole(stub, config, inner_request("/v1/models", None, method=b"GET")).status == 200


def test_an_encapsulated_request_expecting_100_continue_gets_an_encrypted_417(stub):
    config = attest(stub)
    fields = [(b"content-type", b"application/json"), (b"expect", b"100-continue")]
    request = bhttp.Request(b"POST", b"https", b"veil.node", b"/v1/completions", fields,
                            json.dumps({"prompt": "Once upon", "max_tokens": 2}).encode())
    response = call_whole(stub, config, bhttp.encode_request(request))
    assert response.status == 417
    assert json.loads(response.content)["error"]["code"] == "expectation_failed"


def test_previous_key_is_honoured_for_the_grace_period(node, stub):
    old_config = attest(stub)
    old_id = node.node_id
    node.rotate_key()
    assert node.node_id != old_id and attest(stub) != old_config
    assert call_whole(stub, old_config, inner_request("/v1/models", None, method=b"GET")).status == 200
    node.keys.grace_s = 0
    node.keys._previous_expires_at = 0.0  # the grace period is over
    node.keys.expire_previous()
    encapsulated, _ = ClientRequest.encapsulate(old_config, inner_request("/v1/models", None, method=b"GET"))
    with pytest.raises(grpc.RpcError) as error:
        list(stub.Infer(node_pb2.InferRequest(media_type="message/ohttp-req", encapsulated=encapsulated)))
    assert (error.value.code(), error.value.details()) == (grpc.StatusCode.NOT_FOUND, KEY_UNKNOWN)


def test_over_capacity_is_refused_not_queued(node, stub):
    config = attest(stub)
    body = inner_request("/v1/completions", {"prompt": "hold", "max_tokens": 200, "stream": True, "seed": 2})
    held = []
    for _ in range(node.service.capacity):
        sealer = ChunkedRequestSealer(config)
        stream = stub.Infer(node_pb2.InferRequest(media_type="message/ohttp-chunked-req",
                                                  encapsulated=sealer.seal_chunk(body, final=True)))
        next(stream)  # the node has started answering: the slot is taken
        held.append(stream)
    with pytest.raises(grpc.RpcError) as error:
        call_whole(stub, config, inner_request("/v1/models", None, method=b"GET"))
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    for stream in held:
        stream.cancel()
    # The node frees each slot when it sees the cancellation: wait for that, not for a guessed half second.
    deadline = time.monotonic() + HANG_S
    while stub.Health(node_pb2.HealthRequest(), timeout=10).in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert call_whole(stub, config, inner_request("/v1/models", None, method=b"GET")).status == 200


def test_audit_holds_typed_events_only_and_zero_residue(node, stub):
    config = attest(stub)
    call_whole(stub, config, inner_request("/v1/chat/completions", chat_body(max_tokens=20)))
    node.flush_audit()
    text = node.audit_path.read_text()
    assert CANARY not in text
    events = [json.loads(line) for line in text.splitlines()]
    kinds = {e["kind"] for e in events}
    assert {"node_started", "evidence_refreshed", "request_finished", "blocks_zeroed"} <= kinds
    zeroed = [e for e in events if e["kind"] == "blocks_zeroed"]
    assert sum(e["blocks"] for e in zeroed) > 0 and all(e["residue_blocks"] == 0 for e in zeroed)
    assert node.engine.residue_check() == []


def test_self_check_refuses_simulation_under_strict(sim_root, model_dir, tmp_path):
    strict = str(write_filled_strict(tmp_path / "strict.toml"))
    with pytest.raises(SelfCheckError, match="simulated"):
        NodeServer(NodeSettings(model=model_dir, policy=strict, attestation="sim"))


def test_self_check_refuses_a_kv_pool_over_the_policy_budget(sim_root, model_dir):
    with pytest.raises(SelfCheckError, match="budget"):
        NodeServer(NodeSettings(model=model_dir, policy="dev", attestation="sim", kv_cache_gib=1000))


def test_a_node_whose_own_evidence_fails_its_policy_refuses_to_start(sim_root, model_dir, tmp_path):
    from attestation.errors import MeasurementNotAllowedError
    from policy import shipped_policy_path

    # The dev policy, but with no code digest allowed: this node's own measurement cannot pass.
    text = shipped_policy_path("dev").read_text().replace("accept_unlisted_code = true", "accept_unlisted_code = false")
    assert "accept_unlisted_code = false" in text
    policy_file = tmp_path / "no-code-allowed.toml"
    policy_file.write_text(text)
    node = NodeServer(NodeSettings(model=model_dir, policy=str(policy_file), attestation="sim", kv_cache_gib=0.02))
    with pytest.raises(MeasurementNotAllowedError):
        node.start()
    assert node.port is None  # it never opened its port


def dated_request(date: bytes | None, *extra_dates: bytes) -> bytes:
    headers = [(b"content-type", b"application/json")]
    headers += [(b"date", value) for value in ([date] if date is not None else []) + list(extra_dates)]
    body = json.dumps({"prompt": "Once upon", "max_tokens": 2, "seed": 1}).encode()
    return bhttp.encode_request(bhttp.Request(b"POST", b"https", b"veil.node", b"/v1/completions", headers, body))


def http_date(offset_s: float) -> bytes:
    return formatdate(time.time() + offset_s, usegmt=True).encode()


@pytest.mark.parametrize("offset_s", [-600.0, -61.5, 75.0, 86_400.0])
def test_a_request_dated_outside_the_window_is_refused_and_told_the_nodes_time(stub, offset_s):
    config = attest(stub)
    for call in (call_whole, lambda s, c, p: chunked_response(s, c, p)):
        response = call(stub, config, dated_request(http_date(offset_s)))
        assert response.status == 400
        assert json.loads(response.content)["error"]["code"] == "date_out_of_window"
        [node_date] = [value for name, value in response.headers if name == b"date"]
        assert abs(parsedate_to_datetime(node_date.decode()).timestamp() - time.time()) < 30


@pytest.mark.parametrize("offset_s", [-45.0, 0.0, 45.0])
def test_a_request_dated_inside_the_window_is_served(stub, offset_s):
    config = attest(stub)
    response = call_whole(stub, config, dated_request(http_date(offset_s)))
    assert response.status == 200 and json.loads(response.content)["choices"]
    assert not [name for name, _ in response.headers if name == b"date"]


def test_a_request_without_a_date_is_served_for_plain_ohttp_clients(stub):
    response = call_whole(stub, attest(stub), dated_request(None))
    assert response.status == 200


@pytest.mark.parametrize("dates", [
    (CANARY.encode(),),
    (b"Sun, 99 Foo 2026 25:61:61 GMT " + CANARY.encode(),),
    (b"\xff\xfe" + CANARY.encode(),),
    (formatdate(usegmt=True).encode(), formatdate(usegmt=True).encode()),
])
def test_a_malformed_or_repeated_date_is_refused_without_echoing_it(stub, dates):
    response = call_whole(stub, attest(stub), dated_request(*dates))
    assert response.status == 400
    assert json.loads(response.content)["error"]["code"] == "invalid_date"
    assert CANARY.encode() not in response.content


def test_a_captured_sdk_request_replayed_after_the_window_is_refused(stub):
    config = attest(stub)
    captured = wire.build_request("POST", "/v1/completions", {"prompt": "Once upon", "max_tokens": 2},
                                  now=time.time() - 2 * REQUEST_DATE_WINDOW_S)
    assert call_whole(stub, config, captured).status == 400
    fresh = wire.build_request("POST", "/v1/completions", {"prompt": "Once upon", "max_tokens": 2})
    assert call_whole(stub, config, fresh).status == 200


def chunked_response(stub, config: KeyConfig, plaintext: bytes) -> bhttp.Response:
    """A streamed-request answer as one response (head fields and content)."""
    sealer = ChunkedRequestSealer(config)
    encapsulated = sealer.seal_chunk(plaintext, final=True)
    opener, decoder = sealer.response_opener(), StreamingResponseDecoder()
    content = []
    for chunk in stub.Infer(node_pb2.InferRequest(media_type="message/ohttp-chunked-req", encapsulated=encapsulated)):
        for piece in opener.feed(chunk.data):
            content += decoder.feed(piece)
    opener.finish()
    decoder.finish()
    return bhttp.Response(decoder.head.status, decoder.head.headers, b"".join(content))


def test_a_node_declaring_more_capacity_than_its_policy_allows_refuses_to_start(sim_root, model_dir):
    allowed = shipped_policy("dev").routing.max_node_capacity
    settings = NodeSettings(model=model_dir, policy="dev", attestation="sim", capacity=allowed + 1, kv_cache_gib=0.05)
    with pytest.raises(SelfCheckError, match="max_node_capacity.*non-targetability"):
        NodeServer(settings)


def _zeroed_events(node) -> list[dict]:
    node.audit.flush()
    return [event for event in map(json.loads, node.audit_path.read_text().splitlines())
            if event["kind"] == "blocks_zeroed"]


def test_a_zeroing_report_never_covers_a_lone_request_within_the_minute(node, stub):
    config = attest(stub)
    deadline = time.monotonic() + HANG_S
    while node.engine.in_flight and time.monotonic() < deadline:  # earlier tests' requests end first
        time.sleep(0.05)
    node.flush_audit()  # whatever earlier tests left is reported now; the tally starts empty
    before = len(_zeroed_events(node))
    call_whole(stub, config, inner_request("/v1/completions", {"prompt": "Once upon", "max_tokens": 8, "seed": 1}))
    time.sleep(1.2)  # over the one-second floor, so only the request count holds the report back
    call_whole(stub, config, inner_request("/v1/completions", {"prompt": "Twice upon", "max_tokens": 8, "seed": 2}))
    assert len(_zeroed_events(node)) == before  # two requests are not yet enough to report
    node.flush_audit()  # shutdown and explicit flushes report whatever is pending
    [report] = _zeroed_events(node)[before:]
    assert report["blocks"] >= 2 and report["residue_blocks"] == 0


@pytest.mark.parametrize(
    ("age_s", "requests", "residue", "due"),
    [(0.5, 10, 0, False), (1.5, 1, 0, False), (1.5, 3, 0, False), (1.5, 4, 0, True),
     (30.0, 1, 0, False), (60.0, 1, 0, True), (0.0, 0, 1, True)],
)
def test_a_zeroing_tally_is_due_after_a_second_and_several_requests_or_a_minute_or_any_residue(
        age_s, requests, residue, due):
    from enclave.node import ZeroingTally

    tally = ZeroingTally(since=100.0)
    tally.add(blocks=5 + residue, residue=residue, step=1, requests=requests)
    assert tally.due(100.0 + age_s) is due


def _dev_policy_file(folder: Path, old: str, new: str) -> Path:
    from policy import shipped_policy_path

    text = shipped_policy_path("dev").read_text()
    assert old in text
    path = folder / "policy.toml"
    path.write_text(text.replace(old, new))
    return path


def test_a_node_refuses_a_policy_whose_audit_schema_it_does_not_emit(sim_root, model_dir, tmp_path):
    policy = _dev_policy_file(tmp_path, "schema_version = 1", "schema_version = 2")
    with pytest.raises(SelfCheckError, match="audit schema version 2.*veil.audit/1"):
        NodeServer(NodeSettings(model=model_dir, policy=str(policy), attestation="sim", kv_cache_gib=0.05))


def test_a_node_refuses_a_policy_promising_no_prefix_sharing_at_all(sim_root, model_dir, tmp_path):
    policy = _dev_policy_file(tmp_path, 'prefix_sharing = "request"', 'prefix_sharing = "off"')
    with pytest.raises(SelfCheckError, match="cannot be honoured"):
        NodeServer(NodeSettings(model=model_dir, policy=str(policy), attestation="sim", kv_cache_gib=0.05))


def test_a_node_audits_to_the_sink_its_policy_names_unless_the_operator_overrides_it(sim_root, model_dir, tmp_path):
    named = tmp_path / "named-by-policy.jsonl"
    policy = _dev_policy_file(tmp_path, 'sink = "stderr"', f'sink = "jsonl:{named}"')
    node = NodeServer(NodeSettings(model=model_dir, policy=str(policy), attestation="sim", kv_cache_gib=0.05))
    node.start()
    node.stop()
    assert "node_started" in [json.loads(line)["kind"] for line in named.read_text().splitlines()]
    named.unlink()
    chosen = tmp_path / "chosen-by-operator.jsonl"
    node = NodeServer(NodeSettings(model=model_dir, policy=str(policy), attestation="sim", kv_cache_gib=0.05,
                                   audit=f"file:{chosen}"))
    node.start()
    node.stop()
    assert "node_started" in chosen.read_text() and not named.exists()


def test_a_node_whose_engine_core_dies_stops_serving_and_says_why(sim_root, model_dir, tmp_path):
    audit_path = tmp_path / "node.jsonl"
    node = NodeServer(NodeSettings(model=model_dir, policy="dev", attestation="sim", kv_cache_gib=0.05,
                                   audit=f"file:{audit_path}"))
    node.start()
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{node.port}")
        health = node_pb2_grpc.NodeStub(channel).Health
        assert health(node_pb2.HealthRequest()).serving
        os.kill(node.engine._process.pid, signal.SIGKILL)
        deadline = time.monotonic() + HANG_S
        while health(node_pb2.HealthRequest()).serving and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not health(node_pb2.HealthRequest()).serving
        channel.close()
    finally:
        node.stop()
    stops = [json.loads(line) for line in audit_path.read_text().splitlines() if '"node_stopped"' in line]
    assert [event["reason"] for event in stops][:1] == ["engine_error"]


# ----- every sampling setting the engine implements reaches it ----------------------------------


@pytest.mark.parametrize(("chat", "body", "expected"), [
    (True, {}, {"max_tokens": None, "top_k": 0, "min_p": 0.0, "logprobs": None, "ignore_eos": False}),
    (True, {"top_k": 5, "min_p": 0.2, "top_p": 0.9}, {"top_k": 5, "min_p": 0.2, "top_p": 0.9}),
    (True, {"top_k": -1}, {"top_k": 0}),
    (True, {"stop_token_ids": [3, 9], "ignore_eos": True}, {"stop_token_ids": (3, 9), "ignore_eos": True}),
    (True, {"logprobs": True}, {"logprobs": 0}),
    (True, {"logprobs": True, "top_logprobs": 4}, {"logprobs": 4}),
    (False, {"logprobs": 3}, {"logprobs": 3}),
    (False, {"stop": "x", "n": 2, "seed": 9, "temperature": 0.5}, {"stop": ("x",), "n": 2, "seed": 9, "temperature": 0.5}),
])
def test_the_inner_api_passes_every_sampling_setting(chat, body, expected):
    params = sampling_params(body, chat, max_tokens_limit=4096)
    assert {name: getattr(params, name) for name in expected} == expected
    assert SamplingParams().max_tokens is None  # one default, the rest of the context: engine and API alike


@pytest.mark.parametrize(("chat", "body", "message"), [
    (True, {"top_logprobs": 2}, "needs 'logprobs'"),
    (True, {"logprobs": 2}, "true or false"),
    (True, {"ignore_eos": "yes"}, "true or false"),
    (False, {"stop_token_ids": [1, 2.5]}, "stop_token_ids"),
    (False, {"stop_token_ids": list(range(65))}, "at most 64"),
    (False, {"top_k": "5"}, "an integer"),
])
def test_malformed_sampling_settings_are_refused_by_name(chat, body, message):
    with pytest.raises(ApiError, match=message) as raised:
        sampling_params(body, chat, max_tokens_limit=4096)
    assert raised.value.status == 400


def test_stop_token_ids_and_top_k_change_what_the_node_generates(stub, model_dir):
    config = attest(stub)
    body = {"prompt": "Once upon a time", "max_tokens": 10, "temperature": 1.0, "seed": 4, "ignore_eos": True}
    tokens = LLMEngine(model_dir, EngineConfig(kv_cache_gib=0.02)).generate(
        ["Once upon a time"], SamplingParams(max_tokens=10, temperature=1.0, seed=4, ignore_eos=True))[0].outputs[0]
    stop_at = tokens.token_ids[3]
    first = tokens.token_ids.index(stop_at)
    reply = json.loads(call_whole(stub, config, inner_request("/v1/completions", {**body, "stop_token_ids": [stop_at]})).content)
    assert reply["usage"]["completion_tokens"] == first and reply["choices"][0]["finish_reason"] == "stop"
    greedy = json.loads(call_whole(stub, config, inner_request("/v1/completions", {**body, "temperature": 0.0})).content)
    top_1 = json.loads(call_whole(stub, config, inner_request("/v1/completions", {**body, "top_k": 1})).content)
    assert top_1["choices"][0]["text"] == greedy["choices"][0]["text"]


def test_logprobs_come_back_in_openais_chat_and_completion_shapes(stub):
    config = attest(stub)
    chat = json.loads(call_whole(stub, config, inner_request(
        "/v1/chat/completions", chat_body(max_tokens=4, logprobs=True, top_logprobs=2, ignore_eos=True))).content)
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    for entry in content:
        assert entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["logprob"] >= entry["logprob"] - 1e-6  # the best alternative is listed first
    text = json.loads(call_whole(stub, config, inner_request(
        "/v1/completions", {"prompt": "Once", "max_tokens": 3, "logprobs": 1, "ignore_eos": True})).content)
    logprobs = text["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == 3
    plain = json.loads(call_whole(stub, config, inner_request("/v1/completions", {"prompt": "Once", "max_tokens": 2})).content)
    assert plain["choices"][0]["logprobs"] is None

    status, events, _ = call_streaming(stub, config, inner_request(
        "/v1/chat/completions", chat_body(max_tokens=3, logprobs=True, stream=True, ignore_eos=True)))
    chunks = [json.loads(e.removeprefix(b"data: ")) for e in events[:-1]]
    assert status == 200 and sum(len(c["choices"][0]["logprobs"]["content"]) for c in chunks) == 3
