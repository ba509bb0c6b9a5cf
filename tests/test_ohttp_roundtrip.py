"""Property round trips through the whole stack: Binary HTTP → OHTTP (whole and chunked) → back."""

from __future__ import annotations

import random

from hypothesis import example, given, settings
from hypothesis import strategies as st

from ohttp.bhttp import Request, Response, decode_request, decode_response, encode_request, encode_response
from ohttp.chunked import DEFAULT_MAX_CHUNK_SIZE, ChunkedRequestOpener, ChunkedRequestSealer
from ohttp.keys import DEFAULT_SUITES, KeyRing, generate_key_pair
from ohttp.message import ClientRequest, decapsulate_request
from tests.http_strategies import requests, responses

SETTINGS = settings(max_examples=40, deadline=None)
RING = KeyRing(generate_key_pair(11))
ONE_MIB = random.Random(2).randbytes(1 << 20)

suites = st.sampled_from(DEFAULT_SUITES)
cut_points = st.lists(st.floats(0, 1), max_size=12)


def _split(data: bytes, fractions: list[float]) -> list[bytes]:
    """Split `data` at the given relative positions (pieces may be empty)."""
    cuts = sorted(int(f * len(data)) for f in fractions)
    bounds = [0, *cuts, len(data)]
    return [data[a:b] for a, b in zip(bounds, bounds[1:])]


def _chunks(data: bytes, fractions: list[float]) -> list[bytes]:
    """`_split`, then pieces over the chunk limit split again: a sender never seals more in one chunk."""
    limit = DEFAULT_MAX_CHUNK_SIZE
    return [part[i : i + limit] if part else part
            for part in _split(data, fractions) for i in range(0, max(len(part), 1), limit)]


@SETTINGS
@given(requests, responses, suites, st.booleans())
@example(
    Request(b"POST", b"https", b"node", b"/v1/chat/completions", [(b"content-type", b"application/json")], ONE_MIB),
    Response(200, [], ONE_MIB),
    DEFAULT_SUITES[0],
    False,
)
def test_whole_message_round_trip(request: Request, response: Response, suite, known_length: bool) -> None:
    blob, client = ClientRequest.encapsulate(RING.current.config, encode_request(request, known_length=known_length), suite)
    plaintext, server = decapsulate_request(RING, blob)
    assert decode_request(plaintext) == request
    sealed = server.seal_response(encode_response(response, known_length=known_length))
    assert decode_response(client.open_response(sealed)) == response


@SETTINGS
@given(requests, responses, suites, cut_points, cut_points, cut_points, cut_points)
@example(
    Request(b"POST", b"https", b"n", b"/v1/completions", [], ONE_MIB),
    Response(200, [(b"content-type", b"text/event-stream")], ONE_MIB),
    DEFAULT_SUITES[2],
    [0.25, 0.5, 0.75],
    [0.1],
    [i / 64 for i in range(64)],
    [0.3, 0.31],
)
def test_chunked_round_trip(request, response, suite, request_cuts, request_pieces, response_cuts, response_pieces) -> None:
    sealer = ChunkedRequestSealer(RING.current.config, suite)
    body = _chunks(encode_request(request, known_length=False), request_cuts)
    wire = sealer.start() + b"".join(sealer.seal_chunk(c) for c in body[:-1] if c) + sealer.seal_chunk(body[-1], final=True)
    gateway = ChunkedRequestOpener(RING)
    assert b"".join(gateway.chunks(_split(wire, request_pieces))) == b"".join(body)

    writer = gateway.response_sealer()
    answer = _chunks(encode_response(response, known_length=False), response_cuts)
    wire = writer.start() + b"".join(writer.seal_chunk(c) for c in answer[:-1] if c) + writer.seal_chunk(answer[-1], final=True)
    reader = sealer.response_opener()
    opened = [chunk for piece in _split(wire, response_pieces) for chunk in reader.feed(piece)]
    opened.append(reader.finish())
    assert decode_response(b"".join(opened)) == response
    assert decode_request(b"".join(body)) == request
