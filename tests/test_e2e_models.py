"""Two models in one fleet, and the local proxy as OpenAI clients use it: real processes on loopback.

Two `veil node --model-name` processes (one per model) behind one gateway; the SDK, `veil proxy`'s app on
uvicorn, and the real `openai` package pointed at it. Every request for either model is served; the
model list has both; an unknown model is refused before anything is sent; errors keep the node's reason
and the field it names, in OpenAI's shape; a client that hangs up ends the node's work.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn

from attestation.sim_root import ROOT_DIR_ENV, load_or_create_sim_root
from audit.events import RequestFinished, RequestStatus
from audit.records import read_audit_files
from client.errors import ModelNotFoundError, ModelTaskError, NodeError
from client.sdk import Client
from client.proxy import create_proxy_app
from engine.tiny import write_tiny_model
from protocol.constants import INFER_PATH
from veil.fleet import Fleet, FleetSettings
from tests.conftest import HANG_S

pytestmark = pytest.mark.slow
ALPHA, BETA = "alpha-model", "beta-model"
REQUESTS_PER_MODEL = 20


@dataclass
class World:
    fleet: Fleet
    sdk: Client
    proxy_url: str


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    root = tmp_path_factory.mktemp("e2e-models")
    sim_root = root / "sim-root"
    load_or_create_sim_root(sim_root)
    settings = FleetSettings(nodes=2, model_dir=write_tiny_model(root / "tiny"), workdir=root / "fleet",
                             sim_root_dir=sim_root, torch_threads=1, model_names=(ALPHA, BETA))
    previous_root = os.environ.get(ROOT_DIR_ENV)
    os.environ[ROOT_DIR_ENV] = str(sim_root)  # the client's dev policy trusts the fleet's simulated root
    try:
        with Fleet(settings) as fleet, Client(fleet.gateway_url, policy="dev") as sdk:
            fleet.wait_for_pool(2, timeout_s=90)
            with _proxy(sdk) as proxy_url:
                yield World(fleet, sdk, proxy_url)
    finally:
        if previous_root is None:
            os.environ.pop(ROOT_DIR_ENV, None)
        else:
            os.environ[ROOT_DIR_ENV] = previous_root


class _proxy:
    """`veil proxy`'s app served by uvicorn on a loopback port, in a thread."""

    def __init__(self, sdk: Client) -> None:
        config = uvicorn.Config(create_proxy_app(sdk), host="127.0.0.1", port=0, access_log=False, log_level="warning")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def __enter__(self) -> str:
        self._thread.start()
        while not self._server.started:
            time.sleep(0.05)
        return f"http://127.0.0.1:{self._server.servers[0].sockets[0].getsockname()[1]}"

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(HANG_S)


def _chat(model: str, **fields) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2, **fields}


# ----- two models behind one gateway ---------------------------------------------------------------------

def test_the_directory_says_which_model_each_node_serves(world: World) -> None:
    nodes = httpx.get(f"{world.fleet.gateway_url}/v1/nodes").json()["nodes"]
    assert sorted(model for node in nodes for model in node["models"]) == [ALPHA, BETA]


def test_every_request_for_either_model_is_served_by_a_node_of_that_model(world: World) -> None:
    served_by: dict[str, set[str]] = {ALPHA: set(), BETA: set()}
    for model in (ALPHA, BETA):
        for _ in range(REQUESTS_PER_MODEL):
            answer = world.sdk.chat.completions.create(**_chat(model))
            assert answer.model == model
            served_by[model].add(answer.route.node_id)
    # One node per model: every request for a model reached that model's node, and never the other's.
    assert len(served_by[ALPHA]) == len(served_by[BETA]) == 1 and not served_by[ALPHA] & served_by[BETA]


def test_the_model_list_has_every_model_of_the_fleet(world: World) -> None:
    listed = world.sdk.models.list().data
    assert sorted(model.id for model in listed) == [ALPHA, BETA]
    assert all(model.created > 1_700_000_000 for model in listed)
    assert world.sdk.models.retrieve(BETA).id == BETA
    proxied = httpx.get(f"{world.proxy_url}/v1/models", timeout=60).json()
    assert sorted(model["id"] for model in proxied["data"]) == [ALPHA, BETA]


def test_an_unknown_model_is_refused_without_sending_anything(world: World) -> None:
    posted: list[str] = []
    http = httpx.Client(base_url=world.fleet.gateway_url,
                        event_hooks={"request": [lambda request: posted.append(request.url.path)]})
    with Client(world.fleet.gateway_url, policy="dev", http=http) as sdk:
        with pytest.raises(ModelNotFoundError):
            sdk.chat.completions.create(**_chat("gamma-model"))
        sdk.chat.completions.create(**_chat(ALPHA))  # the same client does send for a listed model
    assert posted.count(INFER_PATH) == 1


def test_embeddings_for_a_generation_model_are_refused_without_sending_anything(world: World) -> None:
    nodes = httpx.get(f"{world.fleet.gateway_url}/v1/nodes").json()["nodes"]
    assert {node["task"] for node in nodes} == {"generate"}
    assert {model.task for model in world.sdk.models.list().data} == {"generate"}
    posted: list[str] = []
    http = httpx.Client(base_url=world.fleet.gateway_url,
                        event_hooks={"request": [lambda request: posted.append(request.url.path)]})
    with Client(world.fleet.gateway_url, policy="dev", http=http) as sdk:
        with pytest.raises(ModelTaskError) as refused:
            sdk.embeddings.create(model=ALPHA, input="Hello")
        assert (refused.value.status, refused.value.code, refused.value.param) == (400, "model_not_embedding", "model")
    assert INFER_PATH not in posted
    with pytest.raises(openai.BadRequestError) as proxied:  # `veil proxy` answers it in OpenAI's shape
        openai.OpenAI(base_url=f"{world.proxy_url}/v1", api_key="unused", max_retries=0).embeddings.create(
            model=BETA, input="Hello")
    assert proxied.value.body["code"] == "model_not_embedding" and proxied.value.body["param"] == "model"


# ----- errors: the node's reason, in OpenAI's shape --------------------------------------------------------

def test_a_node_refusal_reaches_the_sdk_with_its_reason_and_field(world: World) -> None:
    with pytest.raises(NodeError) as refused:
        world.sdk.chat.completions.create(**_chat(ALPHA), extra_body={"frequency_penalty": 5.0})
    assert refused.value.status == 400 and refused.value.param == "frequency_penalty"
    assert refused.value.type == "invalid_request_error" and "between -2 and 2" in refused.value.message


@pytest.mark.parametrize("method, path, status", [
    ("GET", "/v1/nowhere", 404), ("DELETE", "/v1/chat/completions", 405), ("GET", "/v1/completions", 405),
])
def test_the_proxy_answers_paths_and_methods_it_lacks_in_openais_shape(world: World, method: str, path: str,
                                                                       status: int) -> None:
    answer = httpx.request(method, f"{world.proxy_url}{path}", timeout=60)
    assert answer.status_code == status and "detail" not in answer.json()
    assert set(answer.json()["error"]) == {"message", "type", "param", "code"}


def test_the_gateway_answers_paths_and_methods_it_lacks_in_openais_shape(world: World) -> None:
    for method, path, status in (("GET", "/v1/nowhere", 404), ("GET", INFER_PATH, 405)):
        answer = httpx.request(method, f"{world.fleet.gateway_url}{path}")
        assert answer.status_code == status
        error = answer.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"


# ----- the real openai package against veil proxy ----------------------------------------------------------

@pytest.fixture(scope="module")
def oa(world: World) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{world.proxy_url}/v1", api_key="unused-by-veil", max_retries=0, timeout=120)


def test_openai_package_chat_whole_and_streamed(oa: openai.OpenAI) -> None:
    whole = oa.chat.completions.create(model=ALPHA, messages=[{"role": "user", "content": "Hi"}], temperature=0,
                                       max_completion_tokens=3, user="end-user-7", extra_body={"ignore_eos": True})
    assert whole.usage.completion_tokens == 3 and whole.model == ALPHA
    chunks = list(oa.chat.completions.create(model=ALPHA, messages=[{"role": "user", "content": "Hi"}], temperature=0,
                                             max_completion_tokens=3, stream=True, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 3


def test_openai_package_completions_echo(oa: openai.OpenAI) -> None:
    plain = oa.completions.create(model=BETA, prompt="once upon", max_tokens=3, temperature=0)
    echoed = oa.completions.create(model=BETA, prompt="once upon", max_tokens=3, temperature=0, echo=True)
    assert echoed.choices[0].text == "once upon" + plain.choices[0].text


@pytest.mark.parametrize("fields, param", [
    ({"frequency_penalty": 5.0}, "frequency_penalty"), ({"extra_body": {"bogus_field": 1}}, "bogus_field"),
    ({"max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens"), ({"store": True}, "store"),
    ({"reasoning_effort": "high"}, "reasoning_effort"),
])
def test_openai_package_sees_each_refusal_naming_its_field(oa: openai.OpenAI, fields: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        oa.chat.completions.create(model=ALPHA, messages=[{"role": "user", "content": "Hi"}], **fields)
    assert refused.value.param == param and refused.value.type == "invalid_request_error"


def test_openai_package_completion_refusals_name_their_field(oa: openai.OpenAI) -> None:
    for fields, param in (({"suffix": "tail"}, "suffix"), ({"best_of": 2}, "best_of"),
                          ({"prompt": ["one", "two"]}, "prompt")):
        with pytest.raises(openai.BadRequestError) as refused:
            oa.completions.create(model=BETA, max_tokens=2, **{"prompt": "x", **fields})
        assert refused.value.param == param


def test_openai_package_lists_both_models_and_gets_404_for_another(oa: openai.OpenAI) -> None:
    listed = oa.models.list().data
    assert sorted(model.id for model in listed) == [ALPHA, BETA] and all(model.created for model in listed)
    with pytest.raises(openai.NotFoundError) as missing:
        oa.chat.completions.create(model="gamma-model", messages=[{"role": "user", "content": "Hi"}])
    assert missing.value.code == "model_not_found" and missing.value.param == "model"


# ----- a client that hangs up ends the node's work ----------------------------------------------------------

def test_a_stream_its_client_closes_is_aborted_on_the_node(world: World) -> None:
    before = _aborted(world.fleet.audit_files())
    body = _chat(ALPHA, stream=True, max_tokens=2000, ignore_eos=True, n=16)
    with httpx.stream("POST", f"{world.proxy_url}/v1/chat/completions", json=body, timeout=120) as events:
        first = next(line for line in events.iter_lines() if line.startswith("data: "))
        assert json.loads(first[len("data: "):])["choices"]
    # Closed after one event. The node audits how the request ended: aborted, not run to its end (the
    # audit writer flushes at least once a second, so the event arrives; the wait bound is generous).
    deadline = time.monotonic() + HANG_S
    while _aborted(world.fleet.audit_files()) == before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _aborted(world.fleet.audit_files()) == before + 1


def _aborted(paths: list[Path]) -> int:
    records = read_audit_files(paths).records
    return sum(1 for r in records if isinstance(r.event, RequestFinished) and r.event.status is RequestStatus.ABORTED)
