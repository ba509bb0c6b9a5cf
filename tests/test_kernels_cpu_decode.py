"""The compiled CPU decode forward (`kernels.cpu_decode`): one sequence's one new token, bf16, all layers in C.

Oracles: `transformers` in bf16 on the same weights (the logits at the new token's position, within bf16's
rounding, and its greedy choice wherever that is decisive), and the eager forward (`force("reference")`),
which must leave every other byte of the KV cache as the compiled forward leaves it. Every model family the
engine loads is run, and one whose widths are not multiples of the kernel's vector and row blocks.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

import kernels
from engine import EngineConfig, LLMEngine
from engine.scheduler import ScheduledChunk
from engine.sequence import Sequence
from kernels import cpu_decode
from tests.engine_models import (  # noqa: F401 (fixtures)
    MORE_REFERENCE_NAMES,
    REFERENCE_NAMES,
    build_hf_model,
    greedy,
    hf_logits,
    one_torch_thread,
    output_tokens,
    random_prompts,
    save_with_tokenizer,
    trained_model,
)

pytestmark = pytest.mark.skipif(not cpu_decode.supported_cpu(), reason="the compiled decode needs AVX-512 BF16")

BF16_LOGIT_ATOL = 0.25  # as tests/test_engine_compute_dtype.py: both sides round each layer to bf16
PROMPTS = 8
BLOCK_SIZE = 4  # prompts span several blocks, so attention reads pages through the block table
ODD = "odd-widths"  # widths that leave tails: 70 = 2 * 32 + 6 inputs, 98 and 70 rows (not multiples of 8)


@functools.cache
def bf16_model(name: str, root: str):
    """A bf16 `transformers` model of family `name` and its folder (as a user's bf16 checkpoint)."""
    from pathlib import Path

    if name == ODD:
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=build_hf_model("llama").config.vocab_size, hidden_size=70,
                             intermediate_size=100, num_hidden_layers=2, num_attention_heads=5,
                             num_key_value_heads=1, max_position_embeddings=512, initializer_range=0.2)
        model = LlamaForCausalLM(config).eval().to(torch.bfloat16)
    else:
        model = build_hf_model(name, torch.bfloat16)
    folder = save_with_tokenizer(model, Path(root) / name)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval(), folder


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("cpu-decode"))


def bf16_engine(folder) -> LLMEngine:
    engine = LLMEngine(folder, EngineConfig(num_blocks=64, block_size=BLOCK_SIZE, dtype="bfloat16"))
    assert engine.runner.kv_cache.dtype == torch.bfloat16
    return engine


def decode_inputs(engine: LLMEngine, prompt: list[int]):
    """The step inputs of `prompt`'s last token as a decode step, its earlier tokens prefilled (eagerly)."""
    seq = Sequence(seq_id=1, request_id="decode", sample_index=0, prompt_token_ids=list(prompt),
                   params=greedy(1), seed=None, max_tokens=1)
    engine.block_manager.reserve(seq, len(prompt))
    inputs = engine.runner.prepare([ScheduledChunk(seq, len(prompt) - 1)])
    with torch.inference_mode(), kernels.force("reference"):
        engine.runner.model(inputs.input_ids, inputs.positions, engine.runner.kv_cache, inputs.meta)
    seq.num_computed_tokens = len(prompt) - 1
    return seq, engine.runner.prepare([ScheduledChunk(seq, 1)])


def release(engine: LLMEngine, seq: Sequence) -> None:
    engine.block_manager.free(seq)
    engine.block_manager.scrub_freed()


def run(engine: LLMEngine, inputs, kv_cache: torch.Tensor, backend: str) -> torch.Tensor:
    with torch.inference_mode(), kernels.force(backend):
        return engine.runner.model(inputs.input_ids, inputs.positions, kv_cache, inputs.meta)


def spy_on_native(monkeypatch) -> list[bool]:
    """Notes the compiled forward's runs (they still run): each whether it ran the output head too."""
    calls: list[bool] = []
    real = cpu_decode.forward

    def counted(*args, **kwargs):
        calls.append(bool(kwargs.get("logits")))
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu_decode, "forward", counted)
    return calls


@pytest.mark.parametrize("name", [*REFERENCE_NAMES, *MORE_REFERENCE_NAMES, ODD])
def test_the_compiled_decode_matches_transformers_and_the_eager_forward(name, root, monkeypatch) -> None:
    model, folder = bf16_model(name, root)
    engine = bf16_engine(folder)
    calls = spy_on_native(monkeypatch)
    decisive = 0
    for prompt in random_prompts(PROMPTS, 6, 23, seed=11):
        seq, inputs = decode_inputs(engine, prompt)
        eager_cache = engine.runner.kv_cache.clone()
        eager = engine.runner.model.compute_logits(run(engine, inputs, eager_cache, "reference"))
        native = engine.runner.model.compute_logits(run(engine, inputs, engine.runner.kv_cache, "native"))
        expected = hf_logits(model, prompt)[-1:]
        torch.testing.assert_close(native, expected, atol=BF16_LOGIT_ATOL, rtol=0)
        torch.testing.assert_close(native, eager, atol=BF16_LOGIT_ATOL, rtol=0)
        top_two = expected.topk(2, dim=-1).values[0]
        if top_two[0] - top_two[1] > 2 * BF16_LOGIT_ATOL:
            assert native.argmax() == expected.argmax()
            decisive += 1
        # The new token's K and V went to its slot in every layer, close to the eager forward's; nothing else moved.
        slot = int(inputs.meta.slot_mapping[0])
        flat = (engine.runner.kv_cache.flatten(1, 2), eager_cache.flatten(1, 2))
        torch.testing.assert_close(flat[0][:, slot].float(), flat[1][:, slot].float(), atol=0.05, rtol=0.02)
        others = torch.ones(flat[0].shape[1], dtype=torch.bool)
        others[slot] = False
        assert torch.equal(flat[0][:, others], flat[1][:, others])
        release(engine, seq)
    assert len(calls) == PROMPTS and decisive >= 1
    assert engine.residue_check() == []


def test_the_compiled_decode_gives_the_same_bits_on_one_thread_and_two(root) -> None:
    """Each product row and each head is summed by one thread in a fixed order: threads change only the speed."""
    _, folder = bf16_model("llama", root)
    engine = bf16_engine(folder)
    _, inputs = decode_inputs(engine, random_prompts(1, 17, 17, seed=3)[0])
    before = engine.runner.kv_cache.clone()
    results = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        cache = before.clone()
        results.append((run(engine, inputs, cache, "native"), cache))
    torch.set_num_threads(1)
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def decode_logits(engine: LLMEngine, inputs, kv_cache: torch.Tensor, backend: str = "native") -> torch.Tensor | None:
    with torch.inference_mode(), kernels.force(backend):
        return engine.runner.model.decode_logits(inputs.input_ids, inputs.positions, kv_cache, inputs.meta)


@pytest.mark.parametrize("name", [*REFERENCE_NAMES, ODD])
def test_the_head_in_the_same_call_gives_the_bits_of_the_forward_then_the_head(name, root) -> None:
    """`decode_logits` runs the output head inside the compiled forward: the same float32 logits, bit for bit,
    as `compute_logits` of the hidden state the forward hands back, and the same cache, on 1 and 2 threads."""
    _, folder = bf16_model(name, root)
    engine = bf16_engine(folder)
    for prompt in random_prompts(3, 6, 23, seed=12):
        seq, inputs = decode_inputs(engine, prompt)
        before = engine.runner.kv_cache.clone()
        apart = engine.runner.model.compute_logits(run(engine, inputs, engine.runner.kv_cache, "native"))
        for threads in (1, 2):
            torch.set_num_threads(threads)
            cache = before.clone()
            fused = decode_logits(engine, inputs, cache)
            assert fused.dtype == torch.float32 and fused.shape == apart.shape
            assert torch.equal(fused, apart) and torch.equal(cache, engine.runner.kv_cache)
        torch.set_num_threads(1)
        release(engine, seq)
    assert engine.residue_check() == []


def test_the_head_in_the_same_call_runs_nothing_where_the_compiled_decode_does_not_run(root) -> None:
    """None, and the cache untouched, wherever `forward` runs eagerly (the eager backend, a prompt's several
    tokens, a float32 model): then the runner runs the forward and the head apart."""
    _, folder = bf16_model("llama", root)
    prompt = random_prompts(1, 9, 9, seed=13)[0]
    engine = bf16_engine(folder)
    seq, one_token = decode_inputs(engine, prompt)
    prefill = Sequence(seq_id=2, request_id="prefill", sample_index=0, prompt_token_ids=list(prompt),
                       params=greedy(1), seed=None, max_tokens=1)
    engine.block_manager.reserve(prefill, len(prompt))
    several_tokens = engine.runner.prepare([ScheduledChunk(prefill, len(prompt))])
    before = engine.runner.kv_cache.clone()
    assert decode_logits(engine, one_token, engine.runner.kv_cache, "reference") is None
    assert decode_logits(engine, several_tokens, engine.runner.kv_cache) is None
    assert torch.equal(engine.runner.kv_cache, before)
    release(engine, seq)
    release(engine, prefill)
    fp32 = LLMEngine(folder, EngineConfig(num_blocks=64, block_size=BLOCK_SIZE, dtype="float32"))
    seq, one_token = decode_inputs(fp32, prompt)
    before = fp32.runner.kv_cache.clone()
    assert decode_logits(fp32, one_token, fp32.runner.kv_cache) is None
    assert torch.equal(fp32.runner.kv_cache, before)


def _spoiled(meta, **values):
    """The step's metadata with the named tensors' first value replaced (copies: the engine's stay as they are)."""
    changes = {}
    for field, value in values.items():
        tensor = getattr(meta, field).clone()
        tensor.view(-1)[0] = value
        changes[field] = tensor
    return dataclasses.replace(meta, **changes)


def test_a_step_input_out_of_range_is_refused_before_anything_is_written(root) -> None:
    _, folder = bf16_model("llama", root)
    engine = bf16_engine(folder)
    _, inputs = decode_inputs(engine, random_prompts(1, 9, 9, seed=4)[0])
    num_blocks = engine.runner.kv_cache.shape[1]
    width = inputs.meta.block_tables.shape[1]
    spoiled = {
        "a slot outside the cache": (_spoiled(inputs.meta, slot_mapping=num_blocks * BLOCK_SIZE), None),
        "a block id outside the cache": (_spoiled(inputs.meta, block_tables=num_blocks), None),
        "a context longer than block_tables can address": (
            _spoiled(inputs.meta, context_lens=width * BLOCK_SIZE + 1), None),
        "an empty context": (_spoiled(inputs.meta, context_lens=0), None),
        "a position outside the rotary caches": (inputs.meta, engine.runner.model.rotary.cos_cache.shape[0]),
    }
    before = engine.runner.kv_cache.clone()
    for what, (meta, position) in spoiled.items():
        positions = inputs.positions.clone()
        if position is not None:
            positions[0] = position
        step = dataclasses.replace(inputs, meta=meta, positions=positions)
        with pytest.raises(kernels.KernelInputError) as refused:
            run(engine, step, engine.runner.kv_cache, "native")
        assert any(word in str(refused.value) for word in ("slot", "block", "context", "position")), what
        assert torch.equal(engine.runner.kv_cache, before), what


def test_only_one_sequences_one_new_bf16_token_takes_the_compiled_forward(root, monkeypatch) -> None:
    _, folder = bf16_model("llama", root)
    engine = bf16_engine(folder)
    calls = spy_on_native(monkeypatch)
    prompts = random_prompts(2, 5, 9, seed=6)
    output_tokens(engine, prompts, greedy(6))  # two sequences decode together: batched, eager
    assert calls == []
    output_tokens(engine, prompts[:1], greedy(6))  # a prefill, then five decode steps of one sequence
    assert calls == [True] * 5  # the engine's steps take the output head in the same call (`decode_logits`)
    with kernels.force("reference"):
        output_tokens(engine, prompts[:1], greedy(6))
    assert len(calls) == 5
    fp32 = LLMEngine(folder, EngineConfig(num_blocks=64, block_size=BLOCK_SIZE, dtype="float32"))
    output_tokens(fp32, prompts[:1], greedy(6))
    assert len(calls) == 5


def test_the_trained_model_tells_the_same_story_compiled_and_eager(monkeypatch) -> None:
    """stories260K's trained weights, not random ones: its greedy story in bf16 has no near-ties to break
    differently, so the compiled and the eager forward tell it token for token alike."""
    engine = LLMEngine(trained_model().folder, EngineConfig(num_blocks=64, block_size=16, dtype="bfloat16"))
    calls = spy_on_native(monkeypatch)
    prompt = engine.tokenizer.encode("Once upon a time")
    story = output_tokens(engine, [prompt], greedy(48))
    assert len(calls) == 47
    with kernels.force("reference"):
        assert output_tokens(engine, [prompt], greedy(48)) == story
    assert engine.residue_check() == []


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """`cpu_decode.build()` forgotten before and after the test, with an empty kernel cache folder."""
    monkeypatch.setenv("VEIL_KERNEL_CACHE", str(tmp_path / "kernels"))
    cpu_decode.build.cache_clear()
    yield
    cpu_decode.build.cache_clear()


def test_without_a_compiler_the_default_decodes_eagerly_and_an_explicit_native_is_refused(
        root, monkeypatch, fresh_build) -> None:
    _, folder = bf16_model("llama", root)
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert cpu_decode.build().library is None and "/nonexistent/cc" in cpu_decode.build().reason
    engine = bf16_engine(folder)
    calls = spy_on_native(monkeypatch)
    prompt = random_prompts(1, 5, 5, seed=8)
    with kernels.force("reference"):
        eager = output_tokens(engine, prompt, greedy(4))
    assert output_tokens(engine, prompt, greedy(4)) == eager and calls == []
    monkeypatch.setenv("VEIL_KERNELS", "native")
    with pytest.raises(kernels.KernelBackendError, match="native CPU decode is not available.*nonexistent"):
        output_tokens(engine, prompt, greedy(4))


def test_the_library_is_built_once_and_found_by_its_digest_after(fresh_build, tmp_path) -> None:
    first = cpu_decode.build()
    assert first.library is not None
    built = list((tmp_path / "kernels").glob("cpu_decode-*.so"))
    assert len(built) == 1 and not list((tmp_path / "kernels").glob("*.partial"))
    cpu_decode.build.cache_clear()
    stamp = built[0].stat().st_mtime_ns
    assert cpu_decode.build().library is not None and built[0].stat().st_mtime_ns == stamp


def test_a_cache_folder_others_can_write_is_not_trusted(fresh_build, tmp_path) -> None:
    folder = tmp_path / "kernels"
    folder.mkdir(mode=0o777)
    folder.chmod(0o777)  # past the umask
    built = cpu_decode.build()
    assert built.library is None and "writable by another user" in built.reason
    assert not list(folder.iterdir())  # nothing compiled into it, nothing loaded from it


def test_a_cache_folder_that_cannot_be_created_falls_back_to_a_private_temporary_one(
        fresh_build, monkeypatch, tmp_path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("VEIL_KERNEL_CACHE", str(blocker / "kernels"))  # under a file: mkdir fails
    built = cpu_decode.build()
    assert built.library is not None and str(blocker) not in built.reason
    assert not (blocker.parent / "kernels").exists()
