"""The fields of OpenAI's embeddings request at an embedding node's inner API, with a real engine core and no
fleet: each bad value is refused with a 400 in OpenAI's error shape whose `param` names the field, and no
message echoes what the request held; the same call with the field put right is served."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from enclave.api import InnerApi
from enclave.embeddings import MAX_INPUTS
from engine import EngineConfig, PoolingKind, Tokenizer
from engine.core_client import EngineCoreClient
from tests.engine_models import tiny_model_dir
from tests.test_enclave_fields import CANARY, MODEL, post, refused

EMBEDDINGS = b"/v1/embeddings"


@pytest.fixture(scope="module")
def api() -> Iterator[InnerApi]:
    core = EngineCoreClient(tiny_model_dir(), EngineConfig(kv_cache_gib=0.05, device="cpu"))
    core.start()
    yield InnerApi(core, Tokenizer(tiny_model_dir()), MODEL, pooling=PoolingKind.MEAN)
    core.stop()


def vocab_size() -> int:
    return int(json.loads((tiny_model_dir() / "config.json").read_text())["vocab_size"])


def embeddings(**fields) -> dict:
    return {"model": MODEL, "input": [CANARY, [5, 6, 7]], **fields}


def test_a_well_formed_call_is_served(api) -> None:
    status, answer = post(api, EMBEDDINGS, embeddings(user="end-user-7", encoding_format="base64"))
    assert status == 200, answer
    assert [item["index"] for item in answer["data"]] == [0, 1]
    assert all(isinstance(item["embedding"], str) for item in answer["data"])


def test_a_user_that_is_not_a_string_is_refused_by_name(api) -> None:
    assert refused(api, EMBEDDINGS, embeddings(user=7), "user")["code"] == "invalid_type"
    refused(api, EMBEDDINGS, embeddings(user={"id": CANARY}), "user")


def test_more_inputs_than_the_limit_are_refused_by_name(api) -> None:
    error = refused(api, EMBEDDINGS, embeddings(input=[[5]] * (MAX_INPUTS + 1)), "input")
    assert error["code"] == "too_many_inputs" and str(MAX_INPUTS) in error["message"]
    status, _ = post(api, EMBEDDINGS, embeddings(input=[[5]] * 3))  # the same shape within the limit is served
    assert status == 200


@pytest.mark.parametrize("value", ["int8", "FLOAT", 1, ["float"]])
def test_an_encoding_format_other_than_float_or_base64_is_refused_by_name(api, value: object) -> None:
    refused(api, EMBEDDINGS, embeddings(encoding_format=value), "encoding_format")


@pytest.mark.parametrize("value", [[], "", [[]], [""], [CANARY, []], None, 7])
def test_an_empty_or_malformed_input_is_refused_by_name(api, value: object) -> None:
    refused(api, EMBEDDINGS, embeddings(input=value), "input")


@pytest.mark.parametrize("token", [-1, "vocab_size", "vocab_size+1000", 1.5, True])
def test_a_token_id_outside_the_vocabulary_is_refused_by_name(api, token: object) -> None:
    if isinstance(token, str):  # past the end of the vocabulary, which is known once the model is written
        token = vocab_size() + (1000 if token.endswith("+1000") else 0)
    refused(api, EMBEDDINGS, embeddings(input=[[5, 6], [5, token]]), "input")
    status, _ = post(api, EMBEDDINGS, embeddings(input=[[5, 6], [5, vocab_size() - 1]]))  # the last id is in it
    assert status == 200


def test_dimensions_outside_the_model_are_refused_by_name(api) -> None:
    refused(api, EMBEDDINGS, embeddings(dimensions=0), "dimensions")
    refused(api, EMBEDDINGS, embeddings(dimensions=10**6), "dimensions")
