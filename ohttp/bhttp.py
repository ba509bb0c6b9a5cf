"""Binary HTTP messages (RFC 9292): the plaintext inside every OHTTP encapsulation.

    Message {
      Framing Indicator (i),   # 0/1 known-length request/response, 2/3 indeterminate
      [Informational responses (status 100..199, field section)] ...,   # responses only
      Control Data,            # request: method, scheme, authority, path; response: status
      Header Section, Content, Trailer Section,
      Padding (..) = 0 bytes,
    }

Known-length sections carry a varint length; indeterminate ones end with a zero
varint. Trailing empty sections may be truncated (RFC 9292 section 3.8) and are
then read as empty. Field names are lower-cased on encode. Every length is
checked against the bytes actually present before anything is sliced, so a
decoder never allocates more than its input; all errors are `MalformedError`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import MalformedError
from .varint import decode_varint, encode_varint

Fields = list[tuple[bytes, bytes]]

KNOWN_LENGTH_REQUEST = 0
KNOWN_LENGTH_RESPONSE = 1
INDETERMINATE_LENGTH_REQUEST = 2
INDETERMINATE_LENGTH_RESPONSE = 3


@dataclass(slots=True)
class Request:
    """An HTTP request: control data, header fields, content and trailer fields."""

    method: bytes
    scheme: bytes
    authority: bytes
    path: bytes
    headers: Fields = field(default_factory=list)
    content: bytes = b""
    trailers: Fields = field(default_factory=list)


@dataclass(slots=True)
class InformationalResponse:
    """An interim (1xx) response that precedes the final one."""

    status: int
    headers: Fields = field(default_factory=list)


@dataclass(slots=True)
class Response:
    """An HTTP response: final status, fields, content, trailers, and any 1xx responses before it."""

    status: int
    headers: Fields = field(default_factory=list)
    content: bytes = b""
    trailers: Fields = field(default_factory=list)
    informational: list[InformationalResponse] = field(default_factory=list)


# --- Encoding --------------------------------------------------------------------------


def _length_prefixed(value: bytes) -> bytes:
    return encode_varint(len(value)) + value


def _encode_field_lines(fields: Fields) -> bytes:
    lines = []
    for name, value in fields:
        if not name:
            raise ValueError("a field name cannot be empty")
        lines.append(_length_prefixed(bytes(name).lower()) + _length_prefixed(bytes(value)))
    return b"".join(lines)


def _encode_fields(fields: Fields, known_length: bool) -> bytes:
    lines = _encode_field_lines(fields)
    return _length_prefixed(lines) if known_length else lines + b"\x00"


def _encode_content(content: bytes, known_length: bool) -> bytes:
    if known_length:
        return _length_prefixed(content)
    # One chunk then the terminator; an empty body is the terminator alone.
    return (_length_prefixed(content) if content else b"") + b"\x00"


def _encode_sections(
    headers: Fields, content: bytes, trailers: Fields, known_length: bool, truncate: bool
) -> bytes:
    sections = [
        _encode_fields(headers, known_length),
        _encode_content(bytes(content), known_length),
        _encode_fields(trailers, known_length),
    ]
    if truncate:
        # RFC 9292 section 3.8: trailing empty sections may be left out.
        while sections and sections[-1] == b"\x00":
            sections.pop()
    return b"".join(sections)


def encode_request(req: Request, *, known_length: bool = True, padding: int = 0, truncate: bool = False) -> bytes:
    """Encode `req`; `padding` zero bytes are appended, `truncate` drops trailing empty sections."""
    if padding < 0:
        raise ValueError("padding cannot be negative")
    framing = KNOWN_LENGTH_REQUEST if known_length else INDETERMINATE_LENGTH_REQUEST
    control = b"".join(_length_prefixed(bytes(part)) for part in (req.method, req.scheme, req.authority, req.path))
    body = _encode_sections(req.headers, req.content, req.trailers, known_length, truncate)
    return encode_varint(framing) + control + body + bytes(padding)


def encode_response(
    res: Response, *, known_length: bool = True, padding: int = 0, truncate: bool = False
) -> bytes:
    """Encode `res` with its informational responses first; options as for `encode_request`."""
    if padding < 0:
        raise ValueError("padding cannot be negative")
    if not 200 <= res.status <= 599:
        raise ValueError("a final response status is 200..599")
    framing = KNOWN_LENGTH_RESPONSE if known_length else INDETERMINATE_LENGTH_RESPONSE
    parts = [encode_varint(framing)]
    for interim in res.informational:
        if not 100 <= interim.status <= 199:
            raise ValueError("an informational response status is 100..199")
        parts.append(encode_varint(interim.status) + _encode_fields(interim.headers, known_length))
    parts.append(encode_varint(res.status))
    parts.append(_encode_sections(res.headers, res.content, res.trailers, known_length, truncate))
    return b"".join(parts) + bytes(padding)


# --- Decoding --------------------------------------------------------------------------


class _Reader:
    """A cursor over the input that never reads past its end."""

    __slots__ = ("data", "at")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.at = 0

    def at_end(self) -> bool:
        return self.at >= len(self.data)

    def varint(self) -> int:
        value, self.at = decode_varint(self.data, self.at)
        return value

    def take(self, length: int) -> bytes:
        if length > len(self.data) - self.at:
            raise MalformedError("a length field runs past the end of the message")
        start, self.at = self.at, self.at + length
        return self.data[start : self.at]

    def length_prefixed(self) -> bytes:
        return self.take(self.varint())


def _field_lines(reader: _Reader) -> Fields:
    """Known-length field lines up to the end of `reader`."""
    fields: Fields = []
    while not reader.at_end():
        name = reader.length_prefixed()
        if not name:
            raise MalformedError("a field name is empty")
        fields.append((name, reader.length_prefixed()))
    return fields


def _decode_fields(reader: _Reader, known_length: bool) -> Fields:
    if reader.at_end():
        return []  # truncated: an empty section
    if known_length:
        return _field_lines(_Reader(reader.length_prefixed()))
    fields: Fields = []
    while True:
        name = reader.length_prefixed()
        if not name:  # the zero-length name is the section terminator
            return fields
        fields.append((name, reader.length_prefixed()))


def _decode_content(reader: _Reader, known_length: bool) -> bytes:
    if reader.at_end():
        return b""
    if known_length:
        return reader.length_prefixed()
    chunks = []
    while True:
        chunk = reader.length_prefixed()
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def _check_padding(reader: _Reader) -> None:
    rest = reader.data[reader.at :]
    if rest.count(0) != len(rest):
        raise MalformedError("bytes after the message are not zero padding")


def _framing(reader: _Reader, known: int, indeterminate: int, what: str) -> bool:
    indicator = reader.varint()
    if indicator not in (known, indeterminate):
        raise MalformedError(f"the framing indicator does not announce a {what}")
    return indicator == known


def decode_request(data: bytes) -> Request:
    """Decode a Binary HTTP request (known or indeterminate length, padded or truncated)."""
    reader = _Reader(bytes(data))
    known_length = _framing(reader, KNOWN_LENGTH_REQUEST, INDETERMINATE_LENGTH_REQUEST, "request")
    method, scheme, authority, path = (reader.length_prefixed() for _ in range(4))
    headers = _decode_fields(reader, known_length)
    content = _decode_content(reader, known_length)
    trailers = _decode_fields(reader, known_length)
    _check_padding(reader)
    return Request(method, scheme, authority, path, headers, content, trailers)


def decode_response(data: bytes) -> Response:
    """Decode a Binary HTTP response with any informational responses before it."""
    reader = _Reader(bytes(data))
    known_length = _framing(reader, KNOWN_LENGTH_RESPONSE, INDETERMINATE_LENGTH_RESPONSE, "response")
    informational = []
    status = reader.varint()
    while 100 <= status <= 199:
        informational.append(InformationalResponse(status, _decode_interim_fields(reader, known_length)))
        status = reader.varint()
    if not 200 <= status <= 599:
        raise MalformedError("the response status code is outside 100..599")
    headers = _decode_fields(reader, known_length)
    content = _decode_content(reader, known_length)
    trailers = _decode_fields(reader, known_length)
    _check_padding(reader)
    return Response(status, headers, content, trailers, informational)


def _decode_interim_fields(reader: _Reader, known_length: bool) -> Fields:
    if reader.at_end():
        raise MalformedError("the message ends after an informational status; a final response must follow")
    return _decode_fields(reader, known_length)
