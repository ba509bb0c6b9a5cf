"""Every field of OpenAI's chat and completions requests, at the node's inner API with a real engine core:
applied (the answer changes as specified), or refused with a 400 in OpenAI's error shape whose `param`
names the field; unknown fields are refused; no message echoes what the request held."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from enclave.api import InnerApi
from enclave.openai_fields import CHAT_ONLY, COMPLETIONS_ONLY, ENGINE_FIELDS, REFUSED
from engine import EngineConfig, Tokenizer
from engine.core_client import EngineCoreClient
from ohttp.bhttp import Request
from tests.engine_models import tiny_model_dir

CANARY = "CANARY-fields-5d1e-OCHRE-LYNX"
MODEL = "tiny"
CHAT = b"/v1/chat/completions"
COMPLETIONS = b"/v1/completions"


@pytest.fixture(scope="module")
def api() -> Iterator[InnerApi]:
    core = EngineCoreClient(tiny_model_dir(), EngineConfig(kv_cache_gib=0.05, device="cpu"))
    core.start()
    yield InnerApi(core, Tokenizer(tiny_model_dir()), MODEL)
    core.stop()


def post(api: InnerApi, path: bytes, body: dict) -> tuple[int, dict | list[dict]]:
    response = api.handle(Request(b"POST", b"https", b"node", path, [], json.dumps(body).encode()))
    if response.streaming:
        events = b"".join(response.events).split(b"\n\n")
        return response.status, [json.loads(e[6:]) for e in events if e.startswith(b"data: {")]
    return response.status, json.loads(response.body)


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": CANARY}], "max_tokens": 3, "seed": 1, **fields}


def completion(**fields) -> dict:
    return {"model": MODEL, "prompt": CANARY, "max_tokens": 3, "seed": 1, **fields}


def refused(api: InnerApi, path: bytes, body: dict, param: str | None, status: int = 400) -> dict:
    got, answer = post(api, path, body)
    assert got == status, answer
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert CANARY not in json.dumps(answer)
    return error


# ----- refused by name ---------------------------------------------------------------------------------

def test_an_unknown_field_is_refused_naming_it(api) -> None:
    for path, body in ((CHAT, chat(bogus_field=1)), (COMPLETIONS, completion(bogus_field=1))):
        error = refused(api, path, body, "bogus_field")
        assert error["code"] == "unknown_parameter" and "bogus_field" in error["message"]


def test_an_unknown_field_whose_name_could_be_content_is_refused_without_showing_it(api) -> None:
    error = refused(api, CHAT, chat(**{CANARY: 1}), None)
    assert error["code"] == "unknown_parameter"


def test_a_field_of_the_other_endpoint_is_refused(api) -> None:
    refused(api, COMPLETIONS, completion(messages=[]), "messages")
    refused(api, CHAT, chat(prompt="x"), "prompt")
    refused(api, CHAT, chat(echo=True), "echo")


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_each_unsupported_openai_field_is_refused_by_name(api, name: str) -> None:
    assert refused(api, CHAT, chat(**{name: {"type": "x"}}), name)["code"] == "unsupported_parameter"


@pytest.mark.parametrize("name, value", [
    ("logit_bias", {"5": 10}), ("presence_penalty", 1.0), ("frequency_penalty", -1.0), ("repetition_penalty", 1.2),
    ("response_format", {"type": "json_object"}), ("guided_json", {"type": "object"}), ("guided_regex", "a+"),
    ("guided_choice", ["a"]), ("guided_grammar", 'start: "a"+'), ("structured_outputs", {"json": {}}),
])
def test_engine_fields_are_applied(api, name: str, value: object) -> None:
    """What each changes is tested in test_enclave_structured and the engine's tests."""
    assert name in ENGINE_FIELDS
    status, answer = post(api, CHAT, chat(**{name: value}))
    assert status == 200, answer


def test_a_gbnf_grammar_is_refused_naming_the_field(api) -> None:
    """guided_grammar is Lark in llguidance's dialect; GBNF does not compile and says so by name."""
    assert refused(api, CHAT, chat(guided_grammar="root ::= 'a'"), "guided_grammar")["code"] == "invalid_structured_output"


@pytest.mark.parametrize("name, value", [
    ("presence_penalty", 5.0), ("frequency_penalty", -2.5), ("repetition_penalty", 0.0), ("repetition_penalty", 3.0),
    ("presence_penalty", "high"), ("parallel_tool_calls", "yes"),
])
def test_engine_fields_out_of_range_are_refused_by_name(api, name: str, value: object) -> None:
    assert refused(api, CHAT, chat(**{name: value}), name)["code"] == "invalid_request"


@pytest.mark.parametrize("name, value", [
    ("store", True), ("metadata", {"k": "v"}), ("service_tier", "priority"), ("modalities", ["text", "audio"]),
    ("user", 5), ("stream", "yes"), ("stream_options", {"include_usage": True, "other": 1}),
    ("max_completion_tokens", 0), ("top_logprobs", 3),
])
def test_chat_values_that_cannot_be_honoured_are_refused_by_name(api, name: str, value: object) -> None:
    body = chat(**{name: value}, stream=True) if name == "stream_options" else chat(**{name: value})
    refused(api, CHAT, body, name)


@pytest.mark.parametrize("fields, param", [
    ({"suffix": "tail"}, "suffix"), ({"best_of": 3}, "best_of"), ({"best_of": 1, "n": 2}, "best_of"),
    ({"echo": True, "logprobs": 1}, "echo"), ({"prompt": ["one", "two"]}, "prompt"),
    ({"prompt": [[1, 2], [3]]}, "prompt"), ({"prompt": {"text": CANARY}}, "prompt"), ({"echo": "yes"}, "echo"),
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"n": 0}, "n"), ({"max_tokens": 10**9}, "max_tokens"),
])
def test_completion_values_that_cannot_be_honoured_are_refused_by_name(api, fields: dict, param: str) -> None:
    refused(api, COMPLETIONS, completion(**fields), param)


def test_max_tokens_and_its_alias_given_different_are_refused(api) -> None:
    refused(api, CHAT, chat(max_tokens=3, max_completion_tokens=4), "max_completion_tokens")


def test_an_unknown_model_is_a_404_naming_the_model_field(api) -> None:
    got, answer = post(api, CHAT, chat(model="other-model"))
    assert got == 404 and answer["error"]["param"] == "model" and answer["error"]["type"] == "invalid_request_error"


def test_a_wrong_path_and_method_are_answered_in_openais_shape(api) -> None:
    response = api.handle(Request(b"GET", b"https", b"node", CHAT, [], b""))
    assert response.status == 405 and set(json.loads(response.body)["error"]) == {"message", "type", "param", "code"}
    response = api.handle(Request(b"GET", b"https", b"node", b"/v1/nope", [], b""))
    assert response.status == 404 and json.loads(response.body)["error"]["type"] == "invalid_request_error"


# ----- applied -------------------------------------------------------------------------------------------

def test_every_field_the_node_knows_is_either_applied_or_refused_and_none_is_both() -> None:
    assert not (CHAT_ONLY | COMPLETIONS_ONLY) & (set(REFUSED) | ENGINE_FIELDS)
    assert not set(REFUSED) & ENGINE_FIELDS


def test_max_completion_tokens_bounds_the_answer_as_max_tokens_does(api) -> None:
    base = chat(temperature=0, ignore_eos=True)
    del base["max_tokens"]
    _, alias = post(api, CHAT, {**base, "max_completion_tokens": 3})
    _, plain = post(api, CHAT, {**base, "max_tokens": 3})
    _, both = post(api, CHAT, {**base, "max_tokens": 3, "max_completion_tokens": 3})
    assert alias["usage"]["completion_tokens"] == 3
    assert alias["choices"][0]["message"] == plain["choices"][0]["message"] == both["choices"][0]["message"]
    _, longer = post(api, CHAT, {**base, "max_completion_tokens": 6})
    assert longer["usage"]["completion_tokens"] == 6


def test_echo_puts_the_prompt_before_each_completion_whole_and_streamed(api) -> None:
    base = completion(prompt="once upon a time", temperature=0, ignore_eos=True, n=2)
    _, plain = post(api, COMPLETIONS, base)
    _, echoed = post(api, COMPLETIONS, {**base, "echo": True})
    for without, with_echo in zip(plain["choices"], echoed["choices"], strict=True):
        assert with_echo["text"] == "once upon a time" + without["text"]
    _, chunks = post(api, COMPLETIONS, {**base, "echo": True, "stream": True})
    for index in (0, 1):
        streamed = "".join(c["choices"][0]["text"] for c in chunks if c["choices"] and c["choices"][0]["index"] == index)
        assert streamed == echoed["choices"][index]["text"]


def test_echo_of_a_token_id_prompt_is_its_text(api) -> None:
    ids = api.tokenizer.encode("once upon a time", add_special_tokens=False)
    _, echoed = post(api, COMPLETIONS, completion(prompt=ids, echo=True, temperature=0))
    _, plain = post(api, COMPLETIONS, completion(prompt=ids, temperature=0))
    assert echoed["choices"][0]["text"] == api.tokenizer.decode(ids, skip_special_tokens=False) + plain["choices"][0]["text"]


def test_a_list_of_one_prompt_is_that_prompt(api) -> None:
    ids = api.tokenizer.encode("once upon", add_special_tokens=False)
    _, text = post(api, COMPLETIONS, completion(prompt="once upon", temperature=0))
    _, listed = post(api, COMPLETIONS, completion(prompt=["once upon"], temperature=0))
    _, id_list = post(api, COMPLETIONS, completion(prompt=[ids], temperature=0))
    _, id_plain = post(api, COMPLETIONS, completion(prompt=ids, temperature=0))
    assert text["choices"][0]["text"] == listed["choices"][0]["text"]
    assert id_list["choices"][0]["text"] == id_plain["choices"][0]["text"]


def test_best_of_equal_to_n_draws_n_samples(api) -> None:
    got, answer = post(api, COMPLETIONS, completion(n=2, best_of=2))
    assert got == 200 and len(answer["choices"]) == 2


def test_fields_that_change_nothing_are_accepted_and_the_answer_is_the_same(api) -> None:
    _, plain = post(api, CHAT, chat(temperature=0))
    inert = {"user": CANARY, "safety_identifier": "app-user-1", "store": False, "metadata": {},
             "service_tier": "auto", "modalities": ["text"], "presence_penalty": 0, "frequency_penalty": 0.0,
             "repetition_penalty": 1.0, "logit_bias": {}, "tools": [], "tool_choice": "none",
             "parallel_tool_calls": True, "response_format": {"type": "text"}, "functions": None}
    got, answer = post(api, CHAT, chat(temperature=0, **inert))
    assert got == 200 and answer["choices"] == plain["choices"]


def test_null_stands_for_a_field_left_out(api) -> None:
    _, plain = post(api, COMPLETIONS, completion(temperature=0))
    nulls = {"stream": None, "echo": None, "ignore_eos": None, "best_of": None, "suffix": None, "user": None,
             "stream_options": None, "logprobs": None, "stop": None}
    got, answer = post(api, COMPLETIONS, completion(temperature=0, **nulls))
    assert got == 200 and answer["choices"] == plain["choices"]


def test_the_model_list_says_when_the_node_began_serving(api) -> None:
    response = api.handle(Request(b"GET", b"https", b"node", b"/v1/models", [], b""))
    [model] = json.loads(response.body)["data"]
    assert model["id"] == MODEL and isinstance(model["created"], int) and model["created"] > 1_700_000_000
