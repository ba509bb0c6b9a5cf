"""The gateway's side of the node's gRPC service: Attest, Infer and Health, nothing else.

Every call is built from the gateway's own values only — a nonce it drew, or
the one candidate's media type and ciphertext — and carries no metadata: no
client header, cookie, address or token ever reaches a node. The channel adds
only gRPC's own fixed fields (content type, user agent `veil-gateway`, timeout).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import grpc.aio

from gateway.errors import (
    AcceptTimeoutError,
    GatewayError,
    NodeBusyError,
    NodeUnreachableError,
    UndecryptableError,
    UnknownKeyError,
)
from gateway.pool import HealthReport
from protocol import node_pb2, node_pb2_grpc
from protocol.constants import MAX_GRPC_MESSAGE_BYTES

_NO_METADATA: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class AttestAnswer:
    """A node's evidence bundle (JSON text), its capacity, the models it serves, its stapled log proofs and
    what its models do."""

    evidence: str
    capacity: int
    models: tuple[str, ...] = ()
    transparency: str = ""  # the node's tlog-proofs (JSON), passed to clients unread: they verify them
    task: str = ""  # "generate" or "embed" (`protocol.constants.MODEL_TASKS`); empty from an older node


class NodeClient:
    """One node's gRPC channel."""

    def __init__(self, address: str) -> None:
        self.address = address
        options = [
            ("grpc.primary_user_agent", "veil-gateway"),
            ("grpc.enable_http_proxy", 0),  # never hand node traffic to a proxy from the environment
            ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_BYTES),
        ]
        self._channel = grpc.aio.insecure_channel(address, options=options)
        self._stub = node_pb2_grpc.NodeStub(self._channel)

    async def attest(self, nonce: bytes, timeout_s: float) -> AttestAnswer:
        """The node's evidence bound to `nonce`."""
        try:
            answer = await self._stub.Attest(node_pb2.AttestRequest(nonce=nonce), timeout=timeout_s, metadata=_NO_METADATA)
        except grpc.aio.AioRpcError:
            raise NodeUnreachableError("the node did not answer the attestation request") from None
        return AttestAnswer(answer.evidence_bundle, answer.capacity, tuple(answer.models), answer.transparency_proofs,
                            answer.task)

    async def health(self, timeout_s: float) -> HealthReport:
        """The node's health answer."""
        try:
            answer = await self._stub.Health(node_pb2.HealthRequest(), timeout=timeout_s, metadata=_NO_METADATA)
        except grpc.aio.AioRpcError:
            raise NodeUnreachableError("the node did not answer the health check") from None
        return HealthReport(answer.serving, answer.in_flight, answer.capacity, answer.node_id)

    async def open_infer(self, media_type: str, encapsulated: bytes, accept_timeout_s: float) -> InferStream:
        """Start `Node.Infer` and wait until the node accepts the request; raise if it does not.

        NodeUnreachableError means the node provably never took the request (the call failed before
        the node sent anything), so it may go to another candidate; AcceptTimeoutError means the
        node may hold it, so it must go nowhere else.
        """
        request = node_pb2.InferRequest(media_type=media_type, encapsulated=encapsulated)
        call = self._stub.Infer(request, metadata=_NO_METADATA)
        stream = InferStream(call)
        try:
            await asyncio.wait_for(stream.read_acceptance(), accept_timeout_s)
        except TimeoutError:
            call.cancel()
            raise AcceptTimeoutError("the node did not accept the request in time; send it again later") from None
        except BaseException:
            call.cancel()
            raise
        return stream

    async def close(self) -> None:
        await self._channel.close(grace=None)


class InferStream:
    """The node's encrypted answer, once the node has accepted the request: its bytes as they come."""

    def __init__(self, call: grpc.aio.UnaryStreamCall) -> None:
        self._call = call
        self._pending = b""  # data that came with the acceptance (from a node that does not say it apart)

    async def read_acceptance(self) -> None:
        """Wait for the node's first message: its acceptance, or already data."""
        message = await self._read()
        if message is None:
            raise NodeUnreachableError("the node ended its answer without sending anything")
        self._pending = bytes(message.data)

    async def data(self) -> AsyncIterator[bytes]:
        """The answer's bytes; a failure here ends the iteration with a NodeUnreachableError."""
        if self._pending:
            yield self._pending
        while (message := await self._read()) is not None:
            if message.data:
                yield bytes(message.data)

    def cancel(self) -> None:
        self._call.cancel()

    async def _read(self) -> node_pb2.InferChunk | None:
        try:
            message = await self._call.read()
        except grpc.aio.AioRpcError as error:
            raise _classify(error.code()) from None
        return None if message is grpc.aio.EOF else message


_UNDECRYPTABLE = ("the node could not decrypt the request: it was altered or not sealed to the node's key, "
                  "so sending it again cannot help")
_UNKNOWN_KEY = ("the request is sealed to a key configuration the node does not hold; fetch /v1/nodes "
                "again and seal the request to the key it lists")


def _classify(code: grpc.StatusCode) -> GatewayError:
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return UndecryptableError(_UNDECRYPTABLE)
    if code == grpc.StatusCode.NOT_FOUND:
        return UnknownKeyError(_UNKNOWN_KEY)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return NodeBusyError("the node is at its capacity")
    return NodeUnreachableError("the node failed while answering")
