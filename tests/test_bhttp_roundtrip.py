"""Binary HTTP: property round trips, padding, truncation and malformed input."""

from __future__ import annotations

import random

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ohttp.bhttp import (
    InformationalResponse,
    Request,
    Response,
    decode_request,
    decode_response,
    encode_request,
    encode_response,
)
from ohttp.errors import MalformedError
from tests.http_strategies import requests, responses
from ohttp.varint import MAX_VARINT, decode_varint, encode_varint

SETTINGS = settings(max_examples=60, deadline=None)

layouts = st.fixed_dictionaries(
    {"known_length": st.booleans(), "padding": st.integers(0, 40), "truncate": st.booleans()}
)


ONE_MIB = random.Random(1).randbytes(1 << 20)


@SETTINGS
@given(requests, layouts)
@example(Request(b"POST", b"https", b"n", b"/v1", [(b"a", b"b")], ONE_MIB, [(b"t", b"")]), {"known_length": False, "padding": 0, "truncate": True})
def test_request_round_trip(request: Request, layout: dict) -> None:
    assert decode_request(encode_request(request, **layout)) == request


@SETTINGS
@given(responses, layouts)
@example(Response(200, [], ONE_MIB, [], [InformationalResponse(103)]), {"known_length": True, "padding": 3, "truncate": False})
def test_response_round_trip(response: Response, layout: dict) -> None:
    assert decode_response(encode_response(response, **layout)) == response


@SETTINGS
@given(st.integers(0, MAX_VARINT))
def test_varint_round_trip(value: int) -> None:
    encoded = encode_varint(value)
    assert decode_varint(encoded) == (value, len(encoded))
    assert len(encoded) == next(size for size, limit in ((1, 1 << 6), (2, 1 << 14), (4, 1 << 30), (8, 1 << 62)) if value < limit)


def test_varint_bounds() -> None:
    with pytest.raises(ValueError):
        encode_varint(MAX_VARINT + 1)
    with pytest.raises(ValueError):
        encode_varint(-1)
    with pytest.raises(MalformedError):
        decode_varint(b"\xc0\x00\x00")
    assert decode_varint(b"\x40\x25") == (37, 2)  # non-minimal forms are accepted (RFC 9000)


def test_field_names_are_lower_cased_on_encode() -> None:
    request = Request(b"GET", b"https", b"a", b"/", [(b"Content-Type", b"Text/Plain")])
    assert decode_request(encode_request(request)).headers == [(b"content-type", b"Text/Plain")]


def test_truncation_drops_only_trailing_empty_sections() -> None:
    base = encode_request(Request(b"GET", b"https", b"a", b"/"), truncate=True)
    with_trailer = Request(b"GET", b"https", b"a", b"/", trailers=[(b"t", b"1")])
    assert encode_request(with_trailer, truncate=True) == encode_request(with_trailer)
    assert len(base) == len(encode_request(Request(b"GET", b"https", b"a", b"/"))) - 3


@pytest.mark.parametrize("known_length", [True, False])
def test_non_zero_padding_is_rejected(known_length: bool) -> None:
    data = encode_request(Request(b"GET", b"https", b"a", b"/"), known_length=known_length, padding=4)
    assert decode_request(data).path == b"/"
    with pytest.raises(MalformedError):
        decode_request(data[:-1] + b"\x01")


@pytest.mark.parametrize("known_length", [True, False])
def test_cut_inside_a_section_is_malformed(known_length: bool) -> None:
    request = Request(b"POST", b"https", b"a", b"/x", [(b"h", b"v" * 10)], b"body" * 10, [(b"t", b"1")])
    data = encode_request(request, known_length=known_length)
    boundaries = set()
    for truncate_at in range(len(data)):
        try:
            decoded = decode_request(data[:truncate_at])
        except MalformedError:
            continue
        boundaries.add(truncate_at)
        assert decoded != request  # a cut message is never mistaken for the whole one
    assert len(boundaries) <= 3  # only the ends of control data, headers and content


def test_framing_indicator_must_match_the_message_kind() -> None:
    with pytest.raises(MalformedError):
        decode_request(encode_response(Response(200)))
    with pytest.raises(MalformedError):
        decode_response(encode_request(Request(b"GET", b"https", b"a", b"/")))
    with pytest.raises(MalformedError):
        decode_request(b"\x04")


@pytest.mark.parametrize("status", [0, 99, 600, 1000])
def test_status_out_of_range_is_rejected(status: int) -> None:
    with pytest.raises(MalformedError):
        decode_response(b"\x01" + encode_varint(status))
    with pytest.raises(ValueError):
        encode_response(Response(status))


def test_informational_response_needs_a_final_response() -> None:
    with pytest.raises(MalformedError):
        decode_response(b"\x01" + encode_varint(103))
    with pytest.raises(MalformedError):
        decode_response(b"\x01" + encode_varint(103) + b"\x00")


def test_empty_field_name_is_rejected() -> None:
    with pytest.raises(ValueError):
        encode_request(Request(b"GET", b"https", b"a", b"/", [(b"", b"v")]))
    known = b"\x00" + b"\x00" * 4 + b"\x02" + b"\x00\x00"
    with pytest.raises(MalformedError):
        decode_request(known)


def test_huge_length_fields_are_refused_without_allocating() -> None:
    huge = encode_varint(MAX_VARINT)
    for data in (b"\x00" + huge, b"\x00\x00\x00\x00\x00" + huge, b"\x02\x00\x00\x00\x00\x00" + huge):
        with pytest.raises(MalformedError):
            decode_request(data)
