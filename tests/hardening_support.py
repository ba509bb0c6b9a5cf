"""Shared parts of the hardening tests: canaries, bounded fuzzing, real nodes and well-formed requests.

The hardening tests throw malformed, truncated, oversized and replayed inputs at the
two network surfaces (the gateway's HTTP API and the node's gRPC service) and check
that nothing crashes, nothing answers 500, no answer reflects input bytes, and
well-formed requests keep being served correctly in between.

Every fuzzed input carries `CANARY`, a marker drawn afresh per test run, so "this
answer reflects its request" is one substring search away.

By default each property test runs `VEIL_FUZZ_EXAMPLES` = 40 examples, which keeps
both files within a minute or so. A longer barrage:

    VEIL_FUZZ_EXAMPLES=2000 .venv/bin/python -m pytest tests/test_hardening_gateway.py tests/test_hardening_node.py
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from attestation.bundle import EvidenceBundle
from attestation.verifier import verify
from enclave.node import NodeServer
from enclave.service import KEY_UNKNOWN, NOT_DECAPSULATED
from enclave.settings import NodeSettings
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.tokenizer import ChatMessage
from ohttp import ChunkedRequestSealer, ClientContext, ClientRequest, OHTTPError, bhttp
from ohttp.bhttp_stream import StreamingResponseDecoder
from ohttp.keys import KeyConfig
from ohttp.media_types import OHTTP_CHUNKED_REQUEST, OHTTP_REQUEST
from policy import shipped_policy
from protocol import node_pb2, node_pb2_grpc
from tests.conftest import HANG_S

FUZZ_EXAMPLES = int(os.environ.get("VEIL_FUZZ_EXAMPLES", "40"))
# One well-formed request after every this many fuzz cases.
HEARTBEAT_EVERY = 10
CANARY = f"CANARY{secrets.token_hex(8).upper()}"
CANARY_BYTES = CANARY.encode()
MODEL_NAME = "tiny"
CALL_TIMEOUT_S = 60.0
_MiB = 1 << 20
_REPO_ROOT = Path(__file__).resolve().parents[1]


def fuzz_settings(share: float = 1.0) -> settings:
    """Hypothesis settings for one property test: `share` of the configured number of examples."""
    return settings(
        max_examples=max(1, int(FUZZ_EXAMPLES * share)),
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                               HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )


def with_canary(max_size: int = 96) -> st.SearchStrategy[bytes]:
    """Arbitrary bytes with the canary somewhere inside."""
    half = max_size // 2
    return st.tuples(st.binary(max_size=half), st.binary(max_size=half)).map(
        lambda parts: parts[0] + CANARY_BYTES + parts[1])


def canary_text() -> st.SearchStrategy[str]:
    """Arbitrary text with the canary somewhere inside."""
    return st.tuples(st.text(max_size=24), st.text(max_size=24)).map(lambda parts: parts[0] + CANARY + parts[1])


def assert_no_canary(*answers: bytes | str) -> None:
    """No answer (body, header, status detail) holds the canary, in any letter case."""
    for answer in answers:
        text = answer.decode("latin-1") if isinstance(answer, bytes) else answer
        assert CANARY.lower() not in text.lower(), "an answer reflects its request"


def assert_error_shape(content: bytes) -> dict:
    """`content` is `{"error": {"code": str, "message": str, ...}}`; returns the inner object.

    A key-configuration refusal is also RFC 9458's problem detail: fixed `type`, `title` and `status` beside it.
    """
    body = json.loads(content)
    assert isinstance(body, dict) and set(body) in ({"error"}, {"error", "type", "title", "status"})
    if "type" in body:
        assert body["type"] == "https://iana.org/assignments/http-problem-types#ohttp-key"
        assert body["error"]["code"] == "unknown_key" and body["title"] == "key identifier unknown"
    error = body["error"]
    assert isinstance(error.get("code"), str) and error["code"]
    assert isinstance(error.get("message"), str) and error["message"]
    return error


mutations = st.one_of(
    st.tuples(st.just("truncate"), st.floats(0, 1, exclude_max=True)),
    st.tuples(st.just("flip"), st.floats(0, 1, exclude_max=True), st.integers(0, 7)),
    st.tuples(st.just("insert"), st.floats(0, 1), with_canary(16)),
)


def mutate(data: bytes, mutation: tuple) -> bytes:
    """`data` cut short, with one bit flipped, or with canary bytes spliced in, as `mutation` says."""
    position = int(mutation[1] * len(data))
    if mutation[0] == "truncate":
        return data[:position]
    if mutation[0] == "flip":
        return data[:position] + bytes([data[position] ^ (1 << mutation[2])]) + data[position + 1:]
    return data[:position] + mutation[2] + data[position:]


class Heartbeat:
    """Every `every` fuzz cases, one well-formed request must still get the right answer."""

    def __init__(self, check: Callable[[], None], every: int = HEARTBEAT_EVERY) -> None:
        self.check = check
        self.every = every
        self.cases = 0
        self.checks = 0

    def beat(self) -> None:
        self.cases += 1
        if self.cases % self.every == 0:
            self.check()
            self.checks += 1


# ----- nodes ------------------------------------------------------------------------------------


def node_settings(model_dir: Path, capacity: int = 4) -> NodeSettings:
    return NodeSettings(model=model_dir, policy="dev", attestation="sim", capacity=capacity, audit="none",
                        key_rotation_s=0, key_grace_s=3600, kv_cache_gib=0.05, model_name=MODEL_NAME)


def start_node(model_dir: Path, capacity: int = 4) -> NodeServer:
    """A real node in this process on a free loopback port (sim attestation, the tiny model)."""
    server = NodeServer(node_settings(model_dir, capacity))
    server.start()
    return server


@dataclass
class NodeProcess:
    """`veil node` as a separate process: a node whose failure cannot hang the test run."""

    popen: subprocess.Popen
    port: int

    def stop(self) -> None:
        self.popen.terminate()
        try:
            self.popen.wait(5)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(HANG_S)


def spawn_node(model_dir: Path, folder: Path, sim_root: Path) -> NodeProcess:
    """Start `veil node` on a free port and wait for its port file."""
    port_file = folder / "node.port"
    env = dict(os.environ, VEIL_SIM_ROOT_DIR=str(sim_root), OMP_NUM_THREADS="1")
    arguments = [sys.executable, "-m", "veil", "node", "--model", str(model_dir), "--policy", "dev",
                 "--attestation", "sim", "--listen", "127.0.0.1:0", "--port-file", str(port_file),
                 "--capacity", "2", "--kv-cache-gib", "0.05", "--model-name", MODEL_NAME, "--audit", "none"]
    with open(folder / "node.err", "wb") as stderr:
        popen = subprocess.Popen(arguments, cwd=_REPO_ROOT, env=env, stdin=subprocess.DEVNULL,
                                 stdout=subprocess.DEVNULL, stderr=stderr)
    deadline = time.monotonic() + HANG_S
    while not (port_file.is_file() and port_file.read_text().strip().isdigit()):
        if popen.poll() is not None or time.monotonic() > deadline:
            popen.kill()
            raise RuntimeError("veil node did not start; see " + str(folder / "node.err"))
        time.sleep(0.05)
    return NodeProcess(popen, int(port_file.read_text()))


def node_stub(port: int) -> tuple[grpc.Channel, node_pb2_grpc.NodeStub]:
    """A channel that may send far more than the node accepts (to try its bounds)."""
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 64 * _MiB),
                                                                   ("grpc.max_receive_message_length", 64 * _MiB)])
    return channel, node_pb2_grpc.NodeStub(channel)


def attested_key(stub: node_pb2_grpc.NodeStub) -> KeyConfig:
    """The node's current key configuration, from evidence verified against a fresh nonce."""
    nonce = os.urandom(32)
    reply = stub.Attest(node_pb2.AttestRequest(nonce=nonce), timeout=CALL_TIMEOUT_S)
    verified = verify(EvidenceBundle.from_json(reply.evidence_bundle), shipped_policy("dev"), expected_nonce=nonce)
    return KeyConfig.decode(verified.key_config)


# ----- inner requests and their encapsulations --------------------------------------------------


def inner_request(path: bytes | str, content: bytes | dict | None = None, method: bytes = b"POST",
                  headers: list[tuple[bytes, bytes]] | None = None) -> bytes:
    """The Binary HTTP request a client would encapsulate."""
    if isinstance(content, dict):
        content = json.dumps(content).encode()
    path = path.encode() if isinstance(path, str) else path
    fields = [(b"content-type", b"application/json")] if headers is None else headers
    return bhttp.encode_request(bhttp.Request(method, b"https", b"veil.node", path, fields, content or b""))


def models_request() -> bytes:
    return inner_request("/v1/models", method=b"GET")


def chat_body(content: str = "say something", **extra: object) -> dict:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": content}], "max_tokens": 6,
            "temperature": 0.8, "seed": 11, **extra}


@dataclass
class Sealed:
    """One encapsulated request and what opens its answer."""

    media_type: str
    encapsulated: bytes
    context: ClientContext | None = None
    sealer: ChunkedRequestSealer | None = None

    def open(self, answer: bytes) -> bhttp.Response:
        """Decrypt and decode the node's whole answer (raises OHTTPError if it is not one)."""
        if self.context is not None:
            return bhttp.decode_response(self.context.open_response(answer))
        opener, decoder, events = self.sealer.response_opener(), StreamingResponseDecoder(), []
        for piece in opener.feed(answer):
            events += decoder.feed(piece)
        opener.finish()
        decoder.finish()
        return bhttp.Response(decoder.head.status, list(decoder.head.headers), b"".join(events))


def seal_whole(config: KeyConfig, plaintext: bytes) -> Sealed:
    encapsulated, context = ClientRequest.encapsulate(config, plaintext)
    return Sealed(OHTTP_REQUEST, encapsulated, context=context)


def seal_chunked(config: KeyConfig, plaintext: bytes, pieces: int = 1, *, final: bool = True) -> Sealed:
    """A chunked encapsulation of `plaintext` in `pieces` chunks (the last one final unless told otherwise)."""
    sealer = ChunkedRequestSealer(config)
    size = max(1, -(-len(plaintext) // pieces))
    parts = [plaintext[index:index + size] for index in range(0, len(plaintext), size)] or [b""]
    wire = b"".join(sealer.seal_chunk(part) for part in parts[:-1] if part)
    wire += sealer.seal_chunk(parts[-1], final=final) if (final or parts[-1]) else b""
    return Sealed(OHTTP_CHUNKED_REQUEST, wire, sealer=sealer)


def seal(config: KeyConfig, plaintext: bytes, chunked: bool) -> Sealed:
    return seal_chunked(config, plaintext) if chunked else seal_whole(config, plaintext)


@dataclass
class InferResult:
    """A node's answer to one Infer call: its bytes, or the gRPC status that ended it."""

    data: bytes
    code: grpc.StatusCode
    details: str

    @property
    def ok(self) -> bool:
        return self.code == grpc.StatusCode.OK


def infer(stub: node_pb2_grpc.NodeStub, media_type: str, encapsulated: bytes,
          timeout: float = CALL_TIMEOUT_S) -> InferResult:
    received = bytearray()
    try:
        for chunk in stub.Infer(node_pb2.InferRequest(media_type=media_type, encapsulated=encapsulated),
                                timeout=timeout):
            received += chunk.data
    except grpc.RpcError as error:
        return InferResult(bytes(received), error.code(), error.details() or "")
    return InferResult(bytes(received), grpc.StatusCode.OK, "")


# The contract's answers to anything that does not decapsulate: a key the cleartext header names that
# the node does not hold, or anything else; each one status with one fixed sentence.
REFUSALS = {(grpc.StatusCode.INVALID_ARGUMENT, NOT_DECAPSULATED), (grpc.StatusCode.NOT_FOUND, KEY_UNKNOWN)}


def assert_generic_refusal(result: InferResult) -> None:
    """The node refused with one of the contract's fixed answers, and sent nothing."""
    assert (result.code, result.details) in REFUSALS
    assert result.data == b""


def answer_of(stub: node_pb2_grpc.NodeStub, sealed: Sealed, timeout: float = CALL_TIMEOUT_S) -> bhttp.Response:
    """Send `sealed`; the call must succeed and its answer must decrypt; returns the inner response."""
    result = infer(stub, sealed.media_type, sealed.encapsulated, timeout)
    assert result.ok, f"the node answered gRPC {result.code.name} instead of an encrypted response"
    try:
        return sealed.open(result.data)
    except OHTTPError as error:
        raise AssertionError("the node's answer does not decrypt as a whole response") from error


def assert_encrypted_answer(response: bhttp.Response, *, allow_ok: bool = True) -> None:
    """A decrypted answer is 200 or a contract 4xx with the JSON error shape, and never reflects the canary."""
    assert_no_canary(response.content, *(value for _, value in response.headers))
    if response.status == 200 and allow_ok:
        return
    assert 400 <= response.status < 500, f"inner status {response.status}"
    assert_error_shape(response.content)


def chat_text(response: bhttp.Response) -> str:
    """The text of a whole chat answer."""
    assert response.status == 200
    return json.loads(response.content)["choices"][0]["message"]["content"]


def streamed_text(response: bhttp.Response) -> str:
    """The text of a streamed chat answer (server-sent events ending in [DONE])."""
    assert response.status == 200
    events = response.content.split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""]
    chunks = [json.loads(event.removeprefix(b"data: ")) for event in events[:-2]]
    return "".join(chunk["choices"][0]["delta"].get("content", "") for chunk in chunks)


def reference_text(model_dir: Path, body: dict) -> str:
    """What the engine itself answers to the chat request `body` (a seeded one): the correct answer."""
    engine = LLMEngine(model_dir, EngineConfig(kv_cache_gib=0.02))
    prompt = engine.tokenizer.encode_chat([ChatMessage(m["role"], m["content"]) for m in body["messages"]])
    params = SamplingParams(max_tokens=body["max_tokens"], temperature=body["temperature"], seed=body["seed"])
    return engine.generate([prompt], params)[0].outputs[0].text
