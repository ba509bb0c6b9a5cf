"""Fuzzing every decoder: arbitrary and mutated bytes yield only the package's own errors.

No other exception type, no hang, and no allocation out of proportion to the
input (length fields are bounded by the bytes present before anything is sliced).
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ohttp.bhttp import Request, Response, decode_request, decode_response, encode_request, encode_response
from ohttp.chunked import ChunkedRequestOpener, ChunkedRequestSealer
from ohttp.encapsulation import RequestHeader
from ohttp.errors import OHTTPError
from ohttp.keys import KeyConfig, KeyRing, generate_key_pair
from ohttp.message import ClientRequest, decapsulate_request
from ohttp.varint import MAX_VARINT, decode_varint, encode_varint

SETTINGS = settings(max_examples=150, deadline=None)
RING = KeyRing(generate_key_pair(21))
CONFIG = RING.current.config
_, CLIENT = ClientRequest.encapsulate(CONFIG, b"request")
CLIENT_SEALER = ChunkedRequestSealer(CONFIG)
REQUEST_PREFIX = CLIENT_SEALER.start()  # a valid header and key share, so fuzzing reaches the chunks


def _chunked_request(pieces: list[bytes]) -> None:
    opener = ChunkedRequestOpener(RING, max_chunk_size=4096)
    for piece in pieces:
        opener.feed(piece)
    opener.finish()


def _chunked_response(pieces: list[bytes]) -> None:
    opener = CLIENT_SEALER.response_opener(max_chunk_size=4096)
    for piece in pieces:
        opener.feed(piece)
    opener.finish()


DECODERS: dict[str, Callable[[bytes], object]] = {
    "varint": decode_varint,
    "request_header": RequestHeader.decode,
    "key_config": KeyConfig.decode,
    "bhttp_request": decode_request,
    "bhttp_response": decode_response,
    "ohttp_request": lambda data: decapsulate_request(RING, data),
    "ohttp_response": CLIENT.open_response,
    "chunked_request": lambda data: _chunked_request([data]),
    "chunked_request_body": lambda data: _chunked_request([REQUEST_PREFIX, data]),
    "ohttp_request_body": lambda data: decapsulate_request(RING, REQUEST_PREFIX + data),
    "chunked_response": lambda data: _chunked_response([data]),
}


def _valid_samples() -> dict[str, bytes]:
    request, _ = ClientRequest.encapsulate(CONFIG, b"hello")
    chunked = REQUEST_PREFIX + CLIENT_SEALER.seal_chunk(b"abc") + CLIENT_SEALER.seal_chunk(b"de", final=True)
    gateway = ChunkedRequestOpener(RING)
    assert b"".join(gateway.chunks([chunked])) == b"abcde"
    writer = gateway.response_sealer()
    return {
        "key_config": CONFIG.encode(),
        "bhttp_request": encode_request(Request(b"GET", b"https", b"a", b"/", [(b"k", b"v")], b"body", [(b"t", b"x")])),
        "bhttp_indeterminate": encode_request(Request(b"POST", b"https", b"a", b"/", [(b"k", b"v")], b"x"), known_length=False),
        "bhttp_response": encode_response(Response(200, [(b"k", b"v")], b"body"), known_length=False),
        "ohttp_request": request,
        "chunked_request": chunked,
        "chunked_response": writer.seal_chunk(b"tok") + writer.seal_chunk(b"", final=True),
    }


SAMPLES = _valid_samples()


def _expect_only_package_errors(decoder: Callable[[bytes], object], data: bytes) -> None:
    try:
        decoder(data)
    except OHTTPError as error:
        assert error.__cause__ is None
    # Any other exception type propagates and fails the test.


@pytest.mark.parametrize("name", sorted(DECODERS))
@SETTINGS
@given(data=st.binary(max_size=600))
def test_arbitrary_bytes(name: str, data: bytes) -> None:
    _expect_only_package_errors(DECODERS[name], data)


mutations = st.lists(
    st.tuples(st.sampled_from(["flip", "insert", "delete", "varint"]), st.integers(0, 10_000), st.integers(0, 255)),
    min_size=1,
    max_size=4,
)


def _mutate(data: bytes, edits: list[tuple[str, int, int]]) -> bytes:
    out = bytearray(data)
    for kind, position, value in edits:
        at = position % (len(out) + 1)
        if kind == "flip" and at < len(out):
            out[at] ^= value or 1
        elif kind == "insert":
            out[at:at] = bytes([value])
        elif kind == "delete" and at < len(out):
            del out[at]
        elif kind == "varint":
            out[at:at] = encode_varint(MAX_VARINT - value)  # a huge length field
    return bytes(out)


@pytest.mark.parametrize(
    ("sample", "decoder"),
    [
        ("key_config", "key_config"),
        ("bhttp_request", "bhttp_request"),
        ("bhttp_indeterminate", "bhttp_request"),
        ("bhttp_response", "bhttp_response"),
        ("ohttp_request", "ohttp_request"),
        ("chunked_request", "chunked_request"),
    ],
)
@SETTINGS
@given(edits=mutations)
def test_mutated_valid_messages(sample: str, decoder: str, edits) -> None:
    _expect_only_package_errors(DECODERS[decoder], _mutate(SAMPLES[sample], edits))


@SETTINGS
@given(edits=mutations, fractions=st.lists(st.floats(0, 1), max_size=6))
def test_mutated_chunked_response_in_pieces(edits, fractions: list[float]) -> None:
    wire = _mutate(SAMPLES["chunked_response"], edits)
    cuts = sorted(int(f * len(wire)) for f in fractions)
    bounds = [0, *cuts, len(wire)]
    pieces = [wire[a:b] for a, b in zip(bounds, bounds[1:])]
    if wire == SAMPLES["chunked_response"]:
        _chunked_response(pieces)  # an unchanged stream still opens
        return
    try:
        _chunked_response(pieces)
    except OHTTPError:
        return
    raise AssertionError("a mutated response stream was accepted")


@pytest.mark.parametrize("name", sorted(DECODERS))
@settings(max_examples=25, deadline=None)
@given(prefix=st.binary(max_size=48), length=st.integers(1 << 20, MAX_VARINT))
def test_huge_length_fields_allocate_nothing_large(name: str, prefix: bytes, length: int) -> None:
    data = prefix + encode_varint(length) + bytes(16)
    tracemalloc.start()
    try:
        _expect_only_package_errors(DECODERS[name], data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 256 * 1024
