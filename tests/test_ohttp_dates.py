"""HTTP dates for the inner request's Date check (RFC 9458 section 6.5)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ohttp.dates import date_fields, format_http_date, parse_http_date

SETTINGS = settings(max_examples=200, deadline=None)


@SETTINGS
@given(seconds=st.floats(min_value=0, max_value=253_402_300_799, allow_nan=False))  # through 9999-12-31
def test_a_formatted_date_parses_back_to_its_whole_second(seconds: float) -> None:
    value = format_http_date(seconds)
    assert value.endswith(b" GMT") and len(value) == 29  # IMF-fixdate: "Sun, 06 Nov 1994 08:49:37 GMT"
    assert parse_http_date(value) == float(int(seconds))


def test_the_rfc_9110_example_and_its_obsolete_forms_parse() -> None:
    assert parse_http_date(b"Sun, 06 Nov 1994 08:49:37 GMT") == 784111777.0
    assert parse_http_date(b"Sun, 06 Nov 1994 08:49:37 -0000") == 784111777.0
    assert parse_http_date(b"Sun, 06 Nov 1994 09:49:37 +0100") == 784111777.0


@SETTINGS
@given(garbage=st.binary(max_size=64))
def test_anything_else_is_a_value_error_and_nothing_else(garbage: bytes) -> None:
    try:
        parse_http_date(garbage)
    except ValueError as error:
        assert str(error) == "not an HTTP date"  # never the input


@pytest.mark.parametrize("value", [b"", b"yesterday", b"Sun, 32 Nov 1994 08:49:37 GMT", b"\xff\xfe GMT"])
def test_known_non_dates_are_refused(value: bytes) -> None:
    with pytest.raises(ValueError, match="not an HTTP date"):
        parse_http_date(value)


def test_date_fields_are_found_whatever_their_case_and_in_order() -> None:
    fields = [(b"Date", b"a"), (b"content-type", b"x"), (b"date", b"b"), (b"DATE", b"c")]
    assert date_fields(fields) == [b"a", b"b", b"c"]
    assert date_fields([(b"content-type", b"x")]) == []
