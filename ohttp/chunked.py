"""Chunked Oblivious HTTP (draft-ietf-ohai-chunked-ohttp): requests and responses as streams.

    Chunked Encapsulated Request {
      Request Header (56), Encapsulated KEM Shared Secret (8 * Nenc),
      Non-Final Request Chunk { Length (i) = Nt+1.., HPKE-Protected Chunk (..) } ...,
      Final Request Chunk Indicator (i) = 0,
      HPKE-Protected Final Chunk (..),          # runs to the end of the stream
    }
    Chunked Encapsulated Response {
      Response Nonce (8 * max(Nn, Nk)),
      Non-Final Response Chunk { Length (i) = Nt+1.., AEAD-Protected Chunk (..) } ...,
      Final Response Chunk Indicator (i) = 0,
      AEAD-Protected Final Chunk (..),          # runs to the end of the stream
    }

Request chunks are sealed in sequence by the HPKE context; response chunk i uses
nonce `aead_nonce XOR i`. The final chunk of either direction is sealed with AAD
"final", so reordering, dropping, duplicating or cutting chunks is detected: a
stream that ends without its final chunk raises `TruncatedError`, never a short
answer. Empty non-final chunks are neither produced nor accepted. Chunks are
bounded by `max_chunk_size` (default 1 MiB of plaintext) before being buffered.

Client:   sealer = ChunkedRequestSealer(config); send sealer.seal_chunk(...) ...;
          opener = sealer.response_opener(); opener.feed(piece) ...; opener.finish()
Gateway:  opener = ChunkedRequestOpener(keyring); opener.feed(piece) ...; opener.finish();
          sealer = opener.response_sealer(); send sealer.seal_chunk(data, final=...) ...
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from . import hpke
from .encapsulation import (
    REQUEST_HEADER_LENGTH,
    GatewaySetup,
    RequestHeader,
    ResponseKey,
    client_setup,
    derive_response_key,
    enc_length,
    fresh_response_nonce,
    gateway_key,
    gateway_setup,
    response_nonce_length,
)
from .chunk_framing import ChunkParser, FailsOnce, check_chunk, chunk_frame, chunk_nonce
from .errors import DecryptionError, MalformedError, OHTTPError, TruncatedError
from .keys import KeyConfig, KeyRing, SymmetricSuite

REQUEST_LABEL = b"message/bhttp chunked request"
RESPONSE_LABEL = b"message/bhttp chunked response"
FINAL_AAD = b"final"
DEFAULT_MAX_CHUNK_SIZE = 1 << 20


# --- Requests --------------------------------------------------------------------------


class ChunkedRequestSealer:
    """Client side: seals a request as a stream of chunks to a gateway's key configuration."""

    __slots__ = ("_setup", "_prefix_pending", "_done", "max_chunk_size")

    def __init__(
        self,
        config: KeyConfig,
        suite: SymmetricSuite | None = None,
        *,
        max_chunk_size: int = DEFAULT_MAX_CHUNK_SIZE,
        _ephemeral_private_key_for_tests: bytes | None = None,
    ) -> None:
        self._setup = client_setup(config, suite, REQUEST_LABEL, _ephemeral_private_key_for_tests)
        self._prefix_pending = True
        self._done = False
        self.max_chunk_size = max_chunk_size

    @property
    def suite(self) -> SymmetricSuite:
        """The symmetric suite the request is sealed with."""
        return self._setup.suite

    @property
    def finished(self) -> bool:
        """Whether the final chunk has been sealed."""
        return self._done

    def start(self) -> bytes:
        """The request header and key share if not sent yet (else b""); `seal_chunk` includes them too."""
        if not self._prefix_pending:
            return b""
        self._prefix_pending = False
        return self._setup.prefix

    def seal_chunk(self, data: bytes, final: bool = False) -> bytes:
        """The wire bytes of the next chunk (preceded by the header on first use)."""
        data = bytes(data)
        check_chunk(data, final, self._done, self.max_chunk_size)
        sealed = self._setup.context.seal(data, FINAL_AAD if final else b"")
        self._done = final
        return self.start() + chunk_frame(sealed, final)

    def response_opener(self, *, max_chunk_size: int = DEFAULT_MAX_CHUNK_SIZE) -> ChunkedResponseOpener:
        """The opener for the chunked response to this request."""
        return ChunkedResponseOpener(
            self._setup.context, self._setup.enc, self._setup.suite, max_chunk_size=max_chunk_size
        )


class ChunkedRequestOpener(FailsOnce):
    """Gateway side: parses and opens request chunks from byte pieces as they arrive.

    `feed` returns the non-final chunks completed so far. The final chunk runs
    to the end of the stream, so `finish()` (called at end of stream) opens and
    returns it, or raises TruncatedError if it never came.
    """

    __slots__ = ("_keyring", "_setup", "_parser", "_header_buffer", "_done", "max_chunk_size")

    def __init__(self, keyring: KeyRing, *, max_chunk_size: int = DEFAULT_MAX_CHUNK_SIZE) -> None:
        super().__init__()
        self._keyring = keyring
        self._setup: GatewaySetup | None = None
        self._parser: ChunkParser | None = None
        self._header_buffer = bytearray()
        self._done = False
        self.max_chunk_size = max_chunk_size

    def finish(self) -> bytes:
        """End of stream: open and return the final chunk (TruncatedError if it never came)."""
        self._guard()
        if self._done:
            raise ValueError("the stream was already finished")
        try:
            if self._parser is None:
                raise TruncatedError("the stream ended inside the request header; discard it")
            plaintext = self._setup.context.open(self._parser.final_ciphertext(), FINAL_AAD)
        except OHTTPError as error:
            self._fail(error)
            raise
        self._done = True
        return plaintext

    def chunks(self, pieces: Iterable[bytes]) -> Iterator[bytes]:
        """Every request chunk, the final one included, from an iterable of byte pieces."""
        for piece in pieces:
            yield from self.feed(piece)
        yield self.finish()

    def response_sealer(
        self, *, max_chunk_size: int = DEFAULT_MAX_CHUNK_SIZE, _response_nonce_for_tests: bytes | None = None
    ) -> ChunkedResponseSealer:
        """The sealer for the chunked response (available once the header was opened)."""
        if self._setup is None:
            raise ValueError("the request header has not been received yet")
        return ChunkedResponseSealer(
            self._setup.context,
            self._setup.enc,
            self._setup.header.suite,
            max_chunk_size=max_chunk_size,
            _response_nonce_for_tests=_response_nonce_for_tests,
        )

    def _feed(self, data: bytes) -> list[bytes]:
        if self._parser is None:
            data = self._open_header(data)
            if self._parser is None:
                return []
        self._parser.buffer.append(data)
        opened = []
        while (sealed := self._parser.next_chunk()) is not None:
            opened.append(self._setup.context.open(sealed))
        return opened

    def _open_header(self, data: bytes) -> bytes:
        """Buffer header bytes; once complete set up the context and return what follows."""
        self._header_buffer += data
        if len(self._header_buffer) < REQUEST_HEADER_LENGTH:
            return b""
        header = RequestHeader.decode(self._header_buffer)
        pair = gateway_key(self._keyring, header)
        enc_end = REQUEST_HEADER_LENGTH + enc_length(header.kem_id)
        if len(self._header_buffer) < enc_end:
            return b""
        enc = bytes(self._header_buffer[REQUEST_HEADER_LENGTH:enc_end])
        rest = bytes(self._header_buffer[enc_end:])
        self._setup = gateway_setup(pair, header, enc, REQUEST_LABEL)
        tag_length = hpke.aead_for(header.aead_id).tag_length
        self._parser = ChunkParser(tag_length, self.max_chunk_size)
        self._header_buffer = bytearray()
        return rest


# --- Responses -------------------------------------------------------------------------


class ChunkedResponseSealer:
    """Gateway side: seals a response as a stream of chunks under the request's context."""

    __slots__ = ("_key", "_base_nonce", "_nonce_length", "_counter", "_nonce", "_nonce_pending", "_done",
                 "max_chunk_size")

    def __init__(
        self,
        context: hpke.RecipientContext,
        enc: bytes,
        suite: SymmetricSuite,
        *,
        max_chunk_size: int = DEFAULT_MAX_CHUNK_SIZE,
        _response_nonce_for_tests: bytes | None = None,
    ) -> None:
        self._nonce = fresh_response_nonce(suite, _response_nonce_for_tests)
        response_key = derive_response_key(context, suite, enc, self._nonce, RESPONSE_LABEL)
        self._key = response_key.key
        self._base_nonce = int.from_bytes(response_key.nonce, "big")
        self._nonce_length = len(response_key.nonce)
        self._counter = 0
        self._nonce_pending = True
        self._done = False
        self.max_chunk_size = max_chunk_size

    @property
    def finished(self) -> bool:
        """Whether the final chunk has been sealed."""
        return self._done

    def start(self) -> bytes:
        """The response nonce if not sent yet (else b""); `seal_chunk` includes it too."""
        if not self._nonce_pending:
            return b""
        self._nonce_pending = False
        return self._nonce

    def seal_chunk(self, data: bytes, final: bool = False) -> bytes:
        """The wire bytes of the next response chunk (preceded by the nonce on first use)."""
        data = bytes(data)
        check_chunk(data, final, self._done, self.max_chunk_size)
        nonce = chunk_nonce(self._base_nonce, self._counter, self._nonce_length)
        sealed = self._key.seal(nonce, data, FINAL_AAD if final else b"")
        self._counter += 1
        self._done = final
        return self.start() + chunk_frame(sealed, final)


class ChunkedResponseOpener(FailsOnce):
    """Client side: parses and opens response chunks from byte pieces as they arrive.

    `feed` returns the chunks completed so far. The final chunk runs to the end
    of the stream; it is recognised as soon as it authenticates, else `finish()`
    opens it. `finish()` returns whatever plaintext `feed` has not returned yet
    (usually b"") and raises TruncatedError if the final chunk never arrived.
    """

    __slots__ = ("_context", "_enc", "_suite", "_key", "_base_nonce", "_nonce_length", "_counter",
                 "_parser", "_nonce_buffer", "_final_tried_at", "_final_plaintext", "_done", "max_chunk_size")

    def __init__(
        self,
        context: hpke.SenderContext,
        enc: bytes,
        suite: SymmetricSuite,
        *,
        max_chunk_size: int = DEFAULT_MAX_CHUNK_SIZE,
    ) -> None:
        super().__init__()
        self._context = context
        self._enc = enc
        self._suite = suite
        self._key: hpke.AeadKey | None = None
        self._base_nonce = 0
        self._nonce_length = 0
        self._counter = 0
        self._parser = ChunkParser(hpke.aead_for(suite.aead_id).tag_length, max_chunk_size)
        self._nonce_buffer = bytearray()
        self._final_tried_at = 0
        self._final_plaintext: bytes | None = None
        self._done = False
        self.max_chunk_size = max_chunk_size

    @property
    def complete(self) -> bool:
        """Whether the final chunk has been authenticated."""
        return self._final_plaintext is not None

    def finish(self) -> bytes:
        """End of stream: return the final chunk's plaintext if `feed` has not (TruncatedError if absent)."""
        self._guard()
        if self._done:
            raise ValueError("the stream was already finished")
        try:
            plaintext = self._finish()
        except OHTTPError as error:
            self._fail(error)
            raise
        self._done = True
        return plaintext

    def _finish(self) -> bytes:
        if self._final_plaintext is not None:
            return b""
        if self._key is None:
            raise TruncatedError("the stream ended inside the response nonce; discard it")
        return self._open(self._parser.final_ciphertext(), final=True)

    def _feed(self, data: bytes) -> list[bytes]:
        if self._final_plaintext is not None:
            if data:
                raise MalformedError("data arrived after the final chunk; discard the response")
            return []
        if self._key is None:
            data = self._take_nonce(data)
            if self._key is None:
                return []
        self._parser.buffer.append(data)
        opened = []
        while (sealed := self._parser.next_chunk()) is not None:
            opened.append(self._open(sealed, final=False))
        if self._parser.in_final and self._try_final():
            opened.append(self._final_plaintext)
        return opened

    def _take_nonce(self, data: bytes) -> bytes:
        self._nonce_buffer += data
        length = response_nonce_length(self._suite)
        if len(self._nonce_buffer) < length:
            return b""
        nonce, rest = bytes(self._nonce_buffer[:length]), bytes(self._nonce_buffer[length:])
        response_key: ResponseKey = derive_response_key(self._context, self._suite, self._enc, nonce, RESPONSE_LABEL)
        self._key = response_key.key
        self._base_nonce = int.from_bytes(response_key.nonce, "big")
        self._nonce_length = len(response_key.nonce)
        self._nonce_buffer = bytearray()
        return rest

    def _try_final(self) -> bool:
        """Open the final chunk early if it authenticates already.

        Attempts happen only when the buffered final chunk has doubled in size
        since the last one, so the cost stays linear in its length.
        """
        size = len(self._parser.buffer)
        if size < self._key.algorithm.tag_length or size < 2 * self._final_tried_at:
            return False
        self._final_tried_at = size
        try:
            self._final_plaintext = self._key.open(self._nonce(), self._parser.buffer.view(), FINAL_AAD)
        except DecryptionError:
            return False  # more of the final chunk may still be on its way
        return True

    def _open(self, sealed: bytes, final: bool) -> bytes:
        plaintext = self._key.open(self._nonce(), sealed, FINAL_AAD if final else b"")
        if final:
            self._final_plaintext = plaintext
        else:
            self._counter += 1
        return plaintext

    def _nonce(self) -> bytes:
        return chunk_nonce(self._base_nonce, self._counter, self._nonce_length)
