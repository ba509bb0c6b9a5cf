"""RFC 9292 section 5 examples (and RFC 9458's messages): decoded and re-encoded byte for byte."""

from __future__ import annotations

import json

import pytest

from ohttp.bhttp import InformationalResponse, Request, Response, decode_request, decode_response, encode_request, encode_response
from tests.conftest import vectors_path

EXAMPLES = {e["name"]: bytes.fromhex(e["hex"]) for e in json.loads((vectors_path() / "bhttp-rfc9292.json").read_text())["examples"]}


def _example(prefix: str) -> bytes:
    (match,) = [data for name, data in EXAMPLES.items() if name.startswith(prefix)]
    return match


HELLO_REQUEST = Request(
    b"GET",
    b"https",
    b"",
    b"/hello.txt",
    [
        (b"user-agent", b"curl/7.16.3 libcurl/7.16.3 OpenSSL/0.9.7l zlib/1.2.3"),
        (b"host", b"www.example.com"),
        (b"accept-language", b"en, mi"),
    ],
)


def test_known_length_request() -> None:
    data = _example("known-length request")
    assert decode_request(data) == HELLO_REQUEST
    assert encode_request(HELLO_REQUEST) == data


def test_indeterminate_length_request_with_padding() -> None:
    data = _example("indeterminate-length request")
    assert decode_request(data) == HELLO_REQUEST
    assert encode_request(HELLO_REQUEST, known_length=False, padding=10) == data


def test_indeterminate_response_with_informational() -> None:
    data = _example("indeterminate-length response")
    response = decode_response(data)
    assert response.informational == [
        InformationalResponse(102, [(b"running", b'"sleep 15"')]),
        InformationalResponse(
            103,
            [(b"link", b"</style.css>; rel=preload; as=style"), (b"link", b"</script.js>; rel=preload; as=script")],
        ),
    ]
    assert response.status == 200
    assert (b"content-type", b"text/plain") in response.headers
    assert response.content == b"Hello World! My content includes a trailing CRLF.\r\n"
    assert response.trailers == []
    assert encode_response(response, known_length=False) == data


def test_known_length_response_with_trailer() -> None:
    data = _example("known-length response 200")
    expected = Response(200, [], b"This content contains CRLF.\r\n", [(b"trailer", b"text")])
    assert decode_response(data) == expected
    assert encode_response(expected) == data


@pytest.mark.parametrize("truncate", [False, True])
def test_rfc9458_request_is_truncated_after_control_data(truncate: bool) -> None:
    data = _example("RFC 9458 request")
    request = Request(b"GET", b"https", b"example.com", b"/")
    assert decode_request(data) == request
    assert (encode_request(request, truncate=truncate) == data) is truncate


def test_rfc9458_response_is_truncated_after_status() -> None:
    data = _example("RFC 9458 response")
    assert decode_response(data) == Response(200)
    assert encode_response(Response(200), truncate=True) == data
