"""Framing shared by both directions of chunked OHTTP: buffering, chunk parsing, chunk frames.

A stream is a sequence of `Length (i) || sealed chunk` frames with Length > Nt,
then a zero indicator after which the final sealed chunk runs to the end of the
stream. Nothing here sees plaintext; it only cuts and bounds ciphertext.
"""

from __future__ import annotations

from .errors import MalformedError, OHTTPError, TruncatedError
from .varint import encode_varint, try_decode_varint

FINAL_INDICATOR = b"\x00"


class StreamBuffer:
    """Bytes received but not yet consumed; consumption moves an offset instead of copying."""

    __slots__ = ("_data", "_at")

    def __init__(self) -> None:
        self._data = bytearray()
        self._at = 0

    def append(self, data: bytes) -> None:
        if self._at and self._at * 2 >= len(self._data):
            del self._data[: self._at]
            self._at = 0
        self._data += data

    def __len__(self) -> int:
        return len(self._data) - self._at

    def peek_varint(self) -> tuple[int, int] | None:
        """(value, encoded size) of the varint at the front, or None if incomplete."""
        decoded = try_decode_varint(self._data, self._at)
        return None if decoded is None else (decoded[0], decoded[1] - self._at)

    def take(self, length: int) -> bytes:
        start, self._at = self._at, self._at + length
        return bytes(self._data[start : self._at])

    def skip(self, length: int) -> None:
        self._at += length

    def view(self) -> bytes:
        return bytes(self._data[self._at :])


class ChunkParser:
    """The framing shared by both directions: length-prefixed chunks, then a final one.

    `next_chunk` returns a non-final ciphertext once complete; after the zero
    indicator it sets `in_final` and the rest of the stream is the final chunk.
    """

    __slots__ = ("buffer", "in_final", "_tag_length", "_max_sealed")

    def __init__(self, tag_length: int, max_chunk_size: int) -> None:
        self.buffer = StreamBuffer()
        self.in_final = False
        self._tag_length = tag_length
        self._max_sealed = max_chunk_size + tag_length

    def next_chunk(self) -> bytes | None:
        if self.in_final:
            self._check_final_size()
            return None
        header = self.buffer.peek_varint()
        if header is None:
            return None
        length, size = header
        if length == 0:
            self.buffer.skip(size)
            self.in_final = True
            self._check_final_size()
            return None
        if length <= self._tag_length:
            raise MalformedError("a non-final chunk is empty or shorter than its tag")
        if length > self._max_sealed:
            raise MalformedError("a chunk is larger than this reader accepts; send smaller chunks")
        if len(self.buffer) < size + length:
            return None
        self.buffer.skip(size)
        return self.buffer.take(length)

    def final_ciphertext(self) -> bytes:
        if not self.in_final:
            raise TruncatedError("the stream ended before its final chunk; discard the partial message")
        if len(self.buffer) < self._tag_length:
            raise TruncatedError("the stream ended inside its final chunk; discard the partial message")
        return self.buffer.view()

    def _check_final_size(self) -> None:
        if len(self.buffer) > self._max_sealed:
            raise MalformedError("the final chunk is larger than this reader accepts; send smaller chunks")


class FailsOnce:
    """Refuses use after an error, so a failed stream cannot be resumed into a short answer."""

    __slots__ = ("_failed",)

    def __init__(self) -> None:
        self._failed: type[OHTTPError] | None = None

    def _guard(self) -> None:
        if self._failed is not None:
            raise self._failed("this stream already failed; discard it")

    def _fail(self, error: OHTTPError) -> None:
        self._failed = type(error)

    def feed(self, data: bytes) -> list[bytes]:
        """Consume one piece of the stream; return the chunks it completed (subclasses parse in `_feed`)."""
        self._guard()
        if self._done:
            raise MalformedError("data arrived after the stream was finished")
        try:
            return self._feed(bytes(data))
        except OHTTPError as error:
            self._fail(error)
            raise

    def _feed(self, data: bytes) -> list[bytes]:
        raise NotImplementedError


def chunk_frame(sealed: bytes, final: bool) -> bytes:
    """A sealed chunk on the wire: its length, or the zero indicator before the final one."""
    return FINAL_INDICATOR + sealed if final else encode_varint(len(sealed)) + sealed


def check_chunk(data: bytes, final: bool, done: bool, max_chunk_size: int) -> None:
    """Refuse to seal what a conforming reader would reject (ValueError: a caller mistake)."""
    if done:
        raise ValueError("the final chunk was already sealed; start a new stream")
    if not final and not data:
        raise ValueError("a non-final chunk cannot be empty; send data or seal the final chunk")
    if len(data) > max_chunk_size:
        raise ValueError(f"a chunk holds at most {max_chunk_size} bytes; split the data")


def chunk_nonce(base: int, counter: int, length: int) -> bytes:
    """Response chunk nonce: the base nonce XOR the chunk counter, big-endian."""
    return (base ^ counter).to_bytes(length, "big")
