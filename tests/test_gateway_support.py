"""Shared parts of the gateway tests: simulated node evidence, a recording gRPC node, a live gateway.

The recording node is a real gRPC server on loopback that answers Attest with
real `sim` evidence and records exactly what each Infer call received (the
request message and the call's metadata), so tests can prove what reaches a
node. The gateway runs on a real uvicorn server in a thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import pytest
import uvicorn

from attestation.backends.sim import SimBackend
from attestation.bundle import EvidenceBundle
from attestation.measurement import NO_MODEL_DIGEST, Measurement
from attestation.receipts import ReceiptSigner
from attestation.verifier import node_id_for
from audit.sink import MemorySink
from enclave.service import KEY_UNKNOWN, NOT_DECAPSULATED
from gateway.app import create_app
from gateway.settings import GatewaySettings
from ohttp.keys import KeyPair, generate_key_pair
from policy import Policy, shipped_policy
from protocol import node_pb2, node_pb2_grpc
from serving.server import bind_listener, uvicorn_config_options
from serving.settings import Listening
from tests.conftest import HANG_S

TEST_CODE_DIGEST = hashlib.sha256(b"veil-gateway-test-code").digest()


@pytest.fixture(scope="module")
def sim_root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh simulated root for this module, as the dev policy trusts it (VEIL_SIM_ROOT_DIR)."""
    folder = tmp_path_factory.mktemp("sim-root")
    previous = os.environ.get("VEIL_SIM_ROOT_DIR")
    os.environ["VEIL_SIM_ROOT_DIR"] = str(folder)
    yield folder
    if previous is None:
        os.environ.pop("VEIL_SIM_ROOT_DIR", None)
    else:
        os.environ["VEIL_SIM_ROOT_DIR"] = previous


class SimEvidence:
    """A simulated node's key and measurement; produces evidence for any nonce."""

    def __init__(self, root_dir: Path | None = None, *, policy: str | Policy = "dev", debug: bool = False) -> None:
        self.backend = SimBackend(root_dir, debug=debug)
        self.keys: KeyPair = generate_key_pair(1)
        digest = (policy if isinstance(policy, Policy) else shipped_policy(policy)).digest  # type: ignore[arg-type]
        self.measurement = Measurement(TEST_CODE_DIGEST, digest, NO_MODEL_DIGEST)
        self.previous_keys: KeyPair | None = None
        self.receipts = ReceiptSigner.generate()  # signs nothing here: the recording node answers no request

    @property
    def node_id(self) -> str:
        return node_id_for(self.keys.config.encode(), self.measurement)

    def bundle(self, nonce: bytes) -> EvidenceBundle:
        return self.backend.collect(self.keys.config.encode(), self.measurement, nonce, self.receipts.public_key)

    def evidence(self, nonce: bytes) -> str:
        return self.bundle(nonce).to_json()

    def rotate(self) -> None:
        self.previous_keys = self.keys
        self.keys = generate_key_pair((self.keys.key_id + 1) % 256)


_X509_V3 = bytes.fromhex("a003020102")  # [0] EXPLICIT INTEGER 2: a certificate's version field, v3
_X509_UNDEFINED = bytes.fromhex("a003020103")  # version 4, which X.509 does not define


def with_broken_certificate(evidence_json: str, part: str = "cpu") -> str:
    """The evidence with its `part` ("cpu" or "gpu") leaf certificate declaring an X.509 version that
    does not exist. It can never verify; before the verifier's parsing was hardened, reading such a
    certificate raised cryptography's own InvalidVersion, not an AttestationError."""
    bundle = EvidenceBundle.from_json(evidence_json)
    evidence = getattr(bundle, part)
    leaf = evidence.cert_chain[0]
    assert leaf.startswith(_X509_V3, 8), "the leaf certificate's version field is not where DER puts it"
    broken = leaf.replace(_X509_V3, _X509_UNDEFINED, 1)
    chain = (broken, *evidence.cert_chain[1:])
    return dataclasses.replace(bundle, **{part: dataclasses.replace(evidence, cert_chain=chain)}).to_json()


@dataclass(frozen=True)
class Received:
    """What one Infer call brought to the node."""

    media_type: str
    encapsulated: bytes
    fields: tuple[str, ...]
    metadata: tuple[tuple[str, str], ...]


@dataclass
class Behaviour:
    """How the recording node answers Infer: `echo`, `fail`, `busy`, `reject` (does not decapsulate),
    `unknown_key` (names a key the node does not hold), `die_mid_stream`, `hold`
    (before the first chunk, until released), `hold_after_first` (until the call is cancelled) or
    `accept_then_hold` (says it accepted the request, then holds its data until released)."""

    mode: str = "echo"
    release: threading.Event = field(default_factory=threading.Event)


class RecordingNode(node_pb2_grpc.NodeServicer):
    """A node servicer with real simulated evidence that records every Infer call."""

    def __init__(self, evidence: SimEvidence, *, capacity: int = 4, evidence_for: Callable[[bytes], str] | None = None):
        self.evidence = evidence
        self.capacity = capacity
        self.behaviour = Behaviour()
        self.serving = True
        self.received: list[Received] = []
        self.attest_calls: list[tuple[tuple[str, str], ...]] = []
        self.nonces: list[bytes] = []
        self.cancelled = 0
        self.entered = threading.Semaphore(0)
        self.evidence_for = evidence_for or evidence.evidence
        self._lock = threading.Lock()

    def Attest(self, request, context):
        with self._lock:
            self.attest_calls.append(tuple((item.key, str(item.value)) for item in context.invocation_metadata()))
            self.nonces.append(bytes(request.nonce))
        return node_pb2.AttestResponse(evidence_bundle=self.evidence_for(bytes(request.nonce)), capacity=self.capacity)

    def Health(self, request, context):
        return node_pb2.HealthResponse(serving=self.serving, in_flight=0, capacity=self.capacity,
                                       node_id=self.evidence.node_id)

    def Infer(self, request, context):
        metadata = tuple((item.key, str(item.value)) for item in context.invocation_metadata())
        fields = tuple(descriptor.name for descriptor, _ in request.ListFields())
        with self._lock:
            self.received.append(Received(request.media_type, bytes(request.encapsulated), fields, metadata))
        self.entered.release()
        mode = self.behaviour.mode
        if mode == "fail":
            context.abort(grpc.StatusCode.UNAVAILABLE, "down")
        if mode == "busy":
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy")
        if mode == "reject":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, NOT_DECAPSULATED)
        if mode == "unknown_key":
            context.abort(grpc.StatusCode.NOT_FOUND, KEY_UNKNOWN)
        if mode == "accept_then_hold":
            yield node_pb2.InferChunk(accepted=True)
        if mode in ("hold", "accept_then_hold"):
            self.behaviour.release.wait(HANG_S)
        yield node_pb2.InferChunk(data=bytes(request.encapsulated))
        if mode == "hold_after_first":
            gone = threading.Event()
            context.add_callback(gone.set)
            if gone.wait(HANG_S):
                with self._lock:
                    self.cancelled += 1
                return
        if mode == "die_mid_stream":
            context.abort(grpc.StatusCode.INTERNAL, "died")
        yield node_pb2.InferChunk(data=b"|" + self.evidence.node_id.encode())


class GrpcNode:
    """A RecordingNode served by a real gRPC server on 127.0.0.1."""

    def __init__(self, servicer: RecordingNode) -> None:
        self.servicer = servicer
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        node_pb2_grpc.add_NodeServicer_to_server(servicer, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.address = f"127.0.0.1:{self.port}"

    @property
    def node_id(self) -> str:
        return self.servicer.evidence.node_id

    def stop(self) -> None:
        self.server.stop(0).wait()


class LiveServer:
    """An ASGI application on a real uvicorn server (with every Veil server's serving options) in a background thread."""

    def __init__(self, app, settings: Listening) -> None:
        self.app = app
        self._socket = bind_listener("127.0.0.1:0")
        self.port = self._socket.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(self.app, **uvicorn_config_options(settings)))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True)

    def __enter__(self):
        self._thread.start()
        deadline = time.monotonic() + HANG_S
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._server.should_exit = True
        self._thread.join(HANG_S)
        self._socket.close()


class LiveGateway(LiveServer):
    """The gateway application on a real uvicorn server in a background thread."""

    def __init__(self, settings: GatewaySettings, *, rng=None, clock: Callable[[], float] = time.time) -> None:
        self.audit = MemorySink()
        super().__init__(create_app(settings, audit_sink=self.audit, routing_rng=rng, clock=clock), settings)
        self.runtime = self.app.state.runtime

    def run_round(self) -> None:
        """Run one pool upkeep round now, on the server's event loop."""
        loop = self._loop()
        asyncio.run_coroutine_threadsafe(self.runtime.keeper.run_round(), loop).result(HANG_S)

    def _loop(self) -> asyncio.AbstractEventLoop:
        task = self.runtime.keeper._task
        assert task is not None, "the keeper is not running"
        return task.get_loop()

    def wait_for(self, condition: Callable[[], bool], timeout: float = HANG_S) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError("the condition did not become true in time")
            time.sleep(0.02)


def gateway_settings(nodes: list[str], **overrides) -> GatewaySettings:
    values = dict(nodes=tuple(nodes), policy="dev", health_s=30.0, reattest_s=600.0, startup_admission_s=10.0)
    values.update(overrides)
    return GatewaySettings(**values)


def candidate(node_id: str, payload: bytes, media_type: str = "message/ohttp-req") -> dict[str, str]:
    import base64

    return {"node_id": node_id, "media_type": media_type, "encapsulated": base64.b64encode(payload).decode()}


def client(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=20.0, trust_env=False)


@contextmanager
def recording_nodes(evidence: Iterable[SimEvidence]) -> Iterator[list[GrpcNode]]:
    """Real gRPC nodes on loopback, one answering with each evidence, stopped when the block ends."""
    started = [GrpcNode(RecordingNode(item)) for item in evidence]
    try:
        yield started
    finally:
        for node in started:
            node.stop()
