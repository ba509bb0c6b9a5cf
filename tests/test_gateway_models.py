"""Parsing the infer body: strict, bounded, and never echoing what it was given."""

from __future__ import annotations

import base64
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.models import parse_infer_body
from serving.errors import MalformedRequestError

CANARY = "CANARY-models-41c2-TEAL-IBIS"
NODE_ID = "0123456789abcdef" * 2

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20) | st.just(CANARY),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12) | st.just(CANARY), inner, max_size=4),
    max_leaves=12,
)


def test_a_well_formed_body_yields_the_candidates_bytes() -> None:
    body = {"candidates": [
        {"node_id": NODE_ID, "media_type": "message/ohttp-req", "encapsulated": base64.b64encode(b"\x00\x01").decode()},
        {"node_id": "f" * 64, "media_type": "message/ohttp-chunked-req", "encapsulated": base64.b64encode(b"z").decode()},
    ]}
    first, second = parse_infer_body(json.dumps(body).encode(), max_candidates=8)
    assert (first.node_id, first.media_type, first.encapsulated) == (NODE_ID, "message/ohttp-req", b"\x00\x01")
    assert (second.media_type, second.encapsulated) == ("message/ohttp-chunked-req", b"z")


def test_the_candidate_bound_is_the_gateways_setting() -> None:
    body = {"candidates": [{"node_id": f"{index:032x}", "media_type": "message/ohttp-req", "encapsulated": "AA=="}
                           for index in range(3)]}
    assert len(parse_infer_body(json.dumps(body).encode(), max_candidates=3)) == 3
    try:
        parse_infer_body(json.dumps(body).encode(), max_candidates=2)
    except MalformedRequestError as error:
        assert "2" in error.message
    else:
        raise AssertionError("three candidates passed a bound of two")


@settings(max_examples=150, deadline=None)
@given(value=json_values)
def test_arbitrary_json_is_refused_without_echo(value: object) -> None:
    raw = json.dumps({"candidates": value} if isinstance(value, list) else value).encode()
    try:
        parse_infer_body(raw, max_candidates=8)
    except MalformedRequestError as error:
        assert CANARY not in error.message
        assert error.status == 400


@settings(max_examples=150, deadline=None)
@given(raw=st.binary(max_size=200))
def test_arbitrary_bytes_are_refused_without_echo(raw: bytes) -> None:
    try:
        parse_infer_body(raw + CANARY.encode(), max_candidates=8)
    except MalformedRequestError as error:
        assert CANARY not in error.message
    else:
        raise AssertionError("bytes that are not JSON parsed as a body")
