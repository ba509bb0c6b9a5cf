"""Hypothesis strategies for HTTP messages, shared by the Binary HTTP and whole-stack round trips.

Content is either small or up to 1 MiB (drawn as a length and a seed, so that hypothesis does not
have to generate a megabyte byte by byte).
"""

from __future__ import annotations

import random

from hypothesis import strategies as st

from ohttp.bhttp import InformationalResponse, Request, Response

names = st.binary(min_size=1, max_size=24).map(bytes.lower)
fields = st.lists(st.tuples(names, st.binary(max_size=64)), max_size=6)
small_content = st.binary(max_size=512)
large_content = st.tuples(st.integers(0, 1 << 20), st.integers(0, 2**32)).map(
    lambda spec: random.Random(spec[1]).randbytes(spec[0])
)
content = st.one_of(small_content, large_content)
requests = st.builds(
    Request,
    method=st.sampled_from([b"GET", b"POST", b"PUT", b"DELETE"]) | st.binary(max_size=12),
    scheme=st.sampled_from([b"https", b"http", b""]),
    authority=st.binary(max_size=40),
    path=st.binary(max_size=80),
    headers=fields,
    content=content,
    trailers=fields,
)
responses = st.builds(
    Response,
    status=st.integers(200, 599),
    headers=fields,
    content=content,
    trailers=fields,
    informational=st.lists(st.builds(InformationalResponse, st.integers(100, 199), fields), max_size=3),
)
