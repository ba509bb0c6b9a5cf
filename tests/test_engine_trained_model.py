"""Parity on a trained model: the shipped stories260K (`veil.models`), loaded by `transformers` (fp32) and by
the engine from the same folder.

Random weights hide some bugs: any tokens are as plausible as any others. A trained model writes English
stories, its distributions are peaked, and a story's text holds the leading spaces a SentencePiece tokenizer
drops. Greedy tokens must equal `transformers`' under preemption, chunked prefill, async scheduling, n > 1 and
speculative decoding (n-gram drafts, the model as its own draft, and a draft of its own first layers); seeded
sampling with top-p, top-k and min-p must pick what the engine's own sampling reference picks token by token
(`test_engine_sampling.reference_pick` on `transformers`' logits); and text must read as the tokens decode
after the prompt. The helpers are those of the random-weight tests, reused.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.sampler import SampleRequest
from engine.tokenizer import Tokenizer
from tests.engine_models import (  # noqa: F401 (fixtures)
    ReferenceModel,
    greedy,
    hf_greedy,
    hf_logits,
    one_torch_thread,
    output_tokens,
    trained_model,
)
from tests.test_engine_async_scheduling import TIGHT, assert_clean
from tests.test_engine_async_scheduling import engine as async_engine
from tests.test_engine_parity import SMALL_POOL, record_schedule
from tests.test_engine_sampling import reference_pick
from tests.test_engine_speculative import CROWDED, chunk_recorder

OPENINGS = (
    "Once upon a time",
    "Lily and Ben went to the park. They saw",
    "One day, a little dog named Max",
    "Tom had a red boat.",
    # Longer than a step's budget: prefilled in chunks.
    "The sun was shining and the birds were singing. A little girl named Sue wanted to play outside, but she",
    "Anna found a shiny key under a big tree. She",
    "The cat was hungry.",
    "Once upon a time, there was a big bear who lived in the woods. Every day, the bear",
)
LENGTHS = (40, 24, 31, 12, 30, 18, 9, 27)  # each request fits the small pools alone
# The README's reference story (llama2.c's own greedy output from BOS) begins so.
ONCE_UPON_A_TIME = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park."


@pytest.fixture(scope="module")
def trained() -> ReferenceModel:
    return trained_model()


@pytest.fixture(scope="module")
def prompts(trained: ReferenceModel) -> list[list[int]]:
    tokenizer = Tokenizer(trained.folder)
    return [tokenizer.encode(text) for text in OPENINGS]


@pytest.fixture(scope="module")
def expected(trained: ReferenceModel, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy tokens for each opening."""
    return [hf_greedy(trained.model, prompt, length) for prompt, length in zip(prompts, LENGTHS)]


def assert_equal_tokens(produced: list[list[int]], expected: list[list[int]]) -> None:
    for index, (got, want) in enumerate(zip(produced, expected)):
        assert got == want, f"opening {index} differs from transformers"


def test_the_reference_writes_the_known_story(trained, prompts, expected) -> None:
    """The oracle itself is sound: transformers on the shipped folder writes llama2.c's story."""
    text = Tokenizer(trained.folder).decode(prompts[0] + expected[0])
    assert text.startswith(ONCE_UPON_A_TIME)
    assert max(len(p) for p in prompts) > SMALL_POOL.max_num_batched_tokens  # one prompt is prefilled in chunks


def test_greedy_tokens_match_transformers_under_batching_chunking_and_preemption(trained, prompts, expected) -> None:
    engine = LLMEngine(trained.folder, SMALL_POOL)
    steps = record_schedule(engine)
    assert_equal_tokens(output_tokens(engine, prompts, [greedy(n) for n in LENGTHS]), expected)
    assert engine.scheduler.num_preemptions > 0
    assert any(w.is_partial_prefill for step in steps for w in step), "no prompt was prefilled in chunks"
    assert engine.residue_check() == []


def test_overlapped_greedy_tokens_match_transformers(trained, prompts, expected) -> None:
    llm = async_engine(trained.folder, overlapped=True, **TIGHT)
    assert_equal_tokens(output_tokens(llm, prompts, [greedy(n) for n in LENGTHS]), expected)
    assert llm.async_scheduling and llm.scheduler.num_preemptions > 0
    assert_clean(llm)


def test_every_sample_of_a_greedy_request_matches_transformers(trained, prompts, expected) -> None:
    """n = 3: the samples share the prompt's blocks, copy on write and are preempted apart."""
    engine = LLMEngine(trained.folder, SMALL_POOL)
    outputs = engine.generate(prompts[:4], [greedy(n, n=3) for n in LENGTHS[:4]])
    for output, want in zip(outputs, expected):
        assert [sample.token_ids for sample in output.outputs] == [want] * 3
    assert engine.scheduler.num_preemptions > 0
    assert engine.residue_check() == []


def first_layers_draft(trained: ReferenceModel, folder: Path, layers: int = 2) -> Path:
    """The trained model cut to its first `layers` layers: a draft of the same tokenizer that agrees with it
    often, not always (early exit)."""
    shutil.copytree(trained.folder, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"num_hidden_layers": layers}))
    weights = load_file(folder / "model.safetensors")
    kept = {name: tensor for name, tensor in weights.items()
            if not name.startswith("model.layers.") or int(name.split(".")[2]) < layers}
    save_file(kept, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("drafts", ["ngram", "itself", "first-layers"])
def test_greedy_speculation_matches_transformers(drafts, trained, prompts, expected, tmp_path) -> None:
    speculative = {"ngram": "ngram", "itself": f"draft:{trained.folder}",
                   "first-layers": f"draft:{first_layers_draft(trained, tmp_path / 'draft')}"}[drafts]
    engine = LLMEngine(trained.folder, EngineConfig(**CROWDED, speculative=speculative, num_speculative_tokens=3))
    steps = chunk_recorder(engine)
    assert_equal_tokens(output_tokens(engine, prompts, [greedy(n) for n in LENGTHS]), expected)
    assert engine.scheduler.num_preemptions > 0
    assert any(drafted for step in steps for _, drafted, _ in step)
    stats = engine.speculation
    if drafts == "itself":
        assert stats.drafted > 0 and stats.accepted == stats.drafted
    else:  # stories repeat themselves and a model's first layers guess its next token now and then
        assert 0 < stats.accepted < stats.drafted
    assert engine.residue_check() == []


FILTERED = (
    {"top_p": 0.9}, {"top_k": 8}, {"min_p": 0.1}, {"top_k": 20, "top_p": 0.8, "min_p": 0.05}, {},
)


def sequential_reference(model, prompt: list[int], params: SamplingParams, sample: int = 0) -> list[int]:
    """The sample drawn token by token: transformers' logits for prompt + output so far, then the engine's
    own reference pick (filters, then the seeded draw at that position)."""
    seed = LLMEngine._seed(params, sample)
    output: list[int] = []
    for position in range(params.max_tokens):
        logits = hf_logits(model, prompt + output)[-1]
        output.append(reference_pick(logits, SampleRequest(0, params, seed, position)))
    return output


def test_seeded_filtered_sampling_matches_the_sequential_reference(trained, prompts) -> None:
    chosen = prompts[:len(FILTERED)]
    params = [SamplingParams(max_tokens=16, temperature=0.8, seed=40 + i, n=2 if i == 0 else 1, ignore_eos=True,
                             **filters) for i, filters in enumerate(FILTERED)]
    engine = LLMEngine(trained.folder, SMALL_POOL)
    outputs = engine.generate(chosen, params)
    for prompt, setting, output in zip(chosen, params, outputs):
        for sample in output.outputs:
            assert sample.token_ids == sequential_reference(trained.model, prompt, setting, sample.index)
    greedy_tokens = output_tokens(engine, chosen, [greedy(16)] * len(chosen))
    drawn = [output.outputs[0].token_ids for output in outputs]
    assert drawn != greedy_tokens  # the draws were draws, not the most likely tokens
    assert engine.residue_check() == []


@pytest.mark.parametrize("config", [{}, {"speculative": "ngram", "num_speculative_tokens": 3}], ids=["plain", "ngram"])
def test_text_reads_on_from_the_prompt_as_the_tokens_decode(trained, config) -> None:
    """A story's first word keeps its leading space ("They saw" + " a big box"), a token at a time and, with
    drafts and a stop string, several tokens a step decoded one by one."""
    engine = LLMEngine(trained.folder, EngineConfig(num_blocks=128, block_size=4, **config))
    params = [greedy(n, stop=("never written",)) for n in LENGTHS]
    outputs = engine.generate(list(OPENINGS), params)
    for opening, output in zip(OPENINGS, outputs):
        prompt_ids = engine.tokenizer.encode(opening)
        assert opening + output.outputs[0].text == engine.tokenizer.decode(prompt_ids + output.outputs[0].token_ids)
    assert outputs[1].outputs[0].text.startswith(" a big box")
    if config:
        assert engine.speculation.accepted > 0
