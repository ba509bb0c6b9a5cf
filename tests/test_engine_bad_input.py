"""Bad input fails only its own request, with a clear error that never echoes prompt text or token ids."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from engine import (
    EngineConfig,
    EngineError,
    LLMEngine,
    ModelLoadError,
    RequestRejected,
    SamplingParams,
    UnknownRequestError,
)
from engine.config import SUPPORTED_ARCHITECTURES
from tests.engine_models import (  # noqa: F401 (fixtures)
    SMALL_VOCAB,
    VOCAB_SIZE,
    greedy,
    one_torch_thread,
    output_tokens,
    random_prompts,
    reference_model,
    save_with_tokenizer,
    small_vocab_model_dir,
    tiny_model_dir,
)

CANARY_TEXT = "CANARY-zebra-7781"
CANARY_ID = 413  # an in-vocabulary id that is no size or limit the messages could name
POOL = EngineConfig(num_blocks=16, block_size=4)  # 64 token slots
CONTEXT = 2048  # the tiny model's max_position_embeddings

GOOD_PROMPTS = random_prompts(2, 5, 9, seed=31)
GOOD_PARAMS = [greedy(12), greedy(7)]


@pytest.fixture(scope="module")
def expected_good_outputs() -> list[list[int]]:
    return output_tokens(LLMEngine(tiny_model_dir(), POOL), GOOD_PROMPTS, GOOD_PARAMS)


def finish_and_collect(engine: LLMEngine, request_ids: list[str], earlier: list | None = None) -> list[list[int]]:
    tokens: dict[str, list[int]] = {rid: [] for rid in request_ids}
    for delta in list(earlier or []) + list(engine.stream()):
        tokens.setdefault(delta.request_id, []).extend(delta.token_ids)
    assert set(tokens) == set(request_ids), "a rejected request produced output"
    assert engine.residue_check() == []
    return [tokens[rid] for rid in request_ids]


def assert_clean_message(error: Exception, *canaries: str) -> None:
    message = str(error)
    assert message, "the error says nothing"
    for canary in (CANARY_TEXT, str(CANARY_ID), *canaries):
        assert canary not in message


def rejected(engine: LLMEngine, prompt, params: SamplingParams | None = None, request_id: str | None = None) -> RequestRejected:
    with pytest.raises(RequestRejected) as raised:
        engine.add_request(prompt, params, request_id=request_id)
    return raised.value


def serving_continues(engine: LLMEngine, ids: list[str], expected: list[list[int]], earlier: list) -> None:
    assert finish_and_collect(engine, ids, earlier) == expected
    assert not engine.has_unfinished()


@pytest.fixture
def serving_with_deltas() -> tuple[LLMEngine, list[str], list]:
    """An engine part way through two good requests, and the deltas they produced so far."""
    engine = LLMEngine(tiny_model_dir(), POOL)
    ids = [engine.add_request(p, sp, request_id=f"good-{i}") for i, (p, sp) in enumerate(zip(GOOD_PROMPTS, GOOD_PARAMS))]
    earlier = engine.step() + engine.step()
    return engine, ids, earlier


# ----- prompts and lengths ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "params", "reason"),
    [
        pytest.param(f"{CANARY_TEXT} " * 600, greedy(1), "prompt_too_long", id="text-prompt-over-context"),
        pytest.param([CANARY_ID] * CONTEXT, greedy(1), "prompt_too_long", id="id-prompt-at-context"),
        pytest.param([CANARY_ID] * 10, greedy(CONTEXT - 9), "max_tokens_too_large", id="max-tokens-past-context"),
        pytest.param([CANARY_ID] * 10, greedy(55), "exceeds_kv_pool", id="never-fits-kv-pool"),
        pytest.param("", greedy(4), "empty_prompt", id="empty-text"),
        pytest.param([], greedy(4), "empty_prompt", id="empty-ids"),
        pytest.param([CANARY_ID, VOCAB_SIZE], greedy(4), "invalid_token", id="id-at-vocab-size"),
        pytest.param([-1, CANARY_ID], greedy(4), "invalid_token", id="negative-id"),
        pytest.param([CANARY_ID, 4_242_424], greedy(4), "invalid_token", id="huge-id"),
        # Never coerced to another prompt: 6.7 is not token 6, True is not token 1.
        pytest.param([CANARY_ID, 6.7, 7], greedy(4), "invalid_token", id="float-id"),
        pytest.param([CANARY_ID, 7.0], greedy(4), "invalid_token", id="integral-float-id"),
        pytest.param([CANARY_ID, True, 7], greedy(4), "invalid_token", id="bool-id"),
        pytest.param([CANARY_ID, "6", 7], greedy(4), "invalid_token", id="string-id"),
        pytest.param([CANARY_ID, None], greedy(4), "invalid_token", id="none-id"),
        pytest.param([CANARY_ID, [7]], greedy(4), "invalid_token", id="nested-id"),
        pytest.param(None, greedy(4), "invalid_prompt", id="no-prompt"),
        pytest.param(b"CANARY", greedy(4), "invalid_prompt", id="bytes-prompt"),
        pytest.param({CANARY_ID: 1}, greedy(4), "invalid_prompt", id="mapping-prompt"),
    ],
)
def test_bad_prompt_fails_only_its_request(serving_with_deltas, expected_good_outputs, prompt, params, reason):
    engine, ids, earlier = serving_with_deltas
    error = rejected(engine, prompt, params, request_id="bad-canary-request")
    assert error.reason == reason
    assert_clean_message(error, "4242424", "bad-canary-request")
    with pytest.raises(UnknownRequestError):
        engine.abort("bad-canary-request")  # nothing of it was kept
    serving_continues(engine, ids, expected_good_outputs, earlier)


def test_largest_request_that_fits_is_accepted():
    """The limits are exact: one token less than each rejected case above is served."""
    engine = LLMEngine(tiny_model_dir(), POOL)
    engine.add_request([CANARY_ID] * 10, greedy(54))  # 64 tokens: exactly the pool
    outputs = [d for d in engine.stream()]
    assert sum(len(d.token_ids) for d in outputs) == 54
    big = LLMEngine(tiny_model_dir(), EngineConfig(num_blocks=600, block_size=4))
    big.add_request([CANARY_ID] * (CONTEXT - 1), greedy(1))  # the longest prompt the context allows
    assert [len(d.token_ids) for d in big.stream()] == [1]


# ----- sampling settings --------------------------------------------------------------------

INVALID_SAMPLING = {
    "max_tokens=0": {"max_tokens": 0},
    "max_tokens<0": {"max_tokens": -5},
    "max_tokens float": {"max_tokens": 2.5},
    "temperature<0": {"temperature": -0.1},
    "temperature>100": {"temperature": 101.0},
    "temperature nan": {"temperature": float("nan")},
    "top_k<0": {"top_k": -1},
    "top_k float": {"top_k": 2.5},
    "top_p=0": {"top_p": 0.0},
    "top_p>1": {"top_p": 1.1},
    "top_p nan": {"top_p": float("nan")},
    "min_p<0": {"min_p": -0.1},
    "min_p>1": {"min_p": 1.5},
    "n=0": {"n": 0},
    "n>16": {"n": 17},
    "seed<0": {"seed": -1},
    "seed>=2^63": {"seed": 2**63},
    "too many stops": {"stop": tuple(f"s{i}" for i in range(9))},
    "empty stop": {"stop": ("",)},
    "long stop": {"stop": ("x" * 257,)},
    "stop id at vocab": {"stop_token_ids": (VOCAB_SIZE,)},
    "stop id negative": {"stop_token_ids": (-1,)},
    "stop id float": {"stop_token_ids": (6.7,)},
    "stop id bool": {"stop_token_ids": (True,)},
    "stop id str": {"stop_token_ids": ("6",)},
    "stop id None": {"stop_token_ids": (None,)},
    "stop ids bare int": {"stop_token_ids": 6},
    "logprobs<0": {"logprobs": -1},
    "logprobs>20": {"logprobs": 21},
}

# Settings of the wrong type, as a caller decoding JSON might pass them on.
WRONG_TYPES = {
    "temperature str": {"temperature": "hot"},
    "top_p None": {"top_p": None},
    "min_p str": {"min_p": "0.1"},
    "stop bare string": {"stop": "abc"},
    "stop None entry": {"stop": ("a", None)},
}


@pytest.mark.parametrize("settings", INVALID_SAMPLING.values(), ids=INVALID_SAMPLING.keys())
def test_invalid_sampling_value_fails_only_its_request(serving_with_deltas, expected_good_outputs, settings):
    engine, ids, earlier = serving_with_deltas
    error = rejected(engine, [CANARY_ID] * 4, SamplingParams(**settings))
    assert error.reason == "invalid_sampling"
    field = next(iter(settings)).split("=")[0]
    assert field.removesuffix("_ids") in str(error) or field in str(error)
    assert_clean_message(error)
    serving_continues(engine, ids, expected_good_outputs, earlier)


@pytest.mark.parametrize("settings", WRONG_TYPES.values(), ids=WRONG_TYPES.keys())
def test_sampling_value_of_the_wrong_type_is_rejected_not_crashed(serving_with_deltas, expected_good_outputs, settings):
    engine, ids, earlier = serving_with_deltas
    error = rejected(engine, [CANARY_ID] * 4, SamplingParams(**settings))
    assert error.reason == "invalid_sampling"
    assert next(iter(settings)) in str(error)
    serving_continues(engine, ids, expected_good_outputs, earlier)


def test_logprobs_above_the_vocabulary_fail_only_their_request_and_up_to_it_are_served():
    engine = LLMEngine(small_vocab_model_dir(), POOL)
    good = engine.add_request([5, 6, 7, 8], greedy(6))
    widest = engine.add_request([9, 10, 11], greedy(4, logprobs=SMALL_VOCAB))

    error = rejected(engine, [5, 6, 7], greedy(4, logprobs=SMALL_VOCAB + 1))
    deltas = list(engine.stream())

    assert error.reason == "invalid_sampling"
    assert f"logprobs must be an integer between 0 and {SMALL_VOCAB}" in str(error)
    assert [len(p.top) for d in deltas if d.request_id == widest for p in d.logprobs] == [SMALL_VOCAB] * 4
    expected = output_tokens(LLMEngine(small_vocab_model_dir(), POOL), [[5, 6, 7, 8]], greedy(6))[0]
    assert [t for d in deltas if d.request_id == good for t in d.token_ids] == expected
    assert {d.request_id for d in deltas} == {good, widest} and engine.residue_check() == []


# ----- request ids --------------------------------------------------------------------------


def test_duplicate_request_id_fails_only_the_second(serving_with_deltas, expected_good_outputs):
    engine, ids, earlier = serving_with_deltas
    error = rejected(engine, [CANARY_ID] * 4, greedy(3), request_id=ids[0])
    assert error.reason == "duplicate_request_id"
    assert_clean_message(error, ids[0])
    serving_continues(engine, ids, expected_good_outputs, earlier)


@pytest.mark.parametrize("request_id", ["", "x" * 129, "line\nbreak"], ids=["empty", "too-long", "unprintable"])
def test_malformed_request_id_is_rejected(request_id):
    engine = LLMEngine(tiny_model_dir(), POOL)
    error = rejected(engine, [CANARY_ID] * 4, greedy(3), request_id=request_id)
    assert error.reason == "invalid_request_id"
    assert not engine.has_unfinished()


def test_finished_request_id_can_be_reused():
    engine = LLMEngine(tiny_model_dir(), POOL)
    engine.add_request([CANARY_ID] * 4, greedy(2), request_id="again")
    first = [t for d in engine.stream() for t in d.token_ids]
    engine.add_request([CANARY_ID] * 4, greedy(2), request_id="again")
    assert [t for d in engine.stream() for t in d.token_ids] == first


# ----- engine settings ----------------------------------------------------------------------

SIZES = ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_blocks")


@pytest.mark.parametrize("value", [0, -1, 2.5, True], ids=["zero", "negative", "float", "bool"])
@pytest.mark.parametrize("name", SIZES)
def test_an_engine_size_below_one_is_refused_by_name_not_taken_for_unset(name, value):
    with pytest.raises(EngineError) as raised:
        EngineConfig(**{name: value})
    assert str(raised.value).startswith(f"{name} must be an integer >= 1")


def test_the_smallest_sizes_serve(expected_good_outputs):
    smallest = EngineConfig(block_size=1, max_num_seqs=1, max_num_batched_tokens=1, num_blocks=32, max_model_len=32)
    assert output_tokens(LLMEngine(tiny_model_dir(), smallest), GOOD_PROMPTS, GOOD_PARAMS) == expected_good_outputs


# ----- model folders ------------------------------------------------------------------------


def copy_of_tiny(tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_model_dir(), tmp_path / "model"))


def load_error(folder: Path) -> ModelLoadError:
    with pytest.raises(ModelLoadError) as raised:
        LLMEngine(folder, POOL)
    return raised.value


def edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def test_unknown_architecture_error_names_the_supported_ones(tmp_path):
    folder = copy_of_tiny(tmp_path)
    edit_config(folder, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    message = str(load_error(folder))
    assert "GPT2LMHeadModel" in message
    for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert name in message
    assert set(SUPPORTED_ARCHITECTURES) == {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}


@pytest.mark.parametrize(
    ("missing", "named"),
    [("config.json", "config.json"), ("model.safetensors", "safetensors"), ("tokenizer.json", "tokenizer.json")],
)
def test_missing_file_in_the_model_folder(tmp_path, missing, named):
    folder = copy_of_tiny(tmp_path)
    (folder / missing).unlink()
    assert named in str(load_error(folder))


def test_missing_model_folder(tmp_path):
    assert "config.json" in str(load_error(tmp_path / "nowhere"))


def test_missing_shard_listed_in_the_index(tmp_path):
    folder = save_with_tokenizer(reference_model("llama").model, tmp_path / "sharded", max_shard_size="100KB")
    shards = sorted(folder.glob("model-*.safetensors"))
    shards[-1].unlink()
    assert shards[-1].name in str(load_error(folder))


@pytest.mark.parametrize("broken", ["config.json", "model.safetensors.index.json", "generation_config.json"])
def test_malformed_json_in_the_model_folder(tmp_path, broken):
    folder = copy_of_tiny(tmp_path)
    if broken == "model.safetensors.index.json":
        (folder / broken).write_text('{"metadata": {}}')
    else:
        (folder / broken).write_text("{ not json")
    assert broken in str(load_error(folder))


def test_corrupt_weights_file(tmp_path):
    folder = copy_of_tiny(tmp_path)
    (folder / "model.safetensors").write_bytes(b"\x00" * 64)
    assert "model.safetensors" in str(load_error(folder))


def test_weights_that_do_not_match_the_config(tmp_path):
    folder = copy_of_tiny(tmp_path)
    edit_config(folder, intermediate_size=200)
    assert "shape" in str(load_error(folder))


def test_missing_weight_tensor(tmp_path):
    folder = copy_of_tiny(tmp_path)
    weights = load_file(folder / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, folder / "model.safetensors")
    message = str(load_error(folder))
    assert "1 missing" in message and "model.layers.1.mlp.up_proj.weight" in message


def test_unsupported_dtype_is_a_load_error():
    with pytest.raises(ModelLoadError):
        LLMEngine(tiny_model_dir(), EngineConfig(num_blocks=8, dtype="int8"))


def test_every_engine_error_shares_one_base():
    assert issubclass(ModelLoadError, EngineError)
    assert issubclass(RequestRejected, EngineError)
    assert issubclass(UnknownRequestError, EngineError)


def test_mistral_and_qwen2_configs_load_as_their_families(tmp_path):
    """Architectures listed as supported really load (Mistral shares Llama's layout)."""
    folder = copy_of_tiny(tmp_path)
    edit_config(folder, architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=None)
    engine = LLMEngine(folder, POOL)
    assert engine.model_config.family == "mistral"
    assert output_tokens(engine, GOOD_PROMPTS[:1], GOOD_PARAMS[:1]) == output_tokens(
        LLMEngine(tiny_model_dir(), POOL), GOOD_PROMPTS[:1], GOOD_PARAMS[:1]
    )


@pytest.mark.parametrize("activation", ["gelu_pytorch_tanh", "relu"])
def test_an_activation_the_decoder_does_not_compute_is_a_load_error(tmp_path, activation):
    """The weights fit the layout, so only the activation check stands between this and SiLU run silently."""
    folder = copy_of_tiny(tmp_path)
    edit_config(folder, hidden_act=activation)
    message = str(load_error(folder))
    assert activation in message and "hidden_act" in message


@pytest.mark.parametrize(("prompt_len", "max_tokens", "reason"), [(40, 1, "prompt_too_long"), (20, 20, "max_tokens_too_large")])
def test_a_context_capped_by_the_sliding_window_says_so(tmp_path, prompt_len, max_tokens, reason):
    folder = copy_of_tiny(tmp_path)
    edit_config(folder, architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=32)
    engine = LLMEngine(folder, POOL)
    assert engine.max_model_len == 32
    error = rejected(engine, [CANARY_ID] * prompt_len, greedy(max_tokens))
    assert error.reason == reason
    assert "sliding window of 32 tokens" in str(error)
    assert_clean_message(error)
    engine.add_request([CANARY_ID] * 20, greedy(12))  # exactly the window: served
    assert sum(len(d.token_ids) for d in engine.stream()) == 12
