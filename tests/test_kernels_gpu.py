"""The compiled Triton kernels on a CUDA device, at the issue's shapes, against the torch reference.

Selected only where CUDA is available (`-m gpu` on a GPU machine); `make test` on a CPU deselects them.
Tolerances as in test_kernels_triton.py.
"""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import reference
from kernels.paged_batch import PagedBatch, build_paged_batch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ATTENTION_TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3.2e-2}


def _assert_matches_reference(batch: PagedBatch) -> None:
    out = kernels.paged_attention(*batch.args())
    assert kernels.selected_backend(batch.query.device) == "triton"
    expected = reference.paged_attention(*batch.args())
    tolerance = ATTENTION_TOLERANCE[batch.query.dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", list(ATTENTION_TOLERANCE))
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128])
@pytest.mark.parametrize("block_size", [8, 16, 32, 64])
def test_decode_and_prefill_at_issue_shapes(dtype: torch.dtype, head_dim: int, block_size: int) -> None:
    generator = torch.Generator("cuda").manual_seed(head_dim * block_size)
    contexts = [1, block_size, 3 * block_size, 1000, 4097]
    decode = build_paged_batch(contexts, [1] * 5, num_heads=32, num_kv_heads=8, head_dim=head_dim,
                               block_size=block_size, dtype=dtype, device="cuda", stale_id=10**6, generator=generator)
    _assert_matches_reference(decode)
    prefill = build_paged_batch(contexts, [1, block_size, 2, 300, 129], num_heads=32, num_kv_heads=8,
                                head_dim=head_dim, block_size=block_size, dtype=dtype, device="cuda",
                                generator=generator)
    _assert_matches_reference(prefill)


@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_long_context_split_k_decode(group: int) -> None:
    batch = build_paged_batch([16384, 9000], [1, 1], num_heads=8 * group, num_kv_heads=8, head_dim=128,
                              block_size=16, dtype=torch.bfloat16, device="cuda",
                              generator=torch.Generator("cuda").manual_seed(group))
    _assert_matches_reference(batch)


def test_decode_attention_replays_in_a_cuda_graph() -> None:
    batch = build_paged_batch([700, 33, 1024], [1, 1, 1], num_heads=32, num_kv_heads=8, head_dim=128,
                              block_size=16, dtype=torch.float16, device="cuda",
                              generator=torch.Generator("cuda").manual_seed(11))
    kernels.paged_attention(*batch.args())  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.paged_attention(*batch.args())
    batch.context_lens.copy_(torch.tensor([701, 34, 999], dtype=torch.int32))  # next step, same buffers
    graph.replay()
    torch.cuda.synchronize()
    tolerance = ATTENTION_TOLERANCE[torch.float16]
    torch.testing.assert_close(out.float(), reference.paged_attention(*batch.args()).float(), atol=tolerance, rtol=tolerance)


def test_store_kv_and_zero_blocks_on_device() -> None:
    kv_cache = torch.randn(8, 64, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
    key, value = torch.randn(2, 40, 8, 128, device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm(64 * 16, device="cuda")[:40]
    slots[::7] = -1
    expected = kv_cache.clone()
    reference.store_kv(key, value, expected[0], expected[1], slots)
    kernels.store_kv(key, value, kv_cache[0], kv_cache[1], slots)
    assert torch.equal(kv_cache.view(torch.int16), expected.view(torch.int16))
    freed = [3, 17, 17, 63, 0]
    before = kv_cache.clone()
    kernels.zero_blocks(kv_cache, freed)
    kept = [block for block in range(64) if block not in freed]
    assert kernels.find_residue(kv_cache, range(64)) == kept
    assert torch.equal(kv_cache[:, kept].view(torch.int16), before[:, kept].view(torch.int16))


LAYER_TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.mark.parametrize("dtype", list(LAYER_TOLERANCE))
@pytest.mark.parametrize(("hidden", "intermediate"), [(2048, 8192), (4096, 14336)])  # Llama-3.2-1B, Llama-3.1-8B
def test_norm_and_activation_at_llama_widths(dtype: torch.dtype, hidden: int, intermediate: int) -> None:
    tolerance = LAYER_TOLERANCE[dtype]
    rows, residual = torch.randn(2, 257, hidden, device="cuda", dtype=dtype)
    weight = torch.randn(hidden, device="cuda", dtype=dtype)
    normed, new_residual = kernels.add_rms_norm(rows, residual, weight, 1e-5)
    want_normed, want_residual = reference.add_rms_norm(rows, residual, weight, 1e-5)
    torch.testing.assert_close(new_residual.float(), want_residual.float(), atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(normed.float(), want_normed.float(), atol=tolerance, rtol=tolerance)
    gate_up = torch.randn(257, 2 * intermediate, device="cuda", dtype=dtype)
    torch.testing.assert_close(kernels.silu_and_mul(gate_up).float(), reference.silu_and_mul(gate_up).float(),
                               atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", list(LAYER_TOLERANCE))
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_at_llama_shapes_with_llama3_scaling(dtype: torch.dtype, head_dim: int) -> None:
    from engine.config import RopeScaling
    from engine.models.layers import RotaryEmbedding

    scaling = RopeScaling("llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192)
    rope = RotaryEmbedding(head_dim, 131072, 500000.0, scaling).to("cuda")
    qkv = torch.randn(300, 48, head_dim, device="cuda", dtype=dtype)
    query, key = qkv[:, :32], qkv[:, 32:40]
    positions = torch.randint(0, 131072, (300,), device="cuda")
    want_q, want_k = reference.rotary_embedding(positions, query, key, rope.cos_cache, rope.sin_cache, False)
    got_q, got_k = kernels.rotary_embedding(positions, query, key, rope.cos_cache, rope.sin_cache, inplace=True)
    atol = 2 * LAYER_TOLERANCE[dtype] * float(qkv.abs().max())
    torch.testing.assert_close(got_q.float(), want_q.float(), atol=atol, rtol=LAYER_TOLERANCE[dtype])
    torch.testing.assert_close(got_k.float(), want_k.float(), atol=atol, rtol=LAYER_TOLERANCE[dtype])


def test_residue_check_of_a_whole_large_pool_copies_nothing() -> None:
    """Every block of a 16 GiB pool listed at once: the check allocates flags, never a copy of the blocks."""
    kv_cache = torch.zeros(32, 32768, 16, 8, 64, device="cuda", dtype=torch.bfloat16)  # Llama-3.2-1B layout
    kv_cache[31, 32767, 15, 7, 63] = -0.0
    kv_cache[0, 5].view(-1).view(torch.uint8)[0] = 1
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    ids = list(range(32768))
    assert kernels.find_residue(kv_cache, ids) == [5, 32767]
    assert int(kernels.count_residue(kv_cache, ids)) == 2
    assert torch.cuda.max_memory_allocated() - before < 16 << 20
