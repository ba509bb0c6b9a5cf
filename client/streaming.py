"""Streamed answers: reading a node's chunked answer off the wire, and the `Stream` a caller iterates.

A streamed answer is read in two steps. `StreamedAnswer.read_head` reads until the node's status is
known, so a refusal (an unknown model, bad parameters) is raised before the caller gets a Stream, as
OpenAI's SDK raises on an error status. `StreamedAnswer.events` then yields each event's payload,
checks that the answer reached its authenticated end and verifies the node's receipt for the whole
body (`client.receipts`), which comes last: a stream whose receipt is missing or refused ends in
`ReceiptRefusedError`, and its output is to be discarded as a truncated stream's is. Nothing read is
ever logged or put in an error.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Generic, NoReturn, Protocol, TypeVar

import httpx

from attestation.receipts import Receipt
from client import wire
from client.errors import NodeError, ResponseIntegrityError, StreamTruncatedError
from client.receipts import ReceiptCheck
from client.types import Route
from ohttp import OHTTPError, TruncatedError

T = TypeVar("T")


class AnswerHandle(Protocol):
    """What a Stream needs of the answer it reads: closing it, and its receipt once verified."""

    receipt: Receipt | None

    def close(self) -> None: ...


class Stream(Generic[T]):
    """An iterator over streamed chunks; `route` says which node serves it and what was verified, and
    `receipt` is the node's verified receipt for the whole answer once the stream has ended (None before)."""

    def __init__(self, chunks: Iterator[T], route: Route, answer: AnswerHandle) -> None:
        self._chunks = chunks
        self.route = route
        self._answer = answer
        self._close: Callable[[], None] = answer.close

    @property
    def receipt(self) -> Receipt | None:
        return self._answer.receipt

    def __iter__(self) -> Iterator[T]:
        return self

    def __next__(self) -> T:
        return next(self._chunks)

    def close(self) -> None:
        """Stop reading and release the connection."""
        self._close()

    def __enter__(self) -> Stream[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StreamedAnswer:
    """A chunked answer being read: its head first, then its events; the connection closes at the end."""

    def __init__(self, response: httpx.Response, target: wire.SealedRequest, check: ReceiptCheck) -> None:
        self._response = response
        self._node_id = target.node_id
        self._decoder = target.stream_decoder()
        self._pieces = response.iter_raw()
        self._early: list[Any] = []  # events that arrived in the same pieces as the head
        self._check = check
        self.receipt: Receipt | None = None  # verified, once the answer has ended

    def close(self) -> None:
        self._response.close()

    def read_head(self) -> bool:
        """Reads until the node's status is known; True if it is 200."""
        with self._errors_translated(close=True):
            while self._decoder.status is None:
                piece = next(self._pieces, None)
                if piece is None:
                    break  # a stream cut before its head; events() reports the truncation
                self._early += self._decoder.feed(piece)
        return self._decoder.status == 200

    def raise_refusal(self) -> NoReturn:
        """Reads the rest of an answer whose status is not 200 and raises what it says."""
        for _ in self.events():  # an error body carries no events; the end raises NodeError
            pass
        raise ResponseIntegrityError(self._node_id, "the node refused without saying why")

    def events(self) -> Iterator[Any]:
        """Each event's JSON payload; raises at the end if the answer was an error or was cut short."""
        try:
            with self._errors_translated(close=False):
                yield from self._early
                self._early = []
                for piece in self._pieces:
                    yield from self._decoder.feed(piece)
                error = self._decoder.finish()
        finally:
            self._response.close()
        if error is not None:
            raise NodeError.from_body(error.status, error.content, self._node_id, error.node_time())
        if not self._decoder.done:
            raise StreamTruncatedError(self._node_id, "the event stream")
        self.receipt = self._check.verify(self._decoder.trailers, self._decoder.body_sha256, 200)

    @contextlib.contextmanager
    def _errors_translated(self, close: bool) -> Iterator[None]:
        try:
            yield
        except (TruncatedError, httpx.TransportError):
            self._close_if(close)
            raise StreamTruncatedError(self._node_id) from None
        except (OHTTPError, ValueError):
            self._close_if(close)
            raise ResponseIntegrityError(self._node_id, "the node's streamed answer did not authenticate or parse") from None

    def _close_if(self, close: bool) -> None:
        if close:
            self._response.close()
