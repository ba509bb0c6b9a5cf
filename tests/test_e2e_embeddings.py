"""`client.embeddings.create` of the real `openai` package through `veil proxy`, to an embedding node."""

from __future__ import annotations

import httpx
import numpy
import openai
import pytest
import torch

from client.errors import ModelTaskError
from client.sdk import Client
from protocol.constants import DIRECTORY_PATH, INFER_PATH
from tests.engine_models import reference_model
from tests.openai_support import openai_client, sdk_and_proxy


@pytest.fixture(scope="module")
def embedding_fleet(tmp_path_factory):
    folder, root = reference_model("qwen3").folder, tmp_path_factory.mktemp("embed")
    with sdk_and_proxy(folder, root, extra_node_args=("--task", "embed", "--pooling", "last")) as (sdk, proxy_url):
        yield sdk, openai_client(proxy_url)


@pytest.fixture(scope="module")
def embedding_client(embedding_fleet):
    return embedding_fleet[1]


def _reference(prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        states = reference_model("qwen3").model(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1]
    return torch.nn.functional.normalize(states[0, -1], dim=0)


def test_float_base64_and_dimensions(embedding_client):
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    floats = embedding_client.embeddings.create(model="hf-qwen3", input=prompts, encoding_format="float")
    assert [item.index for item in floats.data] == [0, 1]
    assert floats.usage.prompt_tokens == 7 and floats.usage.total_tokens == 7
    for prompt, item in zip(prompts, floats.data):
        cosine = torch.nn.functional.cosine_similarity(torch.tensor(item.embedding), _reference(prompt), dim=0)
        assert cosine >= 0.9999
    # The SDK's default asks for base64 and decodes it itself.
    decoded = embedding_client.embeddings.create(model="hf-qwen3", input=prompts)
    assert numpy.allclose(decoded.data[1].embedding, floats.data[1].embedding, atol=1e-6)
    short = embedding_client.embeddings.create(model="hf-qwen3", input="hello there", dimensions=8)
    assert len(short.data[0].embedding) == 8
    assert abs(numpy.linalg.norm(short.data[0].embedding) - 1.0) < 1e-5


def test_fields_are_refused_by_name(embedding_client):
    with pytest.raises(openai.BadRequestError) as refused:
        embedding_client.embeddings.create(model="hf-qwen3", input="hi", dimensions=65)
    assert refused.value.body["param"] == "dimensions"
    with pytest.raises(openai.BadRequestError) as refused:
        embedding_client.embeddings.create(model="hf-qwen3", input="hi", extra_body={"truncate": True})
    assert refused.value.body["param"] == "truncate"
    with pytest.raises(openai.BadRequestError) as refused:
        embedding_client.chat.completions.create(model="hf-qwen3", messages=[{"role": "user", "content": "hi"}])
    assert refused.value.body["param"] == "model"


def test_the_sdk_embeds_and_the_node_lists_its_task(embedding_fleet):
    sdk = embedding_fleet[0]
    answer = sdk.embeddings.create(model="hf-qwen3", input=[[5, 6, 7, 8]], encoding_format="float")
    cosine = torch.nn.functional.cosine_similarity(torch.tensor(answer.data[0].embedding), _reference([5, 6, 7, 8]), dim=0)
    assert cosine >= 0.9999 and answer.receipt is not None
    listing, _ = sdk.request("GET", "/v1/models")
    assert {(m["task"], m["pooling"]) for m in listing["data"]} == {("embed", "last")}


def test_the_directory_and_the_model_list_state_the_embedding_task(embedding_fleet):
    sdk, client = embedding_fleet
    nodes = httpx.get(f"{sdk._http.base_url}{DIRECTORY_PATH}", timeout=60).json()["nodes"]
    assert [(node["models"], node["task"]) for node in nodes] == [(["hf-qwen3"], "embed")]
    assert [(model.id, model.task) for model in sdk.models.list().data] == [("hf-qwen3", "embed")]
    listed = client.models.list().data  # through `veil proxy`: OpenAI's model object, with the task beside it
    assert [(model.id, model.task) for model in listed] == [("hf-qwen3", "embed")]


def test_generation_for_an_embedding_model_is_refused_before_anything_is_sent(embedding_fleet):
    sdk, client = embedding_fleet
    posted: list[str] = []
    http = httpx.Client(base_url=sdk._http.base_url,
                        event_hooks={"request": [lambda request: posted.append(request.url.path)]})
    with Client(str(sdk._http.base_url), policy="dev", http=http) as fresh:
        with pytest.raises(ModelTaskError) as refused:
            fresh.chat.completions.create(model="hf-qwen3", messages=[{"role": "user", "content": "hi"}])
        assert (refused.value.code, refused.value.param) == ("model_not_generation", "model")
        fresh.embeddings.create(model="hf-qwen3", input=[[5, 6]])  # the same client does send embeddings
    assert posted.count(INFER_PATH) == 1
    with pytest.raises(openai.BadRequestError) as proxied:
        client.completions.create(model="hf-qwen3", prompt="hi", max_tokens=2)
    assert proxied.value.body["code"] == "model_not_generation" and proxied.value.body["param"] == "model"
