"""Hostile input against the node's gRPC service (Attest, Infer, Health), over real gRPC on loopback.

Malformed, truncated, bit-flipped, oversized and replayed inputs, before and after
decapsulation. The contract: anything that does not decapsulate gets INVALID_ARGUMENT
with exactly the generic sentence (NOT_FOUND with its own fixed sentence when the cleartext
header names a key or suite the node does not hold); anything that does gets an *encrypted* HTTP answer
(200 or a 4xx with the JSON error shape), never a gRPC UNKNOWN/INTERNAL from a handler
that broke; no answer holds a byte of the request; and the node keeps answering a
well-formed request exactly as before, with no residue in freed KV blocks.

Bounded by default (40 examples per property); for a longer barrage:

    VEIL_FUZZ_EXAMPLES=2000 .venv/bin/python -m pytest tests/test_hardening_node.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import grpc
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from attestation.bundle import EvidenceBundle
from attestation.verifier import verify
from engine.tiny import write_tiny_model
from ohttp import ChunkedRequestSealer
from ohttp.media_types import OHTTP_CHUNKED_REQUEST, OHTTP_REQUEST
from policy import shipped_policy
from protocol import node_pb2
from protocol.constants import MAX_ENCAPSULATED_BYTES, MAX_GRPC_MESSAGE_BYTES, MAX_INNER_BODY_BYTES
from tests.hardening_support import (
    CANARY,
    CANARY_BYTES,
    REFUSALS,
    Heartbeat,
    answer_of,
    assert_encrypted_answer,
    assert_error_shape,
    assert_generic_refusal,
    assert_no_canary,
    attested_key,
    canary_text,
    chat_body,
    chat_text,
    fuzz_settings,
    infer,
    inner_request,
    models_request,
    mutate,
    mutations,
    node_stub,
    reference_text,
    seal,
    seal_chunked,
    seal_whole,
    spawn_node,
    start_node,
    streamed_text,
    with_canary,
)
from tests.test_gateway_support import sim_root  # noqa: F401  (a fixture)

_MiB = 1 << 20
# What gRPC itself answers when a message is not a protobuf of the method's type (no handler runs).
GRPC_UNDECODABLE = "Exception deserializing request!"
MEDIA_TYPE_VARIANTS = [
    "", "MESSAGE/OHTTP-REQ", "Message/Ohttp-Chunked-Req", "message/ohttp-req; charset=utf-8", " message/ohttp-req",
    "message/ohttp-req\n", "message/ohttp-req\x00", "message/ohttp-res", "message/ohttp-chunked-res",
    "application/json", "message/bhttp", "application/ohttp-keys", "text/plain", CANARY, "méssage/ohttp-req",
    "x" * 10_000,
]
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="module")
def node(sim_root, model_dir: Path):  # noqa: F811
    server = start_node(model_dir)
    yield server
    server.stop(grace=0)


@pytest.fixture(scope="module")
def stub(node):
    channel, node_stub_ = node_stub(node.port)
    yield node_stub_
    channel.close()


@pytest.fixture(scope="module")
def config(stub):
    return attested_key(stub)


@pytest.fixture(scope="module")
def baseline(stub, config, model_dir: Path) -> str:
    """The correct answer to one seeded chat request, as the node gives it before any hostile input."""
    text = reference_text(model_dir, chat_body())
    assert text  # this seed makes the tiny model speak, so "same answer" means something
    assert chat_text(answer_of(stub, seal_whole(config, inner_request(CHAT, chat_body())))) == text
    return text


@pytest.fixture(scope="module")
def heartbeat(node, stub, config, baseline) -> Heartbeat:
    return Heartbeat(lambda: assert_node_healthy(node, stub, config, baseline))


def assert_node_healthy(node, stub, config, baseline: str) -> None:
    """The same seeded request gets the same answer, whole and streamed, and freed KV blocks are zero."""
    assert chat_text(answer_of(stub, seal_whole(config, inner_request(CHAT, chat_body())))) == baseline
    assert streamed_text(answer_of(stub, seal_chunked(config, inner_request(CHAT, chat_body(stream=True))))) == baseline
    assert node.engine.residue_check() == []
    assert node.service.in_flight == 0


@pytest.fixture(autouse=True)
def still_healthy_afterwards(request: pytest.FixtureRequest):
    """After every test, the node answers a well-formed request exactly as before it."""
    yield
    if "heartbeat" in request.fixturenames:
        request.getfixturevalue("heartbeat").check()


# ----- Attest -----------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, 31, 33, 64, 3 * _MiB])
def test_attest_refuses_every_nonce_but_32_bytes(stub, heartbeat, size: int) -> None:
    nonce = (CANARY_BYTES * (size // len(CANARY_BYTES) + 1))[:size]
    with pytest.raises(grpc.RpcError) as refused:
        stub.Attest(node_pb2.AttestRequest(nonce=nonce), timeout=30)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details() == "the nonce must be exactly 32 bytes"


@fuzz_settings()
@given(nonce=st.binary(max_size=80) | st.binary(min_size=32, max_size=32))
def test_fuzzed_nonces_are_refused_or_bound_into_the_evidence(stub, heartbeat, nonce: bytes) -> None:
    heartbeat.beat()
    try:
        reply = stub.Attest(node_pb2.AttestRequest(nonce=nonce), timeout=30)
    except grpc.RpcError as refused:
        assert len(nonce) != 32
        assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
        return
    assert len(nonce) == 32
    verify(EvidenceBundle.from_json(reply.evidence_bundle), shipped_policy("dev"), expected_nonce=nonce)


# ----- Infer, before decapsulation ---------------------------------------------------------------


@fuzz_settings()
@given(data=with_canary(300) | st.binary(max_size=64),
       media_type=st.sampled_from([OHTTP_REQUEST, OHTTP_CHUNKED_REQUEST, *MEDIA_TYPE_VARIANTS]))
def test_random_bytes_are_refused_with_the_generic_status(stub, heartbeat, data: bytes, media_type: str) -> None:
    heartbeat.beat()
    assert_generic_refusal(infer(stub, media_type, data))


@pytest.mark.parametrize("media_type", MEDIA_TYPE_VARIANTS)
@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
def test_a_valid_encapsulation_under_any_other_media_type_is_refused(stub, config, heartbeat, media_type: str,
                                                                     chunked: bool) -> None:
    sealed = seal(config, models_request(), chunked)
    assert_generic_refusal(infer(stub, media_type, sealed.encapsulated))


def test_whole_and_chunked_encapsulations_declared_as_each_other_are_refused(stub, config, heartbeat) -> None:
    whole, chunked = seal_whole(config, models_request()), seal_chunked(config, models_request())
    assert_generic_refusal(infer(stub, OHTTP_CHUNKED_REQUEST, whole.encapsulated))
    assert_generic_refusal(infer(stub, OHTTP_REQUEST, chunked.encapsulated))


@fuzz_settings()
@given(chunked=st.booleans(), pieces=st.integers(1, 4), mutation=mutations)
def test_truncated_flipped_or_spliced_encapsulations_are_refused(stub, config, heartbeat, chunked: bool,
                                                                 pieces: int, mutation: tuple) -> None:
    heartbeat.beat()
    plaintext = inner_request(CHAT, chat_body(content=CANARY))
    sealed = seal_chunked(config, plaintext, pieces) if chunked else seal_whole(config, plaintext)
    assert_generic_refusal(infer(stub, sealed.media_type, mutate(sealed.encapsulated, mutation)))


@pytest.mark.parametrize("pieces", [1, 3])
def test_a_chunked_stream_without_its_final_chunk_is_refused(stub, config, heartbeat, pieces: int) -> None:
    unfinished = seal_chunked(config, models_request(), pieces, final=False)
    assert not unfinished.sealer.finished
    assert_generic_refusal(infer(stub, OHTTP_CHUNKED_REQUEST, unfinished.encapsulated))
    header_only = ChunkedRequestSealer(config).start()
    assert_generic_refusal(infer(stub, OHTTP_CHUNKED_REQUEST, header_only))
    assert_generic_refusal(infer(stub, OHTTP_CHUNKED_REQUEST, header_only[:5]))


def test_oversized_encapsulations_are_refused_before_anything_is_opened(stub, config, heartbeat) -> None:
    sealed = seal_whole(config, models_request())
    over_node_bound = sealed.encapsulated + CANARY_BYTES * ((MAX_ENCAPSULATED_BYTES // len(CANARY_BYTES)) + 1)
    assert_generic_refusal(infer(stub, OHTTP_REQUEST, over_node_bound))
    # Over the node's gRPC message bound, the transport refuses it before any handler runs.
    over_transport_bound = infer(stub, OHTTP_REQUEST,
                                 CANARY_BYTES * ((MAX_GRPC_MESSAGE_BYTES + _MiB) // len(CANARY_BYTES)))
    assert over_transport_bound.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert_no_canary(over_transport_bound.details)


_NOT_PROTOBUF = [
    *[pytest.param(method, b"\x12\xff", id=f"truncated-varint-{method}") for method in ("Infer", "Attest", "Health")],
    *[pytest.param(method, b"\x0a\x40" + CANARY_BYTES, id=f"overlong-field-{method}")
      for method in ("Infer", "Attest", "Health")],
    # Only Infer's field 1 is a string, where invalid UTF-8 is undecodable; Attest's is bytes and Health
    # has none, so there the same bytes may be a valid message, depending on the random canary after them.
    pytest.param("Infer", b"\x0a\x03\xff\xfe" + CANARY_BYTES, id="bad-utf8-Infer"),
]


@pytest.mark.parametrize(("method", "message"), _NOT_PROTOBUF)
def test_messages_that_are_not_protobuf_get_grpcs_fixed_answer(node, heartbeat, method: str, message: bytes) -> None:
    channel, _ = node_stub(node.port)
    with channel:
        call = raw_call(channel, method)
        with pytest.raises(grpc.RpcError) as refused:
            drain_call(call(message, timeout=30), method)
    assert (refused.value.code(), refused.value.details()) == (grpc.StatusCode.INTERNAL, GRPC_UNDECODABLE)


@fuzz_settings()
@given(message=with_canary(200), method=st.sampled_from(["Infer", "Attest", "Health"]))
def test_arbitrary_grpc_payloads_get_only_contract_or_transport_statuses(node, heartbeat, message: bytes,
                                                                          method: str) -> None:
    heartbeat.beat()
    channel, _ = node_stub(node.port)
    with channel:
        try:
            drain_call(raw_call(channel, method)(message, timeout=30), method)
        except grpc.RpcError as refused:
            answer = (refused.code(), refused.details())
            assert answer in {(grpc.StatusCode.INTERNAL, GRPC_UNDECODABLE),
                              (grpc.StatusCode.INVALID_ARGUMENT, "the nonce must be exactly 32 bytes"),
                              *REFUSALS}
            return
    assert method == "Health"  # the only method a stray payload can satisfy (it has no fields)


def test_unknown_methods_are_unimplemented(node, heartbeat) -> None:
    channel, _ = node_stub(node.port)
    with channel:
        for path in ("/veil.node.v1.Node/Debug", "/veil.node.v1.Node/" + CANARY,
                     "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"):
            with pytest.raises(grpc.RpcError) as refused:
                channel.unary_unary(path, request_serializer=None, response_deserializer=None)(CANARY_BYTES, timeout=30)
            assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
            assert_no_canary(refused.value.details() or "")


def raw_call(channel: grpc.Channel, method: str):
    path = f"/veil.node.v1.Node/{method}"
    if method == "Infer":
        return channel.unary_stream(path, request_serializer=None, response_deserializer=None)
    return channel.unary_unary(path, request_serializer=None, response_deserializer=None)


def drain_call(answer, method: str) -> None:
    if method == "Infer":
        for _ in answer:
            pass


# ----- Infer, after decapsulation: every error travels encrypted ----------------------------------


@fuzz_settings()
@given(plaintext=with_canary(200), chunked=st.booleans())
def test_valid_encapsulations_of_malformed_binary_http_get_an_encrypted_400(stub, config, heartbeat,
                                                                           plaintext: bytes, chunked: bool) -> None:
    heartbeat.beat()
    response = answer_of(stub, seal(config, plaintext, chunked))
    assert_encrypted_answer(response, allow_ok=False)


@fuzz_settings()
@given(mutation=mutations, chunked=st.booleans())
def test_mangled_binary_http_gets_an_encrypted_answer(stub, config, heartbeat, mutation: tuple, chunked: bool) -> None:
    heartbeat.beat()
    plaintext = mutate(inner_request(CHAT, chat_body(content=CANARY, max_tokens=2)), mutation)
    assert_encrypted_answer(answer_of(stub, seal(config, plaintext, chunked)))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12) | canary_text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8) | canary_text(), children,
                                                                     max_size=4),
    max_leaves=12,
)


@fuzz_settings()
@given(value=json_values, path=st.sampled_from([CHAT, COMPLETIONS]), chunked=st.booleans())
def test_request_bodies_of_any_json_shape_get_an_encrypted_answer(stub, config, heartbeat, value: object,
                                                                  path: str, chunked: bool) -> None:
    heartbeat.beat()
    assert_encrypted_answer(answer_of(stub, seal(config, inner_request(path, json.dumps(value).encode()), chunked)))


junk = st.none() | st.booleans() | st.floats() | st.integers(-2**70, 2**70) | canary_text() | \
    st.lists(st.integers() | canary_text(), max_size=3) | st.dictionaries(canary_text(), st.integers(), max_size=2)
sampling_values = st.fixed_dictionaries({}, optional={
    # None would mean the 128-token default: kept out so that a barrage stays quick.
    "max_tokens": st.integers(1, 3) | st.integers(max_value=0) | st.integers(10**5, 2**80) | junk.filter(
        lambda value: value is not None),
    "temperature": junk, "top_p": junk, "n": st.integers(-3, 40) | junk, "seed": junk, "stop": junk,
    "stream": junk, "model": junk | st.just("tiny"), "logprobs": junk, CANARY: junk,
})


@fuzz_settings()
@example(fields={"stop": True, "max_tokens": 1}, path=COMPLETIONS, chunked=False)
@example(fields={"stop": 7, "max_tokens": 1}, path=CHAT, chunked=True)
@given(fields=sampling_values, path=st.sampled_from([CHAT, COMPLETIONS]), chunked=st.booleans())
def test_sampling_values_of_any_type_get_an_encrypted_answer(stub, config, heartbeat, fields: dict, path: str,
                                                             chunked: bool) -> None:
    heartbeat.beat()
    body = {"prompt": "once upon"} if path == COMPLETIONS else {"messages": [{"role": "user", "content": "hi"}]}
    body = {**body, "max_tokens": 2, **fields}
    assert_encrypted_answer(answer_of(stub, seal(config, inner_request(path, body), chunked)))


@pytest.mark.parametrize("content", [
    b"[" * 100_000,
    b'{"a":' * 50_000,
    b'{"prompt": "x", "seed": ' + b"7" * 5000 + b"}",
    b'{"prompt": "\xff\xfe' + CANARY_BYTES + b'"}',
    b'{"prompt": ' + CANARY_BYTES,
], ids=["deep-array", "deep-object", "huge-integer", "bad-utf8", "cut-short"])
def test_json_the_decoder_cannot_hold_is_an_encrypted_400(stub, config, heartbeat, content: bytes) -> None:
    for chunked in (False, True):
        response = answer_of(stub, seal(config, inner_request(COMPLETIONS, content), chunked))
        assert response.status == 400
        assert assert_error_shape(response.content)["code"] == "invalid_json"
        assert_no_canary(response.content)


@pytest.mark.parametrize("stop", [5, True, 0.5, {CANARY: 1}], ids=["int", "bool", "float", "dict"])
def test_wrong_typed_stop_is_an_encrypted_400(stub, config, heartbeat, stop: object) -> None:
    body = {"prompt": "once upon", "max_tokens": 2, "stop": stop}
    response = answer_of(stub, seal_whole(config, inner_request(COMPLETIONS, body)))
    assert response.status == 400
    assert assert_error_shape(response.content)["code"] == "invalid_request"
    assert_no_canary(response.content)


@pytest.mark.parametrize("field, literal", [
    ("temperature", b"Infinity"), ("temperature", b"NaN"), ("temperature", b"-1"), ("temperature", b"1e308"),
    ("top_p", b"0"), ("top_p", b"-Infinity"), ("top_p", b"2"), ("n", b"0"), ("n", b"17"), ("n", b"1000000000"),
    ("max_tokens", b"0"), ("max_tokens", b"-1"), ("max_tokens", b"1000000000000"), ("seed", b"-1"),
    ("seed", b"18446744073709551616"), ("seed", b"1" + b"0" * 100),
])
def test_absurd_sampling_values_are_refused_inside_the_encryption(stub, config, heartbeat, field: str,
                                                                  literal: bytes) -> None:
    content = b'{"prompt": "' + CANARY_BYTES + b'", "max_tokens": 2, "' + field.encode() + b'": ' + literal + b"}"
    if field == "max_tokens":
        content = b'{"prompt": "' + CANARY_BYTES + b'", "max_tokens": ' + literal + b"}"
    response = answer_of(stub, seal_whole(config, inner_request(COMPLETIONS, content)))
    assert response.status == 400
    assert_error_shape(response.content)
    assert_no_canary(response.content)


@pytest.mark.parametrize("method, path, status", [
    (b"GET", CHAT, 405), (b"DELETE", COMPLETIONS, 405), (b"POST", "/v1/models", 405), (CANARY_BYTES, CHAT, 405),
    (b"POST", "/v1/" + CANARY, 404), (b"POST", "", 404), (b"GET", "/v1/chat/completions/../../v1/models", 404),
    (b"POST", b"/v1/\xff\xfe" + CANARY_BYTES, 404), (b"GET", "/" + CANARY * 4000, 404), (b"POST", "*", 404),
])
def test_unknown_paths_and_wrong_methods_get_encrypted_errors(stub, config, heartbeat, method: bytes,
                                                              path: str | bytes, status: int) -> None:
    for chunked in (False, True):
        response = answer_of(stub, seal(config, inner_request(path, chat_body(), method=method), chunked))
        assert response.status == status
        assert_error_shape(response.content)
        assert_no_canary(response.content)


@pytest.mark.parametrize("chunks", [1, 8])
def test_inner_bodies_over_the_bound_are_an_encrypted_413(stub, config, heartbeat, chunks: int) -> None:
    text = (CANARY * (MAX_INNER_BODY_BYTES // len(CANARY) + 1))
    plaintext = inner_request(COMPLETIONS, {"prompt": text, "max_tokens": 1})
    sealed = seal_chunked(config, plaintext, chunks) if chunks > 1 else seal_whole(config, plaintext)
    response = answer_of(stub, sealed)
    assert response.status == 413
    assert assert_error_shape(response.content)["code"] == "too_large"
    assert_no_canary(response.content)


# ----- replays ----------------------------------------------------------------------------------


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
def test_a_replayed_request_is_answered_again_under_a_fresh_response_key(stub, config, baseline, heartbeat,
                                                                         chunked: bool) -> None:
    """OHTTP has no replay protection: a replayed encapsulation is served again (SECURITY.md says so).

    What still holds: each answer is sealed under a fresh response nonce, so the two
    ciphertexts differ, and only the original sender's context opens either.
    """
    sealed = seal(config, inner_request(CHAT, chat_body(stream=chunked)), chunked)
    first = infer(stub, sealed.media_type, sealed.encapsulated)
    replay = infer(stub, sealed.media_type, sealed.encapsulated)
    assert first.ok and replay.ok
    assert first.data != replay.data
    texts = [(streamed_text if chunked else chat_text)(sealed.open(result.data)) for result in (first, replay)]
    assert texts == [baseline, baseline]


# ----- a node process: inputs that could stop the engine thread -------------------------------------


@pytest.fixture(scope="module")
def node_process(sim_root, model_dir: Path, tmp_path_factory: pytest.TempPathFactory):  # noqa: F811
    """A separate `veil node` process, so that an engine thread that dies cannot hang this test run."""
    process = spawn_node(model_dir, tmp_path_factory.mktemp("node-process"), Path(os.environ["VEIL_SIM_ROOT_DIR"]))
    channel, process_stub = node_stub(process.port)
    yield process_stub
    channel.close()
    process.stop()


@pytest.mark.parametrize("path, body", [
    (CHAT, {"messages": [{"role": "user", "content": "\ud800" + CANARY}], "max_tokens": 2}),
    (CHAT, {"messages": [{"role": "\udfff", "content": CANARY}], "max_tokens": 2}),
    (COMPLETIONS, {"prompt": CANARY + "\ud800", "max_tokens": 2}),
], ids=["chat-content", "chat-role", "completion-prompt"])
def test_lone_surrogates_get_an_encrypted_400_and_the_node_keeps_serving(node_process, path: str, body: dict) -> None:
    stub = node_process
    config = attested_key(stub)
    content = json.dumps(body).encode()  # JSON escapes a lone surrogate as \\udXXX, as any client would send it
    response = answer_of(stub, seal_whole(config, inner_request(path, content)), timeout=15)
    assert response.status == 400
    assert_error_shape(response.content)
    assert_no_canary(response.content)
    after = answer_of(stub, seal_whole(config, inner_request(CHAT, chat_body())), timeout=15)
    assert chat_text(after)
