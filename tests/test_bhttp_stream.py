"""Streaming indeterminate-length Binary HTTP responses: equivalence with the whole-message codec."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ohttp.bhttp import InformationalResponse, Response, decode_response, encode_response
from ohttp.bhttp_stream import (
    MAX_CONTENT_CHUNK,
    MAX_FIELD_SECTION,
    StreamingResponseDecoder,
    encode_content_chunk,
    encode_response_end,
    encode_response_head,
)
from ohttp.errors import MalformedError, OHTTPError, TruncatedError
from ohttp.varint import encode_varint

SETTINGS = settings(max_examples=60, deadline=None)
names = st.binary(min_size=1, max_size=16).map(bytes.lower)
fields = st.lists(st.tuples(names, st.binary(max_size=40)), max_size=5)
pieces_of_content = st.lists(st.binary(min_size=1, max_size=200), max_size=8)


def _split(data: bytes, fractions: list[float]) -> list[bytes]:
    cuts = sorted(int(f * len(data)) for f in fractions)
    bounds = [0, *cuts, len(data)]
    return [data[a:b] for a, b in zip(bounds, bounds[1:])]


def _stream(status: int, headers, content: list[bytes], trailers) -> bytes:
    return (
        encode_response_head(status, headers)
        + b"".join(encode_content_chunk(piece) for piece in content)
        + encode_response_end(trailers)
    )


@SETTINGS
@given(st.integers(200, 599), fields, pieces_of_content, fields, st.lists(st.floats(0, 1), max_size=10))
def test_streamed_response_matches_the_whole_message_codec(status, headers, content, trailers, cuts) -> None:
    wire = _stream(status, headers, content, trailers)
    assert decode_response(wire) == Response(status, headers, b"".join(content), trailers)
    decoder = StreamingResponseDecoder()
    received = [piece for part in _split(wire, cuts) for piece in decoder.feed(part)]
    decoder.finish()
    assert b"".join(received) == b"".join(content)
    assert decoder.head is not None and (decoder.head.status, decoder.head.headers) == (status, headers)
    assert decoder.trailers == trailers and decoder.complete


def test_whole_message_encoding_is_accepted_too() -> None:
    response = Response(200, [(b"a", b"b")], b"content", [(b"t", b"1")], [InformationalResponse(103, [(b"l", b"x")])])
    decoder = StreamingResponseDecoder()
    assert decoder.feed(encode_response(response, known_length=False, padding=5)) == [b"content"]
    decoder.finish()
    assert decoder.head.headers == [(b"a", b"b")] and decoder.trailers == [(b"t", b"1")]


def test_a_stream_cut_anywhere_is_truncated_never_short() -> None:
    wire = _stream(200, [(b"h", b"v")], [b"one", b"two"], [(b"t", b"x")])
    for end in range(len(wire)):
        decoder = StreamingResponseDecoder()
        decoder.feed(wire[:end])
        with pytest.raises(TruncatedError):
            decoder.finish()


def test_padding_after_the_end_is_zero_only() -> None:
    wire = _stream(200, [], [b"x"], [])
    decoder = StreamingResponseDecoder()
    decoder.feed(wire)
    assert decoder.feed(b"\x00\x00") == []
    with pytest.raises(MalformedError):
        decoder.feed(b"\x01")
    with pytest.raises(MalformedError):
        decoder.feed(b"\x00")


def test_known_length_framing_is_refused() -> None:
    with pytest.raises(MalformedError):
        StreamingResponseDecoder().feed(encode_response(Response(200)))


def test_oversized_sections_are_refused_before_buffering() -> None:
    head = encode_varint(3) + encode_varint(200)
    with pytest.raises(MalformedError):
        StreamingResponseDecoder().feed(head + encode_varint(MAX_FIELD_SECTION + 1))
    with pytest.raises(MalformedError):
        StreamingResponseDecoder().feed(head + b"\x00" + encode_varint(MAX_CONTENT_CHUNK + 1))


def test_encoder_refuses_what_would_end_the_content_early() -> None:
    with pytest.raises(ValueError):
        encode_content_chunk(b"")
    with pytest.raises(ValueError):
        encode_response_head(101, [])


@settings(max_examples=150, deadline=None)
@given(
    st.one_of(st.binary(max_size=400), st.binary(max_size=400).map(lambda tail: b"\x03\x40\xc8" + tail)),
    st.lists(st.floats(0, 1), max_size=5),
)
def test_arbitrary_bytes_raise_only_package_errors(data: bytes, cuts: list[float]) -> None:
    decoder = StreamingResponseDecoder()
    try:
        for part in _split(data, cuts):
            decoder.feed(part)
        decoder.finish()
    except OHTTPError:
        pass
