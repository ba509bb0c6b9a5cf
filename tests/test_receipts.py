"""Signed answers: every answer of a real node carries a receipt the SDK verifies, and every corruption of
one is refused with its own error (attestation/receipts.py, client/receipts.py).

One in-process node (simulated attestation, the tiny model) behind an in-process gateway serves the
module; the receipts checked are the node's own, taken from its real answers.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
import uvicorn
from hypothesis import given, settings
from hypothesis import strategies as st

from attestation.bundle import EvidenceBundle
from attestation.measurement import Measurement
from attestation.receipts import (
    RECEIPT_TRAILER,
    AnswerFacts,
    MissingReceiptError,
    Receipt,
    ReceiptError,
    ReceiptFormatError,
    ReceiptKeyError,
    ReceiptMismatchError,
    ReceiptSignatureError,
    ReceiptSigner,
    ReceiptTimeError,
    decode_receipt,
    verify_against_statement,
    verify_receipt,
)
from attestation.transparency.statements import NodeKeyStatement, encode_statement
from attestation.verifier import verify
from client import wire
from client.errors import ReceiptRefusedError, StreamTruncatedError
from client.proxy import RECEIPT_HEADER, create_proxy_app
from client.receipts import ReceiptCheck
from client.sdk import Client
from client.streaming import StreamedAnswer
from enclave.node import NodeServer
from enclave.settings import NodeSettings
from engine.tiny import write_tiny_model
from ohttp.bhttp_stream import StreamingResponseDecoder
from policy import shipped_policy
from protocol import node_pb2, node_pb2_grpc
from tests.test_gateway_support import LiveGateway, gateway_settings
from veil.cli import main
from tests.conftest import HANG_S

MODEL = "tiny"
SKEW_S = shipped_policy("dev").attestation.max_clock_skew_s
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Where is the lighthouse?"}], "max_tokens": 6,
        "seed": 2}


@dataclasses.dataclass
class Served:
    node: NodeServer
    gateway: LiveGateway
    audit_path: Path


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    model = write_tiny_model(tmp_path_factory.mktemp("model") / MODEL)
    audit_path = tmp_path_factory.mktemp("audit") / "node.jsonl"
    with pytest.MonkeyPatch.context() as patch:  # the node, the gateway and the clients trust one simulated root
        patch.setenv("VEIL_SIM_ROOT_DIR", str(tmp_path_factory.mktemp("sim-root")))
        node = NodeServer(NodeSettings(model=model, policy="dev", attestation="sim", capacity=4, key_rotation_s=0,
                                       audit=f"file:{audit_path}", kv_cache_gib=0.05, model_name=MODEL))
        node.start()
        try:
            with LiveGateway(gateway_settings([f"127.0.0.1:{node.port}"])) as gateway:
                gateway.wait_for(lambda: len(gateway.runtime.pool) == 1, timeout=HANG_S)
                yield Served(node, gateway, audit_path)
        finally:
            node.stop()


@pytest.fixture()
def client(served: Served) -> Iterator[Client]:
    with Client(served.gateway.url, policy="dev") as sdk:
        yield sdk


@dataclasses.dataclass(frozen=True)
class Answer:
    """One real answer of the node, read below the SDK: what was sent, what came back."""

    request: bytes
    status: int
    body: bytes
    trailers: tuple[tuple[bytes, bytes], ...]
    pieces: tuple[bytes, ...] = ()  # a streamed answer's gRPC messages, as the gateway relays them
    sealed: wire.SealedRequest | None = None

    @property
    def receipt(self) -> bytes:
        [value] = [value for name, value in self.trailers if name == RECEIPT_TRAILER]
        return value

    def facts(self, served: Served, **changes) -> AnswerFacts:
        facts = AnswerFacts(self.request, hashlib.sha256(self.body).digest(), self.status,
                            served.node.receipts.public_key, served.node.measurement)
        return dataclasses.replace(facts, **changes)


def _node_stub(served: Served) -> tuple[node_pb2_grpc.NodeStub, str, bytes]:
    stub = node_pb2_grpc.NodeStub(grpc.insecure_channel(f"127.0.0.1:{served.node.port}"))
    nonce = os.urandom(32)
    evidence = stub.Attest(node_pb2.AttestRequest(nonce=nonce), timeout=30).evidence_bundle
    verified = verify(EvidenceBundle.from_json(evidence), shipped_policy("dev"), expected_nonce=nonce)
    return stub, verified.node_id, verified.key_config


def ask(served: Served, body: dict, streaming: bool = False) -> Answer:
    stub, node_id, key_config = _node_stub(served)
    request = wire.build_request("POST", "/v1/chat/completions", body)
    sealed = wire.seal(node_id, key_config, request, streaming)
    messages = [chunk.data for chunk in stub.Infer(node_pb2.InferRequest(
        media_type=sealed.media_type, encapsulated=sealed.encapsulated), timeout=120) if chunk.data]
    if not streaming:
        inner = sealed.open_whole(b"".join(messages))
        return Answer(request, inner.status, inner.content, inner.trailers, sealed=sealed)
    opener, decoder, content = sealed.sealer.response_opener(), StreamingResponseDecoder(), []
    for message in messages:
        for plaintext in opener.feed(message):
            content += decoder.feed(plaintext)
    content += decoder.feed(opener.finish())
    decoder.finish()
    return Answer(request, decoder.head.status, b"".join(content), tuple(decoder.trailers), tuple(messages), sealed)


@pytest.fixture(scope="module")
def whole(served: Served) -> Answer:
    return ask(served, CHAT)


# ----- every answer carries one, for its own request and body -------------------------------------------------


@pytest.mark.parametrize("kind", ["whole", "streamed", "refused"])
def test_every_answer_carries_a_receipt_for_its_request_and_body(served: Served, kind: str) -> None:
    body = {**CHAT, "bogus_field": 1} if kind == "refused" else {**CHAT, "stream": kind == "streamed"}
    answer = ask(served, body, streaming=kind == "streamed")
    assert answer.status == (400 if kind == "refused" else 200)
    receipt = verify_receipt(answer.receipt, answer.facts(served), time.time(), SKEW_S)
    assert receipt.request_sha256 == hashlib.sha256(answer.request).hexdigest()
    assert receipt.response_sha256 == hashlib.sha256(answer.body).hexdigest() and receipt.status == answer.status
    assert receipt.model_digest == served.node.measurement.model_digest.hex()
    assert receipt.measurement == served.node.measurement.digest().hex()
    if kind == "streamed":
        assert answer.body.endswith(b"data: [DONE]\n\n")  # the hash covers the whole streamed body


def test_a_receipt_has_one_canonical_encoding(whole: Answer) -> None:
    receipt = decode_receipt(whole.receipt)
    assert receipt.encode() == whole.receipt and whole.receipt.isascii() and b" " not in whole.receipt
    spaced = json.dumps(json.loads(whole.receipt), sort_keys=True).encode()
    unsorted = json.dumps(dict(reversed(json.loads(whole.receipt).items())), separators=(",", ":")).encode()
    extra = whole.receipt[:-1] + b',"z":1}'
    for other in (spaced, unsorted, extra, whole.receipt.replace(b'"status":200', b'"status":200.0')):
        with pytest.raises(ReceiptFormatError):
            decode_receipt(other)


# ----- every corruption is refused, each with its own error -----------------------------------------------------


def test_a_bit_flip_anywhere_in_a_receipt_is_refused(served: Served, whole: Answer) -> None:
    facts, now = whole.facts(served), time.time()
    verify_receipt(whole.receipt, facts, now, SKEW_S)
    refusals: set[type] = set()
    for index in range(len(whole.receipt)):
        for bit in range(8):
            flipped = bytearray(whole.receipt)
            flipped[index] ^= 1 << bit
            with pytest.raises(ReceiptError) as refused:
                verify_receipt(bytes(flipped), facts, now, SKEW_S)
            refusals.add(type(refused.value))
    # Syntax, the key named and the signature each caught some flips: every field is covered by one of them.
    assert {ReceiptFormatError, ReceiptKeyError, ReceiptSignatureError} <= refusals


def _other_measurement(measurement: Measurement, **digests: bytes) -> Measurement:
    return dataclasses.replace(measurement, **digests)


MISMATCHES = {
    "another request": lambda a, s: {"request": a.request.replace(b"lighthouse", b"lightHouse")},
    "another answer body": lambda a, s: {"body_sha256": hashlib.sha256(a.body + b" ").digest()},
    "another status": lambda a, s: {"status": 500},
    "another model": lambda a, s: {"measurement": _other_measurement(s.node.measurement, model_digest=bytes(32))},
    "another measurement": lambda a, s: {"measurement": _other_measurement(s.node.measurement, code_digest=bytes(32))},
}


@pytest.mark.parametrize("what", list(MISMATCHES))
def test_a_receipt_for_another_request_body_status_model_or_measurement_is_refused(
        served: Served, whole: Answer, what: str) -> None:
    facts = whole.facts(served, **MISMATCHES[what](whole, served))
    with pytest.raises(ReceiptMismatchError, match=what):
        verify_receipt(whole.receipt, facts, time.time(), SKEW_S)


def test_a_receipt_under_another_key_is_refused(served: Served, whole: Answer) -> None:
    other = ReceiptSigner.generate()
    with pytest.raises(ReceiptKeyError, match="another receipt key"):  # the node's receipt, checked under another key
        verify_receipt(whole.receipt, whole.facts(served, receipt_key=other.public_key), time.time(), SKEW_S)
    # Another key's signature over the node's receipt, naming the node's key: the signature does not verify.
    receipt = decode_receipt(whole.receipt)
    forged = dataclasses.replace(receipt, signature=other._private.sign(receipt.signed_bytes()))
    with pytest.raises(ReceiptSignatureError):
        verify_receipt(forged.encode(), whole.facts(served), time.time(), SKEW_S)


@pytest.mark.parametrize("offset", [-1, 1])
def test_a_receipt_dated_beyond_the_policys_clock_skew_is_refused(served: Served, whole: Answer, offset: int) -> None:
    signed_at = decode_receipt(whole.receipt).time
    verify_receipt(whole.receipt, whole.facts(served), signed_at + offset * SKEW_S, SKEW_S)  # at the edge: taken
    with pytest.raises(ReceiptTimeError, match="clock skew"):
        verify_receipt(whole.receipt, whole.facts(served), signed_at + offset * (SKEW_S + 1), SKEW_S)


def _check(served: Served, answer: Answer) -> ReceiptCheck:
    """The SDK's check of `answer`, for the node as its evidence verifies."""
    stub = _node_stub(served)[0]
    node = verify(EvidenceBundle.from_json(stub.Attest(node_pb2.AttestRequest(nonce=bytes(32))).evidence_bundle),
                  shipped_policy("dev"), expected_nonce=bytes(32))
    return ReceiptCheck(answer.request, node, SKEW_S, time.time)


def test_an_answer_without_a_receipt_or_with_two_is_refused(served: Served, whole: Answer) -> None:
    check, body = _check(served, whole), hashlib.sha256(whole.body).digest()
    assert check.verify(whole.trailers, body, 200) == decode_receipt(whole.receipt)
    with pytest.raises(ReceiptRefusedError) as missing:
        check.verify((), body, 200)
    assert type(missing.value.receipt_error) is MissingReceiptError
    with pytest.raises(ReceiptRefusedError) as doubled:
        check.verify(whole.trailers * 2, body, 200)
    assert type(doubled.value.receipt_error) is ReceiptFormatError


def _streamed_answer(served: Served, answer: Answer, messages: tuple[bytes, ...]) -> StreamedAnswer:
    response = httpx.Response(200, content=iter(messages))
    return StreamedAnswer(response, answer.sealed, _check(served, answer))


def test_a_stream_is_verified_at_its_end_and_one_cut_before_its_receipt_is_refused(served: Served) -> None:
    answer = ask(served, {**CHAT, "stream": True}, streaming=True)
    complete = _streamed_answer(served, answer, answer.pieces)
    assert complete.read_head() and complete.receipt is None
    assert list(complete.events()) and complete.receipt == decode_receipt(answer.receipt)
    cut = _streamed_answer(served, answer, answer.pieces[:-1])  # the last message holds the end and the receipt
    assert cut.read_head()
    with pytest.raises(StreamTruncatedError):
        list(cut.events())
    assert cut.receipt is None


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=700), st.text(max_size=300).map(str.encode)))
def test_arbitrary_bytes_are_receipt_format_errors(data: bytes) -> None:
    with pytest.raises(ReceiptFormatError):
        decode_receipt(data)


# ----- through the SDK, the proxy, the command line and a third party ---------------------------------------


def _statement(served: Served, **changes) -> NodeKeyStatement:
    now = int(time.time())
    statement = NodeKeyStatement(hashlib.sha256(served.node.keys.current.config.encode()).hexdigest(),
                                 served.node.measurement.digest().hex(), now - 600, now + 600,
                                 served.node.receipts.public_key.hex())
    return dataclasses.replace(statement, **changes)


def test_the_sdk_verifies_every_answers_receipt_and_exposes_it(
        served: Served, client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[bytes] = []
    build = wire.build_request
    monkeypatch.setattr(wire, "build_request", lambda *args, **kwargs: sent.append(build(*args, **kwargs)) or sent[-1])
    answer = client.chat.completions.create(**CHAT)
    assert answer.receipt is not None and answer.receipt.status == 200
    assert answer.receipt.request_sha256 == hashlib.sha256(sent[-1]).hexdigest()
    with client.chat.completions.create(**CHAT, stream=True) as stream:
        assert stream.receipt is None  # it comes at the end
        chunks = list(stream)
    assert chunks and stream.receipt is not None and stream.receipt.request_sha256 == hashlib.sha256(sent[-1]).hexdigest()
    assert stream.receipt.response_sha256 != answer.receipt.response_sha256
    assert client.models.list().receipt is not None
    for receipt in (answer.receipt, stream.receipt):  # a third party with the logged key statement
        assert verify_against_statement(receipt.encode(), _statement(served)) == receipt


def test_a_third_party_refuses_a_receipt_the_statement_does_not_vouch_for(served: Served, whole: Answer) -> None:
    other = ReceiptSigner.generate().public_key.hex()
    signed_at = decode_receipt(whole.receipt).time
    cases = {
        ReceiptKeyError: _statement(served, receipt_key=other),
        ReceiptMismatchError: _statement(served, measurement=hashlib.sha256(b"other").hexdigest()),
        ReceiptTimeError: _statement(served, not_before=signed_at + 1, not_after=signed_at + 600),
    }
    for error, statement in cases.items():
        with pytest.raises(error):
            verify_against_statement(whole.receipt, statement)


def test_veil_receipt_verify_checks_a_receipt_against_a_key_statement_file(
        served: Served, whole: Answer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    receipt, request, body = tmp_path / "receipt.json", tmp_path / "request.bin", tmp_path / "body.json"
    receipt.write_bytes(whole.receipt + b"\n")
    request.write_bytes(whole.request)
    body.write_bytes(whole.body)
    good, bad = tmp_path / "statement.json", tmp_path / "other.json"
    good.write_bytes(encode_statement(_statement(served)))
    bad.write_bytes(encode_statement(_statement(served, receipt_key=ReceiptSigner.generate().public_key.hex())))
    assert main(["receipt", "verify", str(receipt), "--key-statement", str(good), "--request", str(request),
                 "--body", str(body)]) == 0
    assert "receipt verified" in capsys.readouterr().out
    assert main(["receipt", "verify", str(receipt), "--key-statement", str(bad)]) == 1
    assert "REFUSED" in capsys.readouterr().err
    body.write_bytes(whole.body + b" ")
    assert main(["receipt", "verify", str(receipt), "--key-statement", str(good), "--body", str(body)]) == 1
    assert "another body" in capsys.readouterr().err


def test_veil_chat_shows_the_receipt_and_the_receipt_key(served: Served, capsys: pytest.CaptureFixture[str]) -> None:
    for stream in ("--stream", "--no-stream"):
        assert main(["chat", "Where is the lighthouse?", "--gateway", served.gateway.url, "--policy", "dev",
                     "--max-tokens", "4", "--show-attestation", "--show-receipt", stream]) == 0
        out = capsys.readouterr().out
        receipt = decode_receipt(out.strip().splitlines()[-1].encode())
        assert verify_against_statement(receipt.encode(), _statement(served)) == receipt
        assert f"receipt key {served.node.receipts.public_key.hex()}" in out


def test_the_sdk_refuses_answers_signed_under_a_key_the_evidence_does_not_bind(served: Served, client: Client) -> None:
    bound = served.node.receipts
    served.node.receipts = ReceiptSigner.generate()  # the evidence the client verified binds the other key
    try:
        with pytest.raises(ReceiptRefusedError) as whole:
            client.chat.completions.create(**CHAT)
        assert type(whole.value.receipt_error) is ReceiptKeyError and "receipt" in str(whole.value)
        with client.chat.completions.create(**CHAT, stream=True) as stream:
            with pytest.raises(ReceiptRefusedError) as streamed:
                list(stream)
        assert type(streamed.value.receipt_error) is ReceiptKeyError and stream.receipt is None
    finally:
        served.node.receipts = bound


def test_the_proxy_hands_a_whole_answers_receipt_to_the_local_app_only(served: Served, client: Client) -> None:
    server = uvicorn.Server(uvicorn.Config(create_proxy_app(client), host="127.0.0.1", port=0, access_log=False,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.05)
        base = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
        answer = httpx.post(f"{base}/v1/chat/completions", json=CHAT, timeout=120)
        assert answer.status_code == 200 and "receipt" not in answer.json()
        receipt = decode_receipt(base64.b64decode(answer.headers[RECEIPT_HEADER]))
        assert receipt.status == 200 and receipt.model_digest == served.node.measurement.model_digest.hex()
        assert verify_against_statement(receipt.encode(), _statement(served)) == receipt
    finally:
        server.should_exit = True
        thread.join(HANG_S)


def test_no_receipt_nor_receipt_key_reaches_the_audit_or_the_logs(
        served: Served, client: Client, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    receipts: list[Receipt] = [client.chat.completions.create(**CHAT).receipt]
    with client.chat.completions.create(**CHAT, stream=True) as stream:
        list(stream)
    receipts.append(stream.receipt)
    served.node.flush_audit()
    key = served.node.receipts.public_key
    secrets_of_receipts = [key.hex(), base64.b64encode(key).decode(), served.node.receipts.key_id]
    for receipt in receipts:
        secrets_of_receipts += [base64.b64encode(receipt.signature).decode(), receipt.request_sha256,
                                receipt.response_sha256]
    seen = [served.audit_path.read_text(), json.dumps(served.gateway.audit.records), caplog.text,
            repr(served.node.receipts)]
    for text in seen:
        for value in secrets_of_receipts:
            assert value not in text


def test_a_monitor_checks_a_receipt_against_the_node_key_statements_of_the_log_it_audits(
        served: Served, whole: Answer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log, receipt = tmp_path / "log", tmp_path / "receipt.json"
    assert main(["log", "init", str(log), "--origin", "log.example/veil", "--key", str(tmp_path / "log.key")]) == 0
    log_key = capsys.readouterr().out.strip()
    receipt.write_bytes(whole.receipt)

    def audit() -> int:
        return main(["log", "audit", str(log), "--log-key", log_key, "--state", str(tmp_path / "seen.json"),
                     "--receipt", str(receipt)])

    def append(*statements: NodeKeyStatement) -> None:
        entries = tmp_path / "entries.json"
        entries.write_text(json.dumps([{"type": "veil.node-key/v1", **dataclasses.asdict(s)} for s in statements]))
        assert main(["log", "append", str(log), "--key", str(tmp_path / "log.key"), "--statement", str(entries)]) == 0

    append(_statement(served, receipt_key=ReceiptSigner.generate().public_key.hex()))  # another node's key
    assert audit() == 1 and "no node key statement of the log carries the key" in capsys.readouterr().err
    signed_at = decode_receipt(whole.receipt).time
    append(_statement(served, not_before=signed_at + 10, not_after=signed_at + 60))  # its key, logged for later
    assert audit() == 1 and "validity window" in capsys.readouterr().err
    append(_statement(served))
    assert audit() == 0 and "node key statement at entry 2" in capsys.readouterr().out
