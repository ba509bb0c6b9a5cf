"""Server-sent events as the client reads them: any split, CR/LF variants, comments, limits."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from client.wire import SSEParser

SETTINGS = settings(max_examples=60, deadline=None)
payloads = st.lists(st.text(alphabet=st.characters(blacklist_characters="\r\n", blacklist_categories=("Cs",)),
                            min_size=1, max_size=30), min_size=1, max_size=8)


@SETTINGS
@given(payloads, st.sampled_from(["\n", "\r\n", "\r"]), st.lists(st.integers(0, 400), max_size=10))
def test_events_come_out_whole_whatever_the_split(events, newline, cuts) -> None:
    stream = "".join(f"data: {e}{newline}{newline}" for e in events).encode()
    bounds = [0, *sorted(min(c, len(stream)) for c in cuts), len(stream)]
    parser = SSEParser()
    received = [event for a, b in zip(bounds, bounds[1:]) for event in parser.feed(stream[a:b])]
    assert received == events


def test_multi_line_data_comments_and_other_fields() -> None:
    parser = SSEParser()
    stream = b": keep-alive\n\nevent: x\ndata: one\ndata:two\nid: 4\n\ndata\n\n"
    assert parser.feed(stream) == ["one\ntwo", ""]


def test_an_unfinished_event_is_not_delivered() -> None:
    parser = SSEParser()
    assert parser.feed(b"data: partial") == []
    assert parser.feed(b"\n") == []
    assert parser.feed(b"\n") == ["partial"]


def test_an_oversized_event_is_refused() -> None:
    parser = SSEParser(max_event=16)
    with pytest.raises(ValueError):
        parser.feed(b"data: " + b"x" * 64)
    parser = SSEParser(max_event=16)
    with pytest.raises(ValueError):
        parser.feed(b"data: 0123456789\ndata: 0123456789\n")
