"""The client's wire layer against a real OHTTP key pair: the node's side is played with `ohttp` itself."""

from __future__ import annotations

import json
import time
from email.utils import parsedate_to_datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from client import wire
from client.errors import NodeError
from client.types import ChatCompletion, ChatCompletionChunk, Completion, ModelList
from ohttp import (
    OHTTP_CHUNKED_REQUEST,
    OHTTP_REQUEST,
    ChunkedRequestOpener,
    DecryptionError,
    KeyRing,
    Response,
    TruncatedError,
    decapsulate_request,
    decode_request,
    encode_response,
    generate_key_pair,
)
from ohttp.bhttp_stream import encode_content_chunk, encode_response_end, encode_response_head

SETTINGS = settings(max_examples=25, deadline=None)
BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "seed": 3}


@pytest.fixture(scope="module")
def keys() -> KeyRing:
    return KeyRing(generate_key_pair(7))


def _node_opens_whole(keys: KeyRing, sealed: wire.SealedRequest):
    plaintext, context = decapsulate_request(keys, sealed.encapsulated)
    return decode_request(plaintext), context


def _node_opens_chunked(keys: KeyRing, sealed: wire.SealedRequest):
    opener = ChunkedRequestOpener(keys)
    chunks = list(opener.chunks([sealed.encapsulated]))
    return decode_request(b"".join(chunks)), opener.response_sealer()


def _split(data: bytes, fractions: list[float]) -> list[bytes]:
    cuts = sorted(int(f * len(data)) for f in fractions)
    bounds = [0, *cuts, len(data)]
    return [data[a:b] for a, b in zip(bounds, bounds[1:])]


def _streamed_answer(keys: KeyRing, sealed: wire.SealedRequest, events: list[bytes], status: int = 200) -> bytes:
    """What a node sends: one sealed chunk for the head, one per SSE event, the end in the final chunk."""
    request, response_sealer = _node_opens_chunked(keys, sealed)
    assert request.method == b"POST" and request.path.startswith(b"/v1/")
    parts = [response_sealer.seal_chunk(encode_response_head(status, [(b"content-type", b"text/event-stream")]))]
    parts += [response_sealer.seal_chunk(encode_content_chunk(event)) for event in events]
    parts.append(response_sealer.seal_chunk(encode_response_end(), final=True))
    return b"".join(parts)


def test_a_whole_request_reaches_the_node_as_the_openai_call(keys: KeyRing) -> None:
    sealed = wire.seal("n1", keys.current.config.encode(), wire.build_request("POST", "/v1/chat/completions", BODY), False)
    assert sealed.media_type == OHTTP_REQUEST and not sealed.streaming
    request, _ = _node_opens_whole(keys, sealed)
    assert (request.method, request.scheme, request.authority, request.path) == (
        b"POST", b"https", b"veil.node", b"/v1/chat/completions")
    assert (b"content-type", b"application/json") in request.headers
    assert json.loads(request.content) == BODY


def test_the_same_request_sealed_twice_gives_unrelated_ciphertexts(keys: KeyRing) -> None:
    inner = wire.build_request("POST", "/v1/completions", {"prompt": "x"})
    first, second = (wire.seal("n", keys.current.config.encode(), inner, False) for _ in range(2))
    assert first.encapsulated != second.encapsulated
    assert b"prompt" not in first.encapsulated


def test_a_whole_answer_opens_only_with_its_own_request_context(keys: KeyRing) -> None:
    config = keys.current.config.encode()
    sealed = wire.seal("n1", config, wire.build_request("GET", "/v1/models"), False)
    other = wire.seal("n1", config, wire.build_request("GET", "/v1/models"), False)
    request, context = _node_opens_whole(keys, sealed)
    assert request.method == b"GET" and request.content == b""
    answer = {"object": "list", "data": [{"id": "tiny", "object": "model", "owned_by": "veil"}]}
    reply = context.seal_response(encode_response(Response(200, [], json.dumps(answer).encode())))
    inner = sealed.open_whole(reply)
    assert inner.status == 200 and ModelList.from_dict(inner.json()).data[0].id == "tiny"
    with pytest.raises(DecryptionError):
        other.open_whole(reply)


def test_an_error_inside_the_encryption_names_only_its_code() -> None:
    body = json.dumps({"error": {"code": "invalid_request", "message": "max_tokens must be >= 1"}}).encode()
    assert wire.error_code(body) == "invalid_request"
    assert wire.error_code(b"not json") == "unknown"
    assert wire.error_code(b'{"error": "flat"}') == "unknown"


@SETTINGS
@given(st.lists(st.text(max_size=12), min_size=1, max_size=6), st.lists(st.floats(0, 1), max_size=12))
def test_a_streamed_answer_decodes_in_any_split(keys: KeyRing, pieces: list[str], cuts: list[float]) -> None:
    sealed = wire.seal("n1", keys.current.config.encode(),
                       wire.build_request("POST", "/v1/chat/completions", {**BODY, "stream": True}), True)
    assert sealed.media_type == OHTTP_CHUNKED_REQUEST and sealed.streaming
    chunks = [{"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "tiny",
               "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]} for piece in pieces]
    events = [f"data: {json.dumps(c)}\n\n".encode() for c in chunks] + [b"data: [DONE]\n\n"]
    decoder = sealed.stream_decoder()
    payloads = [p for part in _split(_streamed_answer(keys, sealed, events), cuts) for p in decoder.feed(part)]
    assert decoder.finish() is None and decoder.done
    text = "".join(ChatCompletionChunk.from_dict(p).choices[0].delta.content for p in payloads)
    assert text == "".join(pieces)


def test_a_streamed_answer_cut_short_is_truncated_never_short(keys: KeyRing) -> None:
    sealed = wire.seal("n1", keys.current.config.encode(), wire.build_request("POST", "/v1/completions", {}), True)
    whole = _streamed_answer(keys, sealed, [b'data: {"choices": []}\n\n', b"data: [DONE]\n\n"])
    for end in (0, 10, len(whole) // 2, len(whole) - 1):
        decoder = sealed.stream_decoder()
        decoder.feed(whole[:end])
        with pytest.raises(TruncatedError):
            decoder.finish()


def test_a_streamed_error_status_is_collected_not_parsed_as_events(keys: KeyRing) -> None:
    sealed = wire.seal("n1", keys.current.config.encode(), wire.build_request("POST", "/v1/chat/completions", {}), True)
    error = json.dumps({"error": {"code": "model_not_found", "message": "no such model"}}).encode()
    decoder = sealed.stream_decoder()
    assert decoder.feed(_streamed_answer(keys, sealed, [error], status=404)) == []
    failure = decoder.finish()
    assert failure is not None and failure.status == 404 and wire.error_code(failure.content) == "model_not_found"


def test_openai_shapes_parse_and_serialize_back() -> None:
    chat = {"id": "x", "object": "chat.completion", "created": 5, "model": "tiny",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "length",
                         "logprobs": None}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}
    parsed = ChatCompletion.from_dict(chat)
    assert parsed.choices[0].message.content == "hi" and parsed.usage.total_tokens == 5
    assert parsed.to_dict() == chat
    logprobs = {"tokens": ["a"], "token_logprobs": [-0.5], "top_logprobs": [{"a": -0.5}]}
    text = {"id": "y", "object": "text_completion", "created": 5, "model": "tiny",
            "choices": [{"index": 0, "text": "abc", "finish_reason": "stop", "logprobs": logprobs}]}
    assert Completion.from_dict(text).to_dict() == text
    assert Completion.from_dict(text).choices[0].logprobs == logprobs
    with pytest.raises(ValueError):
        ChatCompletion.from_dict({"choices": [{"index": "0", "message": {}}]})
    with pytest.raises(ValueError):
        Completion.from_dict({"choices": [{"index": True, "text": "t"}]})


def test_every_inner_request_carries_the_senders_clock_for_the_nodes_replay_window() -> None:
    before = time.time()
    request = decode_request(wire.build_request("GET", "/v1/models"))
    [date] = [value for name, value in request.headers if name == b"date"]
    sent = parsedate_to_datetime(date.decode()).timestamp()
    assert before - 1 <= sent <= time.time() + 1
    assert date.endswith(b" GMT")  # an IMF-fixdate, the form RFC 9110 requires senders to use
    old = decode_request(wire.build_request("GET", "/v1/models", now=1_000_000_000))
    assert (b"date", b"Sun, 09 Sep 2001 01:46:40 GMT") in old.headers


def test_a_node_refusing_the_clock_says_so_and_other_refusals_say_what_to_fix() -> None:
    node_id = "ab" * 16
    assert "clock" in str(NodeError(400, "date_out_of_window", node_id))
    assert "parameters" in str(NodeError(400, "invalid_sampling", node_id))
    assert "send it again" in str(NodeError(500, "engine_error", node_id))
    assert "parameters" not in str(NodeError(500, "engine_error", node_id))


def test_a_node_refusal_keeps_its_reason_field_and_type_as_openai_errors_do() -> None:
    body = {"error": {"message": "'top_p' must be a number", "type": "invalid_request_error", "param": "top_p",
                      "code": "invalid_request"}}
    error = NodeError.from_body(400, json.dumps(body).encode(), "ab" * 16)
    assert (error.code, error.param, error.type, error.message) == (
        "invalid_request", "top_p", "invalid_request_error", "'top_p' must be a number")
    assert "'top_p' must be a number" in str(error) and "parameters" in str(error)


@pytest.mark.parametrize("error", [
    {"message": "line one\nline two", "param": "CANARY IN PARAM", "type": "x" * 100, "code": "invalid_request"},
    {"message": "m" * 401, "param": ["top_p"], "type": 5, "code": "invalid_request"},
])
def test_a_node_refusal_keeps_nothing_that_is_not_a_short_line_or_an_identifier(error: dict) -> None:
    refused = NodeError.from_body(400, json.dumps({"error": error}).encode(), "ab" * 16)
    assert refused.message is None and refused.param is None and refused.type is None
    assert "CANARY" not in str(refused) and "line two" not in str(refused) and "mmmm" not in str(refused)


@pytest.mark.parametrize("content", [b"", b"not json", b"[1]", b'{"error": "flat"}', b"[" * 100_000])
def test_a_node_refusal_that_does_not_parse_is_an_unknown_code(content: bytes) -> None:
    refused = NodeError.from_body(502, content, "ab" * 16)
    assert refused.code == "unknown" and refused.message is None and refused.status == 502


def test_gateway_refusals_that_waiting_cannot_cure_each_say_what_to_do() -> None:
    assert "cannot help" in wire.gateway_advice("undecryptable")
    assert "current key" in wire.gateway_advice("unknown_key")
    assert "twice" in wire.gateway_advice("node_timeout")
    assert wire.gateway_advice("no_such_code") == "see the error code"
