"""End to end with real processes on loopback: a gateway, three fleet nodes, the SDK, and two more nodes —
one behind a recording relay (what does a node receive?) and one whose evidence is forged.

One fleet serves the whole module. Its nodes rotate their keys every 30 s, so the rotation test
only has to wait for the next one. The canary test runs last: it stops every process and then
searches everything they wrote.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import pytest
import torch
import uvicorn

from attestation.sim_root import ROOT_DIR_ENV, load_or_create_sim_root
from audit.events import BlocksZeroed, NodeStarted
from audit.records import read_audit_files
from client import wire
from client.directory import DirectoryEntry
from client.proxy import create_proxy_app
from client.sdk import Client
from client.verify import CandidateVerifier
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.tiny import write_tiny_model
from engine.tokenizer import ChatMessage
from policy import shipped_policy
from protocol import node_pb2, node_pb2_grpc
from veil.fleet import Fleet, FleetSettings
from tests.conftest import HANG_S

pytestmark = pytest.mark.slow
MODEL = "tiny-model"
CANARIES = [f"CANARY{secrets.token_hex(8).upper()}" for _ in range(4)]
ROTATION_S = 30.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class RecordingRelay(node_pb2_grpc.NodeServicer):
    """Stands between the gateway and a real node and records exactly what the gateway sends it."""

    target: str
    infer_calls: list[tuple[list[tuple[str, str]], dict]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stub = node_pb2_grpc.NodeStub(grpc.insecure_channel(self.target))

    def Attest(self, request, context):
        return self._forward(lambda: self._stub.Attest(request, timeout=10), context)

    def Health(self, request, context):
        return self._forward(lambda: self._stub.Health(request, timeout=5), context)

    def Infer(self, request, context):
        fields = {descriptor.name: value for descriptor, value in request.ListFields()}
        self.infer_calls.append((list(context.invocation_metadata()), fields))
        yield from self._stub.Infer(request, timeout=60)

    def _forward(self, call, context):
        try:
            return call()
        except grpc.RpcError as error:
            context.abort(error.code(), "the relayed node is not ready")


@dataclass
class World:
    fleet: Fleet
    model_dir: Path
    relay: RecordingRelay
    extra_processes: list[subprocess.Popen]
    extra_logs: list[Path]
    forged_address: str
    relayed_node_id: str


def _spawn_node(model_dir: Path, port: int, folder: Path, sim_root: Path) -> tuple[subprocess.Popen, list[Path]]:
    folder.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, **{ROOT_DIR_ENV: str(sim_root), "OMP_NUM_THREADS": "1", "TMPDIR": str(folder)})
    out, err = folder / "node.out", folder / "node.err"
    with open(out, "wb") as stdout, open(err, "wb") as stderr:
        popen = subprocess.Popen(
            [sys.executable, "-m", "veil", "node", "--model", str(model_dir), "--policy", "dev", "--attestation",
             "sim", "--listen", f"127.0.0.1:{port}", "--kv-cache-gib", "0.125", "--capacity", "8",
             "--audit", f"file:{folder / 'audit.jsonl'}"],
            stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL, env=env,
        )
    return popen, [out, err, folder / "audit.jsonl"]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    root = tmp_path_factory.mktemp("e2e-fleet")
    model_dir = write_tiny_model(root / MODEL)
    sim_root = root / "sim-root"
    load_or_create_sim_root(sim_root)
    relayed_port, forged_port = _free_port(), _free_port()
    relayed, relayed_logs = _spawn_node(model_dir, relayed_port, root / "relayed", sim_root)
    # The forged node signs with a root of its own making: valid-looking evidence nobody trusts.
    forged, forged_logs = _spawn_node(model_dir, forged_port, root / "forged", root / "forged-root")
    relay = RecordingRelay(f"127.0.0.1:{relayed_port}")
    relay_server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    node_pb2_grpc.add_NodeServicer_to_server(relay, relay_server)
    relay_port = relay_server.add_insecure_port("127.0.0.1:0")
    relay_server.start()
    settings = FleetSettings(
        nodes=3, model_dir=model_dir, workdir=root / "fleet", sim_root_dir=sim_root, torch_threads=1,
        key_rotation_s=ROTATION_S, key_grace_s=300, reattest_s=2, health_s=1,
        extra_gateway_nodes=(f"127.0.0.1:{relay_port}", f"127.0.0.1:{forged_port}"),
    )
    fleet = Fleet(settings)
    previous_root = os.environ.get(ROOT_DIR_ENV)
    os.environ[ROOT_DIR_ENV] = str(sim_root)  # the client's dev policy trusts the fleet's simulated root
    try:
        fleet.start()
        fleet.wait_for_pool(4, timeout_s=90)  # the three fleet nodes and the relayed one
        relayed_id = _started_node_id(root / "relayed" / "audit.jsonl")
        yield World(fleet, model_dir, relay, [relayed, forged], relayed_logs + forged_logs,
                    f"127.0.0.1:{forged_port}", relayed_id)
    finally:
        fleet.stop()
        for process in (relayed, forged):
            process.terminate()
            process.wait(HANG_S)
        relay_server.stop(0)
        if previous_root is None:
            os.environ.pop(ROOT_DIR_ENV, None)
        else:
            os.environ[ROOT_DIR_ENV] = previous_root


def _started_node_id(audit_file: Path) -> str:
    for _ in range(100):
        if audit_file.is_file():
            events = [r.event for r in read_audit_files([audit_file]).records if isinstance(r.event, NodeStarted)]
            if events:
                return events[0].node_id
        time.sleep(0.1)
    raise AssertionError("the relayed node never announced its start")


@pytest.fixture(scope="module")
def engine(world: World) -> Iterator[LLMEngine]:
    """The engine in-process on the same model: the reference every encrypted answer must equal."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the nodes run one thread each; same arithmetic, same tokens
    try:
        yield LLMEngine(world.model_dir, EngineConfig(kv_cache_gib=0.125))
    finally:
        torch.set_num_threads(threads)


@pytest.fixture()
def client(world: World) -> Iterator[Client]:
    with Client(world.fleet.gateway_url, policy="dev") as sdk:
        yield sdk


def _expected(engine: LLMEngine, prompt, params: SamplingParams) -> list[tuple[str, str]]:
    output = engine.generate([prompt], params)[0]
    return [(o.text, o.finish_reason.value if o.finish_reason else None) for o in output.outputs]


def _chat_prompt(engine: LLMEngine, content: str) -> list[int]:
    return engine.tokenizer.encode_chat([ChatMessage("user", content)])


# ----- answers equal the engine's own --------------------------------------------------------------


def test_a_whole_chat_answer_equals_the_engines_output(client: Client, engine: LLMEngine) -> None:
    messages = [{"role": "user", "content": "Where is the lighthouse?"}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0.8,
                                            top_p=0.9, seed=5, n=2)
    expected = _expected(engine, _chat_prompt(engine, messages[0]["content"]),
                         SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=5, n=2))
    assert [(c.message.content, c.finish_reason) for c in answer.choices] == [(t, r) for t, r in expected]
    assert answer.usage.completion_tokens > 0
    assert answer.route.node_id in {c.node_id for c in answer.route.candidates if c.ok}


def test_a_streamed_chat_answer_equals_the_engines_output(client: Client, engine: LLMEngine) -> None:
    messages = [{"role": "user", "content": "Count the waves."}]
    with client.chat.completions.create(model=MODEL, messages=messages, stream=True, max_tokens=24,
                                        temperature=0.0, seed=3) as stream:
        chunks = list(stream)
    text = "".join(choice.delta.content or "" for chunk in chunks for choice in chunk.choices)
    [(expected_text, expected_reason)] = _expected(engine, _chat_prompt(engine, messages[0]["content"]),
                                                   SamplingParams(max_tokens=24, temperature=0.0, seed=3))
    assert text == expected_text
    assert chunks[-1].choices[0].finish_reason == expected_reason
    assert len(chunks) > 1  # it really streamed: one event per engine delta


def test_completions_whole_and_streamed_equal_the_engines_output(client: Client, engine: LLMEngine) -> None:
    prompt = "Once upon a time"
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=11)
    [(expected_text, _)] = _expected(engine, prompt, params)
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=1.0, seed=11)
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=1.0, seed=11,
                                         stream=True)
    assert whole.choices[0].text == expected_text
    assert "".join(c.choices[0].text for c in streamed) == expected_text


def test_sampling_extras_and_logprobs_reach_the_node_through_the_sdk(client: Client) -> None:
    answer = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=4, logprobs=2, ignore_eos=True,
                                       min_p=0.5, stop_token_ids=[0])
    logprobs = answer.choices[0].logprobs
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == 4
    assert all(len(alternatives) <= 2 for alternatives in logprobs["top_logprobs"])
    with pytest.raises(TypeError, match="unexpected keyword"):
        client.completions.create(model=MODEL, prompt="x", top_a=3)


def test_an_error_inside_the_encryption_reaches_only_the_client(client: Client) -> None:
    from client.errors import NodeError

    # A field only the node reads: the SDK sends it sealed, and the node's refusal comes back sealed too.
    with pytest.raises(NodeError) as caught:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       extra_body={"bogus_field": 1})
    assert caught.value.status == 400 and caught.value.code == "unknown_parameter"


def test_a_streamed_request_the_node_refuses_raises_at_create_not_mid_iteration(client: Client) -> None:
    from client.errors import NodeError

    with pytest.raises(NodeError) as caught:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, stream=True, extra_body={"bogus_field": 1})
    assert caught.value.status == 400 and caught.value.code == "unknown_parameter"


class SkewedClock:
    """The SDK's view of time on a computer whose clock is `offset_s` off."""

    def __init__(self, offset_s: float) -> None:
        self.offset_s = offset_s

    def time(self) -> float:
        return time.time() + self.offset_s

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_with_a_wrong_clock_is_refused_once_then_corrects_it_from_the_nodes_date(
        world: World, monkeypatch: pytest.MonkeyPatch, stream: bool) -> None:
    import client.sdk as sdk

    monkeypatch.setattr(sdk, "time", SkewedClock(-600.0))  # ten minutes slow: outside every node's window
    sent_dates: list[float] = []
    build = wire.build_request
    monkeypatch.setattr(wire, "build_request",
                        lambda *args, now=None, **kwargs: sent_dates.append(now) or build(*args, now=now, **kwargs))
    with Client(world.fleet.gateway_url, policy="dev") as skewed:
        answer = skewed.completions.create(model=MODEL, prompt="what time is it", max_tokens=3, stream=stream)
        assert (list(answer)[-1] if stream else answer).choices
        again = skewed.completions.create(model=MODEL, prompt="and now", max_tokens=3)
        assert again.choices
    assert len(sent_dates) == 3  # refused, corrected, and the next request right the first time
    assert abs(sent_dates[0] - (time.time() - 600)) < 60
    assert abs(sent_dates[1] - time.time()) < 30 and abs(sent_dates[2] - time.time()) < 30


# ----- forged evidence, header stripping, the proxy -------------------------------------------------


def test_a_node_with_forged_evidence_is_never_admitted_nor_verified(world: World, client: Client) -> None:
    stub = node_pb2_grpc.NodeStub(grpc.insecure_channel(world.forged_address))
    reply = stub.Attest(node_pb2.AttestRequest(nonce=secrets.token_bytes(32)), timeout=60)
    from attestation.bundle import EvidenceBundle
    from attestation.verifier import node_id_for

    bundle = EvidenceBundle.from_json(reply.evidence_bundle)
    forged_id = node_id_for(bundle.key_config, bundle.measurement)
    time.sleep(3)  # the gateway retries admission every second: give it several chances
    listed = {node["node_id"] for node in httpx.get(f"{world.fleet.gateway_url}/v1/nodes").json()["nodes"]}
    assert forged_id not in listed and len(listed) == 4
    # Even a gateway that listed it would not get a client to encrypt to it.
    record = CandidateVerifier(shipped_policy("dev")).check(
        DirectoryEntry(forged_id, bundle.key_config, reply.evidence_bundle, reply.capacity))
    assert not record.ok and record.failed_check == "chain"
    for _ in range(6):
        answer = client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert answer.route.node_id != forged_id


def test_the_node_receives_only_the_ciphertext_and_the_gateways_own_fields(world: World) -> None:
    directory = httpx.get(f"{world.fleet.gateway_url}/v1/nodes").json()
    [entry] = [n for n in directory["nodes"] if n["node_id"] == world.relayed_node_id]
    inner = wire.build_request("POST", "/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 3})
    sealed = wire.seal(entry["node_id"], base64.b64decode(entry["key_config"]), inner, streaming=False)
    identifying = {
        "cookie": "session=USERCOOKIE42", "x-forwarded-for": "203.0.113.77", "user-agent": "UserAgent/9.9 (Alice)",
        "authorization": "Bearer USERTOKEN", "x-request-id": "USERREQUEST7", "forwarded": "for=198.51.100.4",
        "x-real-ip": "198.51.100.9", "accept-language": "fr-CH",
    }
    before = len(world.relay.infer_calls)
    body = {"candidates": [{"node_id": sealed.node_id, "media_type": sealed.media_type,
                            "encapsulated": base64.b64encode(sealed.encapsulated).decode()}]}
    response = httpx.post(f"{world.fleet.gateway_url}/v1/infer", json=body, headers=identifying, timeout=60)
    assert response.status_code == 200 and response.headers["veil-node-id"] == sealed.node_id
    assert sealed.open_whole(response.content).status == 200
    [(metadata, fields)] = world.relay.infer_calls[before:]
    assert fields == {"media_type": sealed.media_type, "encapsulated": sealed.encapsulated}
    sent = {name.lower() for name in identifying} | {value.lower() for value in identifying.values()}
    for key, value in metadata:
        assert key.lower() not in sent - {"user-agent"}
        assert str(value).lower() not in sent
        assert not any(marker in str(value) for marker in ("USER", "203.0.113", "198.51.100", "Alice", "fr-CH"))


def test_the_local_proxy_serves_openai_clients(world: World, engine: LLMEngine) -> None:
    with Client(world.fleet.gateway_url, policy="dev") as sdk:
        config = uvicorn.Config(create_proxy_app(sdk), host="127.0.0.1", port=0, access_log=False, log_level="warning")
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        try:
            while not server.started:
                time.sleep(0.05)
            port = server.servers[0].sockets[0].getsockname()[1]
            _use_proxy(f"http://127.0.0.1:{port}", engine)
        finally:
            server.should_exit = True
            thread.join(HANG_S)


def _use_proxy(base: str, engine: LLMEngine) -> None:
    models = httpx.get(f"{base}/v1/models", timeout=60).json()
    assert models["object"] == "list" and models["data"][0]["id"] == MODEL
    request = {"model": MODEL, "messages": [{"role": "user", "content": "Hi proxy"}], "max_tokens": 12,
               "temperature": 0.5, "seed": 9}
    [(expected, _)] = _expected(engine, _chat_prompt(engine, "Hi proxy"),
                                SamplingParams(max_tokens=12, temperature=0.5, seed=9))
    whole = httpx.post(f"{base}/v1/chat/completions", json=request, timeout=60)
    assert whole.status_code == 200
    assert whole.json()["object"] == "chat.completion" and whole.json()["choices"][0]["message"]["content"] == expected
    with httpx.stream("POST", f"{base}/v1/chat/completions", json={**request, "stream": True}, timeout=60) as events:
        assert events.headers["content-type"].startswith("text/event-stream")
        lines = [line[len("data: "):] for line in events.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == expected
    for stream in (False, True):  # a refusal is an HTTP error, as OpenAI clients expect, even when streaming
        bad = httpx.post(f"{base}/v1/chat/completions", json={**request, "model": "absent", "stream": stream}, timeout=60)
        assert bad.status_code == 404 and bad.json()["error"]["code"] == "model_not_found"
    _check_streamed_usage(base, request, whole.json()["usage"])
    _check_model_retrieval(base)
    _check_sampling_extras(base, request)


def _check_sampling_extras(base: str, request: dict) -> None:
    """Logprobs and the sampling settings beyond OpenAI's pass through the proxy and the SDK to the node."""
    asked = {**request, "max_tokens": 3, "ignore_eos": True, "logprobs": True, "top_logprobs": 2, "top_k": 1}
    answer = httpx.post(f"{base}/v1/chat/completions", json=asked, timeout=60).json()
    content = answer["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and all(len(entry["top_logprobs"]) == 2 for entry in content)
    # top_k = 1 draws the most likely token every time: each token is its own best alternative.
    assert all(entry["token"] == entry["top_logprobs"][0]["token"] for entry in content)


def _check_streamed_usage(base: str, request: dict, whole_usage: dict) -> None:
    """stream_options.include_usage: a last chunk with no choices and the usage; null usage before it."""
    streamed = {**request, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=streamed, timeout=60) as events:
        lines = [line[len("data: "):] for line in events.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    *content, last = [json.loads(line) for line in lines[:-1]]
    assert content and all(chunk["usage"] is None and chunk["choices"] for chunk in content)
    assert last["object"] == "chat.completion.chunk" and last["choices"] == []
    assert last["usage"] == whole_usage and whole_usage["completion_tokens"] > 0
    plain = httpx.post(f"{base}/v1/chat/completions", json={**request, "stream_options": {"include_usage": True}},
                       timeout=60)
    assert plain.status_code == 400 and plain.json()["error"]["code"] == "invalid_request"


def _check_model_retrieval(base: str) -> None:
    """GET /v1/models/{id}: the model object, or OpenAI's 404 error shape."""
    found = httpx.get(f"{base}/v1/models/{MODEL}", timeout=60)
    assert found.status_code == 200 and found.json() == {"id": MODEL, "object": "model", "owned_by": "veil",
                                                         "created": found.json()["created"], "task": "generate"}
    assert isinstance(found.json()["created"], int)
    missing = httpx.get(f"{base}/v1/models/absent-model", timeout=60)
    assert missing.status_code == 404
    error = missing.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "model_not_found" and error["type"] == "invalid_request_error"
    assert "absent-model" not in error["message"]


# ----- key rotation -------------------------------------------------------------------------------


def test_a_rotated_node_keeps_serving_clients_holding_the_old_directory(world: World) -> None:
    with Client(world.fleet.gateway_url, policy="dev", directory_ttl_s=3600) as stale:
        stale.completions.create(model=MODEL, prompt="warm", max_tokens=1)
        held = {entry.node_id for entry in stale._directory.get().entries}
        deadline = time.monotonic() + ROTATION_S + 30
        while True:
            listed = {n["node_id"] for n in httpx.get(f"{world.fleet.gateway_url}/v1/nodes").json()["nodes"]}
            if len(held - listed) >= 1:
                break
            assert time.monotonic() < deadline, "no node rotated its key in time"
            time.sleep(0.5)
        rotated = held - listed
        # The client draws each request's candidates at random: a rotated node serves about one request in
        # four, so requests go on until one has (twelve missed it one run in thirty); the bound only stops a
        # broken draw from looping forever, luck never reaches it ((3/4)^200).
        for _ in range(200):
            answer = stale.completions.create(model=MODEL, prompt="after rotation", max_tokens=2)
            assert answer.route.node_id in held  # encrypted to keys from before the rotation
            if answer.route.node_id in rotated:
                break
        else:
            raise AssertionError("no request went to a rotated node; the test proved nothing")


# ----- canaries and residue (last: it stops the fleet) --------------------------------------------


def test_canaries_leave_no_trace_and_no_freed_block_holds_data(world: World, client: Client) -> None:
    receipts = []  # the canary answers' receipts and the keys that signed them: the client's alone too
    for index, canary in enumerate(CANARIES):
        content = f"Please repeat exactly: {canary} {canary}"
        if index % 2:
            with client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                                stream=True, max_tokens=24, seed=index) as stream:
                assert list(stream)
            receipts.append((stream.receipt, stream.route))
        else:
            answer = client.completions.create(model=MODEL, prompt=content, max_tokens=24, seed=index)
            assert answer.choices
            receipts.append((answer.receipt, answer.route))
    traces = [canary.encode() for canary in CANARIES]
    for receipt, route in receipts:
        key = route.served_by.verified.receipt_key
        traces += [receipt.encode(), base64.b64encode(receipt.signature), receipt.request_sha256.encode(),
                   receipt.response_sha256.encode(), key.hex().encode(), base64.b64encode(key)]
    world.fleet.stop()
    for process in world.extra_processes:
        process.terminate()
        process.wait(HANG_S)
    written = [p for p in world.fleet.workdir.rglob("*") if p.is_file()] + [p for p in world.extra_logs if p.is_file()]
    assert any(p.suffix == ".jsonl" for p in written) and any(p.suffix == ".err" for p in written)
    for path in written:
        data = path.read_bytes()
        for trace in traces:
            assert trace not in data, f"a canary or a receipt leaked into {path.name}"
    node_audits = [p for p in world.fleet.audit_files() if p.name.startswith("node-")]
    zeroed = [r.event for r in read_audit_files(node_audits).records if isinstance(r.event, BlocksZeroed)]
    assert sum(event.blocks for event in zeroed) > 0
    assert sum(event.residue_blocks for event in zeroed) == 0
