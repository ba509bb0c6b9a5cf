"""Streaming Binary HTTP responses (RFC 9292 indeterminate-length form).

A node streams its answer as one indeterminate-length BHTTP response spread over many chunked-OHTTP
chunks: the head (status and header fields) first, then one content chunk per piece of output,
then the end (content terminator and trailers). The client parses it incrementally, as the
decrypted chunks arrive, without ever buffering more than one bounded piece.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .bhttp import INDETERMINATE_LENGTH_RESPONSE, Fields, _encode_field_lines
from .errors import MalformedError, TruncatedError
from .varint import encode_varint, try_decode_varint

MAX_FIELD_SECTION = 64 * 1024
MAX_CONTENT_CHUNK = 1 << 20


def encode_response_head(status: int, headers: Fields) -> bytes:
    """Framing indicator, final status and the header section of an indeterminate-length response."""
    if not 200 <= status <= 599:
        raise ValueError("a final response status is 200..599")
    return encode_varint(INDETERMINATE_LENGTH_RESPONSE) + encode_varint(status) + _encode_field_lines(headers) + b"\x00"


def encode_content_chunk(data: bytes) -> bytes:
    """One content chunk; empty data would end the content, so it is refused."""
    if not data:
        raise ValueError("an empty content chunk would terminate the content")
    return encode_varint(len(data)) + bytes(data)


def encode_response_end(trailers: Fields = ()) -> bytes:
    """Content terminator, trailer section and its terminator."""
    return b"\x00" + _encode_field_lines(list(trailers)) + b"\x00"


@dataclass(slots=True)
class ResponseHead:
    """The final status and header fields of a streamed response."""

    status: int
    headers: Fields = field(default_factory=list)


class StreamingResponseDecoder:
    """Feed decrypted bytes in any split; get the head once, then content pieces, then the trailers."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._state = "framing"
        self.head: ResponseHead | None = None
        self.trailers: Fields | None = None
        self._fields: Fields = []
        self._section_bytes = 0
        self._pending_status = 0
        self._failed = False

    @property
    def complete(self) -> bool:
        return self._state == "done"

    def feed(self, data: bytes) -> list[bytes]:
        """Returns the content pieces completed by `data` (the head becomes available on `.head`)."""
        if self._failed:
            raise MalformedError("this streamed response already failed to parse; discard it")
        if self._state == "done":
            if data.count(0) != len(data):  # only zero padding may follow the end
                self._failed = True
                raise MalformedError("non-zero bytes after the end of a streamed response")
            return []
        self._buffer += data
        pieces: list[bytes] = []
        try:
            while self._advance(pieces):
                pass
        except MalformedError:
            self._failed = True
            raise
        return pieces

    def finish(self) -> None:
        """Call at the end of the stream: a response that did not end is truncated, never silently short."""
        if self._failed:
            raise MalformedError("this streamed response failed to parse; discard it")
        if self._state != "done":
            raise TruncatedError("the streamed response ended before its last section")

    def _varint(self) -> int | None:
        decoded = try_decode_varint(self._buffer)
        if decoded is None:
            return None
        value, used = decoded
        del self._buffer[:used]
        return value

    def _advance(self, pieces: list[bytes]) -> bool:
        handler = getattr(self, f"_on_{self._state}")
        return handler(pieces)

    def _on_framing(self, pieces: list[bytes]) -> bool:
        framing = self._varint()
        if framing is None:
            return False
        if framing != INDETERMINATE_LENGTH_RESPONSE:
            raise MalformedError("a streamed response must use the indeterminate-length framing")
        self._state = "status"
        return True

    def _on_status(self, pieces: list[bytes]) -> bool:
        status = self._varint()
        if status is None:
            return False
        if not 100 <= status <= 599:
            raise MalformedError("response status out of range")
        self._pending_status = status
        self._state = "headers"
        return True

    def _on_headers(self, pieces: list[bytes]) -> bool:
        finished = self._read_fields()
        if finished is None:
            return False
        if self._pending_status < 200:  # an informational response: its fields are dropped
            self._state = "status"
        else:
            self.head = ResponseHead(self._pending_status, finished)
            self._state = "content"
        return True

    def _on_content(self, pieces: list[bytes]) -> bool:
        decoded = try_decode_varint(self._buffer)
        if decoded is None:
            return False
        length, used = decoded
        if length > MAX_CONTENT_CHUNK:
            raise MalformedError("a content chunk exceeds the size limit")
        if length == 0:
            del self._buffer[:used]
            self._state = "trailers"
            return True
        if len(self._buffer) < used + length:
            return False
        pieces.append(bytes(self._buffer[used : used + length]))
        del self._buffer[: used + length]
        return True

    def _on_trailers(self, pieces: list[bytes]) -> bool:
        finished = self._read_fields()
        if finished is None:
            return False
        self.trailers = finished
        self._state = "done"
        if any(self._buffer.strip(b"\x00")):
            raise MalformedError("non-zero padding after a streamed response")
        self._buffer.clear()
        return False

    def _on_done(self, pieces: list[bytes]) -> bool:
        return False

    def _read_fields(self) -> Fields | None:
        """Reads field lines until the zero terminator; None while more bytes are needed."""
        while True:
            name = self._length_prefixed(allow_empty=True)
            if name is None:
                return None
            if name == b"":
                fields, self._fields, self._section_bytes = self._fields, [], 0
                return fields
            value = self._length_prefixed(allow_empty=True, after=name)
            if value is None:
                return None
            self._fields.append((name, value))

    def _length_prefixed(self, allow_empty: bool, after: bytes | None = None) -> bytes | None:
        decoded = try_decode_varint(self._buffer)
        if decoded is None:
            self._restore(after)
            return None
        length, used = decoded
        self._section_bytes += used + length
        if self._section_bytes > MAX_FIELD_SECTION:
            raise MalformedError("a field section exceeds the size limit")
        if len(self._buffer) < used + length:
            self._section_bytes -= used + length
            self._restore(after)
            return None
        value = bytes(self._buffer[used : used + length])
        del self._buffer[: used + length]
        return value

    def _restore(self, name: bytes | None) -> None:
        # A field line split across feeds: put its name back so the whole line is read again.
        if name is not None:
            self._buffer[:0] = encode_varint(len(name)) + name
            self._section_bytes -= len(encode_varint(len(name))) + len(name)
