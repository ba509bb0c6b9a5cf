"""The gRPC service: Attest, Infer, Health (and `grpc.health.v1`, `enclave.health`). Nothing else is exposed.

Infer decapsulates with the node's keys, says at once that it accepted the request (a message with
no data, before any work on its content), answers through the inner API, and seals the answer back:
one OHTTP response for `message/ohttp-req`, chunked OHTTP (one chunk per engine delta, or per
batch of deltas that waited for a slow reader) for `message/ohttp-chunked-req`. A request that does
not decapsulate gets one of two fixed statuses: NOT_FOUND when its cleartext header names a key
identifier or suite the node does not hold (fetch the key configuration again), INVALID_ARGUMENT for
anything else; neither says more than that header already shows. Failures after decapsulation travel
encrypted, as HTTP errors inside the response.

Every answer, error or not, ends with the node's signed receipt (`attestation.receipts`) in the Binary
HTTP trailer `veil-receipt`: the hashes of the request as decrypted and of the whole body as sent, so
a streamed answer's receipt comes with its last chunk. It exists only inside the encryption.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc

from attestation.binding import NONCE_SIZE
from attestation.receipts import RECEIPT_TRAILER
from enclave.api import ApiError, InnerApi, InnerResponse, error_response
from ohttp import bhttp, bhttp_stream
from ohttp.chunked import ChunkedRequestOpener
from ohttp.errors import OHTTPError, UnknownKeyError, UnsupportedSuiteError
from ohttp.keys import KeyRing
from ohttp.media_types import OHTTP_CHUNKED_REQUEST, OHTTP_REQUEST
from ohttp.message import decapsulate_request
from protocol import node_pb2, node_pb2_grpc
from protocol.constants import MAX_ENCAPSULATED_BYTES, NODE_ID_HEADER

NOT_DECAPSULATED = "the request could not be decapsulated"
NOT_ADMITTING = "the node is draining or not serving and took nothing of this request; send it to another node"
KEY_UNKNOWN = "the request names a key or suite this node does not hold; fetch its key configuration again"
_SSE_CONTENT_TYPE = [(b"content-type", b"text/event-stream")]
_JSON_CONTENT_TYPE = [(b"content-type", b"application/json")]
# What the gateway learns from it, that the request decapsulated, it learns from any answer anyway;
# sent before generation, it lets a slow answer be told apart from a node that never took the request.
_ACCEPTED = node_pb2.InferChunk(accepted=True)


@dataclass(frozen=True, slots=True)
class Outcome:
    """What the node tells its audit about one request: a status and timings, nothing else."""

    status: str
    started: float
    first_byte: float | None
    prompt_tokens: int = 0
    output_tokens: int = 0


class NodeService(node_pb2_grpc.NodeServicer):
    def __init__(
        self,
        keyring: Callable[[], KeyRing],
        api: InnerApi,
        attest: Callable[[bytes], str],
        node_id: Callable[[], str],
        sign_receipt: Callable[[bytes, bytes, int], bytes],
        capacity: int,
        on_finished: Callable[[Outcome], None],
        healthy: Callable[[], bool] = lambda: True,
        transparency: Callable[[], str] = lambda: "",
    ) -> None:
        self._keyring = keyring
        self._transparency = transparency  # the stapled log proofs (JSON), "" without a log
        self._api = api
        self._attest = attest
        self._node_id = node_id
        # (request as decrypted, SHA-256 of the body, status) -> the encoded receipt
        self._sign_receipt = sign_receipt
        self.capacity = capacity
        self._on_finished = on_finished
        self._slots = threading.BoundedSemaphore(capacity)
        self._in_flight = 0
        self._lock = threading.Lock()
        self._healthy = healthy
        self._admitting = True

    @property
    def serving(self) -> bool:
        """Whether the node takes new requests: not draining, and healthy (core running, evidence fresh)."""
        return self._admitting and self._healthy()

    @serving.setter
    def serving(self, admitting: bool) -> None:
        self._admitting = admitting

    # ----- Attest and Health --------------------------------------------------------------------

    def Attest(self, request: node_pb2.AttestRequest, context: grpc.ServicerContext) -> node_pb2.AttestResponse:
        if len(request.nonce) != NONCE_SIZE:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the nonce must be exactly {NONCE_SIZE} bytes")
        return node_pb2.AttestResponse(evidence_bundle=self._attest(bytes(request.nonce)), capacity=self.capacity,
                                       models=list(self._api.model_names), transparency_proofs=self._transparency(),
                                       task=self._api.task)

    def Health(self, request: node_pb2.HealthRequest, context: grpc.ServicerContext) -> node_pb2.HealthResponse:
        return node_pb2.HealthResponse(
            serving=self.serving, in_flight=self._in_flight, capacity=self.capacity, node_id=self._node_id()
        )

    # ----- Infer ---------------------------------------------------------------------------------

    def Infer(self, request: node_pb2.InferRequest, context: grpc.ServicerContext) -> Iterator[node_pb2.InferChunk]:
        if not self.serving:
            # Refused before anything of the request is read: the gateway knows this node never took
            # it and sends it to another candidate.
            context.abort(grpc.StatusCode.UNAVAILABLE, NOT_ADMITTING)
        if not self._slots.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "the node is at capacity; try another node")
        started = time.monotonic()
        with self._lock:
            self._in_flight += 1
        result = _Result()
        first_byte = None
        try:
            for message in self._infer(request, result):
                if message.data:
                    first_byte = first_byte or time.monotonic()
                yield message
        except _Undecapsulated as refusal:
            result.status = "decrypt_error"
            context.abort(refusal.code, refusal.details)
        except GeneratorExit:
            result.status = "aborted"
            raise
        finally:
            with self._lock:
                self._in_flight -= 1
            self._slots.release()
            metrics = result.metrics
            self._on_finished(Outcome(
                result.status, started, first_byte,
                metrics.prompt_tokens if metrics else 0, metrics.output_tokens if metrics else 0,
            ))

    def _infer(self, request: node_pb2.InferRequest, result: _Result) -> Iterator[node_pb2.InferChunk]:
        if len(request.encapsulated) > MAX_ENCAPSULATED_BYTES:
            raise _Undecapsulated()
        if request.media_type == OHTTP_REQUEST:
            yield from self._infer_whole(bytes(request.encapsulated), result)
        elif request.media_type == OHTTP_CHUNKED_REQUEST:
            yield from self._infer_chunked(bytes(request.encapsulated), result)
        else:
            raise _Undecapsulated()

    def _infer_whole(self, encapsulated: bytes, result: _Result) -> Iterator[node_pb2.InferChunk]:
        with _decapsulating():
            plaintext, server_context = decapsulate_request(self._keyring(), encapsulated)
        yield _ACCEPTED
        response = self._answer(plaintext)
        try:
            body = response.body if not response.streaming else b"".join(response.events)
        finally:
            _close(response, result)
        receipt = self._sign_receipt(plaintext, hashlib.sha256(body).digest(), response.status)
        encoded = bhttp.encode_response(bhttp.Response(response.status, self._headers(response), body,
                                                       trailers=[(RECEIPT_TRAILER, receipt)]))
        result.status = _status_of(response.status)
        yield _data(server_context.seal_response(encoded))

    def _infer_chunked(self, encapsulated: bytes, result: _Result) -> Iterator[node_pb2.InferChunk]:
        opener = ChunkedRequestOpener(self._keyring())
        with _decapsulating():
            pieces = opener.feed(encapsulated)
            pieces.append(opener.finish())
        yield _ACCEPTED
        sealer = opener.response_sealer()
        plaintext = b"".join(pieces)
        response = self._answer(plaintext)
        body = hashlib.sha256()  # of every piece sent, for the receipt at the end
        try:
            headers = self._headers(response)
            pieces = iter(response.events if response.streaming else _nonempty(response.body))
            # The head travels with the first piece: the answer is ready when the head is, so one
            # chunk fewer per request costs no latency.
            first = next(pieces, None)
            head = bhttp_stream.encode_response_head(response.status, headers)
            yield _data(sealer.seal_chunk(head + (b"" if first is None else _content(first, body))))
            for piece in pieces:
                yield _data(sealer.seal_chunk(_content(piece, body)))
            receipt = self._sign_receipt(plaintext, body.digest(), response.status)
            yield _data(sealer.seal_chunk(bhttp_stream.encode_response_end([(RECEIPT_TRAILER, receipt)]), final=True))
            result.status = _status_of(response.status)
        finally:
            _close(response, result)

    def _answer(self, plaintext: bytes) -> InnerResponse:
        try:
            request = bhttp.decode_request(plaintext)
        except OHTTPError:
            return error_response(ApiError(400, "invalid_request", "the inner request is not valid Binary HTTP"))
        if any(name.lower() == b"expect" for name, _ in request.headers):
            # RFC 9458 section 5.1: an encapsulated answer has no room for a 100 (Continue).
            return error_response(ApiError(417, "expectation_failed", "an encapsulated request must not carry Expect"))
        return self._api.handle(request)

    def _headers(self, response: InnerResponse) -> list[tuple[bytes, bytes]]:
        content_type = _SSE_CONTENT_TYPE if response.streaming else _JSON_CONTENT_TYPE
        return content_type + response.headers + [(NODE_ID_HEADER.encode(), self._node_id().encode())]

    @property
    def in_flight(self) -> int:
        return self._in_flight


@dataclass(slots=True)
class _Result:
    status: str = "client_error"
    metrics: object | None = None


class _Undecapsulated(Exception):
    """Raised inside Infer; mapped to a fixed status that reveals nothing beyond the cleartext header."""

    def __init__(self, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT, details: str = NOT_DECAPSULATED):
        super().__init__(details)
        self.code = code
        self.details = details


@contextlib.contextmanager
def _decapsulating() -> Iterator[None]:
    """Turns the OHTTP errors of opening a request into the node's two refusals."""
    try:
        yield
    except (UnknownKeyError, UnsupportedSuiteError):
        raise _Undecapsulated(grpc.StatusCode.NOT_FOUND, KEY_UNKNOWN) from None
    except OHTTPError:
        raise _Undecapsulated() from None


def _status_of(http_status: int) -> str:
    if http_status < 400:
        return "ok"
    return "client_error" if http_status < 500 else "engine_error"


def _data(sealed: bytes) -> node_pb2.InferChunk:
    return node_pb2.InferChunk(data=sealed)


def _content(piece: bytes, body: hashlib._Hash) -> bytes:
    """One content chunk of a streamed answer, counted into the hash its receipt signs."""
    body.update(piece)
    return bhttp_stream.encode_content_chunk(piece)


def _nonempty(body: bytes, piece: int = 64 * 1024) -> list[bytes]:
    """A whole body as content chunks small enough for any chunk limit."""
    return [body[start : start + piece] for start in range(0, len(body), piece)]


def _close(response: InnerResponse, result: _Result | None = None) -> None:
    if result is not None:
        result.metrics = response.metrics
    for close in response.on_close:
        close()
