"""What travels: the inner Binary HTTP request, its OHTTP encapsulation per candidate, and
the decryption and parsing of answers (whole, or streamed as chunked OHTTP carrying SSE).

Whole answers:    BHTTP request → `message/ohttp-req`; reply `message/ohttp-res` → BHTTP response.
Streamed answers: BHTTP request in one final chunk → `message/ohttp-chunked-req`; reply
                  `message/ohttp-chunked-res` whose plaintext is one indeterminate-length BHTTP
                  response whose content is server-sent events, one per engine delta.
Either answer ends with the node's receipt in the BHTTP trailer `veil-receipt` (`client.receipts`).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

from attestation.receipts import RECEIPT_TRAILER, ReceiptFormatError
from ohttp import (
    OHTTP_CHUNKED_REQUEST,
    OHTTP_REQUEST,
    ChunkedRequestSealer,
    ChunkedResponseOpener,
    ClientContext,
    ClientRequest,
    DecryptionError,
    KeyConfig,
    Request,
    TruncatedError,
    decode_response,
    encode_request,
)
from ohttp.bhttp_stream import StreamingResponseDecoder
from ohttp.dates import date_fields, format_http_date, parse_http_date
from protocol import codes

INNER_AUTHORITY = b"veil.node"
MAX_SSE_EVENT = 1 << 20
MAX_ERROR_BODY = 64 * 1024
DONE = "[DONE]"


def build_request(method: str, path: str, body: dict[str, Any] | None = None, now: float | None = None) -> bytes:
    """The inner request as Binary HTTP: an OpenAI-style call addressed to the node itself.

    It carries the sender's clock in `Date` (inside the encryption, so only the node sees it): the
    node refuses requests outside its window, which bounds how long a captured ciphertext replays.
    """
    headers = [(b"date", format_http_date(time.time() if now is None else now))]
    if body is not None:
        headers.append((b"content-type", b"application/json"))
    content = json.dumps(body, separators=(",", ":")).encode() if body is not None else b""
    request = Request(method.encode("ascii"), b"https", INNER_AUTHORITY, path.encode("ascii"), headers, content)
    return encode_request(request)


@dataclass(slots=True)
class SealedRequest:
    """One candidate's encapsulation and what opens the answer to it (never sent anywhere)."""

    node_id: str
    media_type: str
    encapsulated: bytes
    context: ClientContext | None = None
    sealer: ChunkedRequestSealer | None = None
    request: bytes = field(default=b"", repr=False)  # the plaintext BHTTP request, for its receipt's check

    @property
    def streaming(self) -> bool:
        return self.sealer is not None

    def open_whole(self, data: bytes) -> InnerResponse:
        """Decrypt and parse a `message/ohttp-res` answer (raises ohttp errors if it does not authenticate)."""
        assert self.context is not None, "a streamed request is answered in chunks"
        response = decode_response(self.context.open_response(data))
        return InnerResponse(response.status, response.content, tuple(response.headers), tuple(response.trailers))

    def stream_decoder(self) -> StreamDecoder:
        """A fresh decoder for the chunked answer to this request."""
        assert self.sealer is not None, "a whole request is answered in one piece"
        return StreamDecoder(self.sealer.response_opener())


def seal(node_id: str, key_config: bytes, bhttp_request: bytes, streaming: bool) -> SealedRequest:
    """Encapsulate the inner request to one node's key configuration (a fresh HPKE context each time)."""
    config = KeyConfig.decode(key_config)
    if streaming:
        sealer = ChunkedRequestSealer(config)
        return SealedRequest(node_id, OHTTP_CHUNKED_REQUEST, sealer.seal_chunk(bhttp_request, final=True), sealer=sealer,
                             request=bhttp_request)
    encapsulated, context = ClientRequest.encapsulate(config, bhttp_request)
    return SealedRequest(node_id, OHTTP_REQUEST, encapsulated, context=context, request=bhttp_request)


@dataclass(frozen=True, slots=True)
class InnerResponse:
    """The node's decrypted HTTP answer."""

    status: int
    content: bytes
    headers: tuple[tuple[bytes, bytes], ...] = ()
    trailers: tuple[tuple[bytes, bytes], ...] = ()

    def json(self) -> Any:
        return json.loads(self.content)

    def node_time(self) -> float | None:
        """The node's clock from its `Date` field, if it sent a valid one (it does when refusing ours)."""
        dates = date_fields(list(self.headers))
        if len(dates) != 1:
            return None
        try:
            return parse_http_date(dates[0])
        except ValueError:
            return None


def receipt_of(trailers: tuple[tuple[bytes, bytes], ...]) -> bytes | None:
    """The one `veil-receipt` trailer's value; None without one, ReceiptFormatError for two (which to trust?)."""
    values = [value for name, value in trailers if name.lower() == RECEIPT_TRAILER]
    if len(values) > 1:
        raise ReceiptFormatError("the answer carries more than one receipt")
    return values[0] if values else None


# The gateway's refusals that waiting does not cure, and what to do about each (its codes, never its text).
_GATEWAY_ADVICE = {
    codes.UNDECRYPTABLE: "the node could not decrypt the request (altered on the way, or not sealed to its key); "
                     "sending the same bytes again cannot help",
    codes.UNKNOWN_KEY: "the node does not hold the key the request was sealed to, even in a freshly fetched "
                   "directory; send it again once the gateway lists the node's current key",
    codes.NODE_TIMEOUT: "the node did not accept the request in time and may still run it; send it again only "
                    "if running it twice is acceptable",
}


def gateway_advice(code: str) -> str:
    """What to do about a gateway refusal with error code `code`."""
    return _GATEWAY_ADVICE.get(code, "see the error code")


def error_code(content: bytes) -> str:
    """The `error.code` of an OpenAI-style error body, or "unknown" (the message is never shown)."""
    try:
        error = json.loads(content).get("error")
    except (ValueError, AttributeError):
        return "unknown"
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) else "unknown"


class SSEParser:
    """Server-sent events (the WHATWG format): feed bytes in any split, get each event's data."""

    def __init__(self, max_event: int = MAX_SSE_EVENT) -> None:
        self._buffer = bytearray()
        self._data: list[str] = []
        self._size = 0
        self._max_event = max_event
        self._after_cr = False  # a line ended with CR: an LF right after it belongs to that line end

    def feed(self, data: bytes) -> list[str]:
        """The data of every event completed by `data`, in order."""
        self._buffer += data
        events: list[str] = []
        if self._after_cr and self._buffer[:1] == b"\n":
            del self._buffer[:1]
        self._after_cr = False
        while (end := self._line_end()) is not None:
            line, skip = end
            text = bytes(self._buffer[:line]).decode("utf-8")
            del self._buffer[: line + skip]
            self._line(text, events)
        if len(self._buffer) > self._max_event:
            raise ValueError("a server-sent event exceeds the size limit")
        return events

    def _line_end(self) -> tuple[int, int] | None:
        for index, byte in enumerate(self._buffer):
            if byte == 0x0A:
                return index, 1
            if byte == 0x0D:
                if index + 1 == len(self._buffer):
                    self._after_cr = True  # the LF of a CRLF may come with the next piece
                    return index, 1
                return index, 2 if self._buffer[index + 1] == 0x0A else 1
        return None

    def _line(self, line: str, events: list[str]) -> None:
        if not line:
            if self._data:
                events.append("\n".join(self._data))
            self._data, self._size = [], 0
            return
        if line.startswith(":"):
            return  # a comment (keep-alive)
        name, _, value = line.partition(":")
        if name != "data":
            return  # event, id and retry fields carry nothing the client uses
        value = value[1:] if value.startswith(" ") else value
        self._size += len(value)
        if self._size > self._max_event:
            raise ValueError("a server-sent event exceeds the size limit")
        self._data.append(value)


class StreamDecoder:
    """Decrypts chunked OHTTP, reassembles the streamed BHTTP response and parses its SSE body.

    `feed` returns the JSON payloads of completed events. If the node answered
    an error status, the body is collected instead and `error` is set at
    `finish()`. `done` is True once `data: [DONE]` arrived.
    """

    def __init__(self, opener: ChunkedResponseOpener) -> None:
        self._opener = opener
        self._bhttp = StreamingResponseDecoder()
        self._sse = SSEParser()
        self._error_body = bytearray()
        self._body = hashlib.sha256()  # of all the content, as its receipt signs it
        self.done = False

    @property
    def status(self) -> int | None:
        head = self._bhttp.head
        return None if head is None else head.status

    def feed(self, piece: bytes) -> list[Any]:
        """Decrypt one piece of the wire stream; return the event payloads it completed."""
        payloads: list[Any] = []
        for plaintext in self._opener.feed(piece):
            for content in self._bhttp.feed(plaintext):
                payloads += self._content(content)
        return payloads

    @property
    def body_sha256(self) -> bytes:
        return self._body.digest()

    @property
    def trailers(self) -> tuple[tuple[bytes, bytes], ...]:
        """The trailer fields (after `finish()`), where the node's receipt is."""
        return tuple(self._bhttp.trailers or ())

    def finish(self) -> InnerResponse | None:
        """End of the wire stream: raises ohttp.TruncatedError if it was cut; an error answer if any."""
        try:
            tail = self._opener.finish()
        except DecryptionError:
            # The final chunk runs to the end of the stream: cut inside it, it cannot authenticate.
            raise TruncatedError("the final chunk did not authenticate; the stream was cut inside it") from None
        if tail:
            for content in self._bhttp.feed(tail):
                self._content(content)
        self._bhttp.finish()
        if self.status != 200:
            head = self._bhttp.head
            return InnerResponse(self.status or 500, bytes(self._error_body), tuple(head.headers) if head else ())
        return None

    def _content(self, content: bytes) -> list[Any]:
        self._body.update(content)
        if self.status != 200:
            if len(self._error_body) + len(content) <= MAX_ERROR_BODY:
                self._error_body += content
            return []
        payloads = []
        for event in self._sse.feed(content):
            if event == DONE:
                self.done = True
            else:
                payloads.append(json.loads(event))
        return payloads
