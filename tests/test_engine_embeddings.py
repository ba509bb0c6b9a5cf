"""Embeddings (`engine.pooling`): pooled final states equal `transformers`', and leave no KV residue."""

from __future__ import annotations

import pytest
import torch

from engine import EngineConfig, LLMEngine, PoolingKind, PoolingParams, RequestRejected
from tests.engine_models import greedy, one_torch_thread, random_prompts, reference_model  # noqa: F401 (fixtures)


def _engine(name: str, **overrides) -> LLMEngine:
    # A small batch budget: the longer prompts are prefilled in several chunks, pooled across them.
    config = dict(device="cpu", dtype="float32", num_blocks=64, block_size=4, max_num_batched_tokens=16) | overrides
    return LLMEngine(reference_model(name).folder, EngineConfig(**config))


def _reference(name: str, prompt: list[int], kind: PoolingKind) -> torch.Tensor:
    with torch.no_grad():
        states = reference_model(name).model(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0]
    pooled = states[-1] if kind is PoolingKind.LAST else states.mean(0)
    return torch.nn.functional.normalize(pooled, dim=0)


@pytest.mark.parametrize("name", ["qwen3", "llama"])
@pytest.mark.parametrize("kind", list(PoolingKind))
def test_pooled_vectors_equal_transformers(name, kind):
    prompts = random_prompts(6, 1, 40, seed=5)
    vectors = _engine(name).embed(prompts, PoolingParams(kind))
    for prompt, vector in zip(prompts, vectors):
        cosine = torch.nn.functional.cosine_similarity(torch.tensor(vector), _reference(name, prompt, kind), dim=0)
        assert cosine >= 0.9999
        assert abs(torch.tensor(vector).norm().item() - 1.0) < 1e-5


def test_dimensions_truncate_then_renormalize():
    prompt = random_prompts(1, 10, 10, seed=2)[0]
    engine = _engine("qwen3")
    full = torch.tensor(engine.embed([prompt], PoolingParams(PoolingKind.MEAN))[0])
    short = torch.tensor(engine.embed([prompt], PoolingParams(PoolingKind.MEAN, dimensions=16))[0])
    assert short.shape == (16,)
    assert torch.allclose(short, torch.nn.functional.normalize(full[:16], dim=0), atol=1e-6)
    with pytest.raises(RequestRejected, match="dimensions"):
        engine.add_embedding(prompt, PoolingParams(dimensions=65))


def test_an_embedding_beside_generation_changes_neither_and_leaves_no_residue():
    prompts = random_prompts(4, 5, 30, seed=9)
    alone = _engine("qwen3")
    expected_tokens = [o.outputs[0].token_ids for o in alone.generate(prompts, greedy(8))]
    expected_vector = alone.embed([prompts[0]], PoolingParams(PoolingKind.MEAN))[0]
    engine = _engine("qwen3", num_blocks=20)  # crowded: preemptions recompute a pooled prefill from its start
    ids = [engine.add_request(p, greedy(8)) for p in prompts]
    embedded = engine.add_embedding(prompts[0], PoolingParams(PoolingKind.MEAN))
    outputs, vectors = {rid: [] for rid in ids}, {}
    while engine.has_unfinished():
        for delta in engine.step():
            outputs[delta.request_id] += delta.token_ids
        vectors.update((o.request_id, o.embedding) for o in engine.take_embeddings())
        assert engine.residue_check() == []
    assert [outputs[rid] for rid in ids] == expected_tokens
    assert torch.allclose(torch.tensor(vectors[embedded]), torch.tensor(expected_vector), atol=1e-5)
    assert int(engine.runner.kv_cache.count_nonzero()) == 0
    assert sorted(engine.block_manager.free_block_ids()) == list(range(20))


def test_an_aborted_embedding_keeps_nothing():
    engine = _engine("qwen3")
    request_id = engine.add_embedding(random_prompts(1, 40, 40, seed=3)[0], PoolingParams(PoolingKind.MEAN))
    engine.step_tokens()  # one chunk pooled of three
    seq = engine._requests[request_id].sequences[0]
    assert seq.pooled is not None
    engine.abort(request_id)
    assert seq.pooled is None and engine._num_pooling == 0
    while engine.has_unfinished():
        engine.step_tokens()
    assert engine.take_embeddings() == [] and engine.residue_check() == []
    assert int(engine.runner.kv_cache.count_nonzero()) == 0


def test_an_embedding_aborted_while_its_vector_crosses_is_dropped_and_its_id_is_free_again():
    """With async scheduling a finished vector is read with the next step (`engine.bridge`): an abort in
    between drops it, and a new request under the same id gets its own vector, not the aborted one's."""
    engine = _engine("qwen3", async_scheduling=True)
    first, second = random_prompts(2, 8, 8, seed=4)  # one chunk each
    request_id = engine.add_embedding(first, PoolingParams(PoolingKind.MEAN))
    engine.step_tokens()  # its chunk runs and finishes it; its vector is in the step's download
    assert engine.take_embeddings() == [] and engine.has_unfinished()
    engine.abort(request_id)
    assert engine.add_embedding(second, PoolingParams(PoolingKind.MEAN), request_id=request_id) == request_id
    outputs = []
    while engine.has_unfinished():
        engine.step_tokens()
        outputs += engine.take_embeddings()
    [output] = outputs
    expected = _engine("qwen3").embed([second], PoolingParams(PoolingKind.MEAN))[0]
    assert output.request_id == request_id
    assert torch.allclose(torch.tensor(output.embedding), torch.tensor(expected), atol=1e-6)
    assert engine.residue_check() == [] and int(engine.runner.kv_cache.count_nonzero()) == 0
