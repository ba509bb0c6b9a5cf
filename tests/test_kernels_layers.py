"""The layer kernels: RMSNorm (with the fused residual add), SiLU-and-mul and rotary embedding.

The torch references are checked against `transformers`' own Llama modules, bit for bit; each Triton
kernel is checked against its reference on shapes drawn by hypothesis (on a CPU in the Triton interpreter,
so shapes stay small). Tolerances, Triton vs reference, relative to the values compared: float32 1e-5
(sums in a different order), float16 2e-3 (about two units in the last place), bfloat16 1.6e-2 (two units:
the interpreter truncates float32 to bfloat16 where a GPU rounds to nearest). Rotary embedding's reference
rounds each product to the input dtype before the sum and the kernel rounds once, so its absolute tolerance
scales with the largest input rather than with the output.
"""

from __future__ import annotations

import os

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before the lazily imported Triton modules load

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import kernels  # noqa: E402
from engine.config import RopeScaling  # noqa: E402
from engine.models.layers import RotaryEmbedding  # noqa: E402
from kernels import reference  # noqa: E402

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DTYPES = list(TOLERANCE)
BACKENDS = ["reference", "triton"]
LLAMA3 = RopeScaling("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)


def _random(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


def _assert_close(got: torch.Tensor, want: torch.Tensor, atol: float | None = None) -> None:
    tolerance = TOLERANCE[want.dtype]
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), atol=tolerance if atol is None else atol, rtol=tolerance)


# ----- references against transformers ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_norm_and_activation_equal_transformers_bit_for_bit(dtype: torch.dtype) -> None:
    from transformers.activations import ACT2FN
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hidden, residual = _random((3, 5, 96), dtype, 1).cpu(), _random((3, 5, 96), dtype, 2).cpu()
    norm = LlamaRMSNorm(96, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(_random((96,), dtype, 3).cpu())
        assert torch.equal(reference.rms_norm(hidden, norm.weight, 1e-5), norm(hidden))
        normed, new_residual = reference.add_rms_norm(hidden, residual, norm.weight, 1e-5)
        assert torch.equal(new_residual, residual + hidden) and torch.equal(normed, norm(residual + hidden))
    gate_up = _random((7, 2 * 48), dtype, 4).cpu()
    assert torch.equal(reference.silu_and_mul(gate_up), ACT2FN["silu"](gate_up[:, :48]) * gate_up[:, 48:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_norm_equals_transformers_on_model_widths_and_large_values(dtype: torch.dtype) -> None:
    # The reference's fused float32 norm against transformers' op-by-op module, on the widths of real models
    # and rows whose scales span many binades (where a different summation order would show).
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    for width in (64, 512, 2048, 4096):
        rows = _random((9, width), torch.float32, width).cpu() * torch.logspace(-3, 3, 9)[:, None]
        norm = LlamaRMSNorm(width, eps=1e-6).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(_random((width,), dtype, width + 1).cpu())
            assert torch.equal(reference.rms_norm(rows.to(dtype), norm.weight, 1e-6), norm(rows.to(dtype)))


@pytest.mark.parametrize("scaling", [RopeScaling(), LLAMA3], ids=["default", "llama3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_rotary_with_the_engine_caches_equals_transformers(scaling: RopeScaling, dtype: torch.dtype) -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    head_dim, theta = 32, 500000.0
    rope = {"rope_type": "default"} if scaling.rope_type == "default" else {
        "rope_type": "llama3", "factor": scaling.factor, "low_freq_factor": scaling.low_freq_factor,
        "high_freq_factor": scaling.high_freq_factor,
        "original_max_position_embeddings": scaling.original_max_position_embeddings,
    }
    config = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, rope_theta=theta, rope_scaling=rope)
    positions = torch.tensor([0, 1, 63, 64, 200, 511])
    query, key = _random((6, 4, head_dim), dtype, 5).cpu(), _random((6, 2, head_dim), dtype, 6).cpu()
    cos, sin = LlamaRotaryEmbedding(config)(query, positions[None])
    want_q, want_k = apply_rotary_pos_emb(query.transpose(0, 1)[None], key.transpose(0, 1)[None], cos, sin)
    engine_rope = RotaryEmbedding(head_dim, 512, theta, scaling)
    got_q, got_k = reference.rotary_embedding(positions, query, key, engine_rope.cos_cache, engine_rope.sin_cache, False)
    # The caches are computed as an outer product, transformers' as a matrix product: equal in float32
    # up to the cos/sin library's last bit, which the bfloat16 rounding then hides.
    atol = 1e-6 if dtype == torch.float32 else 0.0
    torch.testing.assert_close(got_q, want_q[0].transpose(0, 1), atol=atol, rtol=atol)
    torch.testing.assert_close(got_k, want_k[0].transpose(0, 1), atol=atol, rtol=atol)


def test_reference_rotary_in_place_overwrites_strided_views_of_the_stacked_projection() -> None:
    qkv = _random((5, 8, 16), torch.float32, 7)
    query, key, value = qkv[:, :4], qkv[:, 4:6], qkv[:, 6:].clone()
    caches = RotaryEmbedding(16, 32, 10000.0, RopeScaling())
    cos, sin = caches.cos_cache.to(DEVICE), caches.sin_cache.to(DEVICE)
    positions = torch.tensor([3, 1, 4, 1, 5], device=DEVICE)
    want = reference.rotary_embedding(positions, query, key, cos, sin, False)
    got = reference.rotary_embedding(positions, query, key, cos, sin, True)
    assert got[0] is query and got[1] is key
    assert torch.equal(qkv[:, :4], want[0]) and torch.equal(qkv[:, 4:6], want[1]) and torch.equal(qkv[:, 6:], value)


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_rotary_of_neighbouring_query_and_key_equals_theirs_apart(dtype: torch.dtype, inplace: bool) -> None:
    # The stacked projection's q and k are rotated as one tensor: bit for bit what copies of them give apart.
    qkv = _random((3, 7, 16), dtype, 12) * 4
    query, key, value = qkv[:, :4], qkv[:, 4:6], qkv[:, 6:].clone()
    assert reference._side_by_side(query, key) is not None and reference._side_by_side(key, query) is None
    rope = RotaryEmbedding(16, 32, 10000.0, RopeScaling())
    cos, sin = rope.cos_cache.to(DEVICE), rope.sin_cache.to(DEVICE)
    positions = torch.tensor([9, 0, 31], device=DEVICE)
    want_q, want_k = reference.rotary_embedding(positions, query.clone(), key.clone(), cos, sin, False)
    got_q, got_k = reference.rotary_embedding(positions, query, key, cos, sin, inplace)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k) and torch.equal(qkv[:, 6:], value)


# ----- Triton against the reference ---------------------------------------------------------------------


@settings(max_examples=20, deadline=None)
@given(st.data())
def test_rms_norm_and_the_fused_residual_add_match_reference(data: st.DataObject) -> None:
    leading = tuple(data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=2)))
    width = data.draw(st.one_of(st.integers(1, 300), st.sampled_from([64, 128, 2048])))
    dtype, seed = data.draw(st.sampled_from(DTYPES)), data.draw(st.integers(0, 2**16))
    hidden, residual = _random((*leading, width), dtype, seed), _random((*leading, width), dtype, seed + 1)
    weight, eps = _random((width,), dtype, seed + 2), data.draw(st.sampled_from([1e-6, 1e-5]))
    with kernels.force("triton"):
        normed = kernels.rms_norm(hidden, weight, eps)
        fused, new_residual = kernels.add_rms_norm(hidden, residual, weight, eps)
    _assert_close(normed, reference.rms_norm(hidden, weight, eps))
    want_fused, want_residual = reference.add_rms_norm(hidden, residual, weight, eps)
    _assert_close(new_residual, want_residual)
    _assert_close(fused, want_fused)


def test_rms_norm_reads_rows_of_a_strided_tensor_by_position() -> None:
    wide = _random((6, 2 * 40), torch.float16, 8)
    hidden, weight = wide[:, ::2], _random((40,), torch.float16, 9)  # rows 80 apart, columns 2 apart
    with kernels.force("triton"):
        _assert_close(kernels.rms_norm(hidden, weight, 1e-5), reference.rms_norm(hidden, weight, 1e-5))


@settings(max_examples=20, deadline=None)
@given(st.data())
def test_silu_and_mul_matches_reference(data: st.DataObject) -> None:
    rows = data.draw(st.integers(1, 5))
    width = data.draw(st.one_of(st.integers(1, 200), st.sampled_from([1024, 1100])))  # one chunk, and two
    dtype = data.draw(st.sampled_from(DTYPES))
    gate_up = _random((rows, 2 * width), dtype, data.draw(st.integers(0, 2**16))) * 3
    with kernels.force("triton"):
        got = kernels.silu_and_mul(gate_up)
    _assert_close(got, reference.silu_and_mul(gate_up))


@settings(max_examples=20, deadline=None)
@given(st.data())
def test_rotary_embedding_matches_reference_on_strided_query_and_key(data: st.DataObject) -> None:
    tokens, num_kv_heads = data.draw(st.integers(1, 6)), data.draw(st.integers(1, 3))
    num_heads = num_kv_heads * data.draw(st.sampled_from([1, 2, 4]))
    head_dim, dtype = data.draw(st.sampled_from([2, 16, 64, 80, 128])), data.draw(st.sampled_from(DTYPES))
    scaling, inplace = data.draw(st.sampled_from([RopeScaling(), LLAMA3])), data.draw(st.booleans())
    max_positions = data.draw(st.sampled_from([8, 300]))
    rope = RotaryEmbedding(head_dim, max_positions, 500000.0, scaling).to(dtype=data.draw(st.sampled_from(DTYPES)))
    cos, sin = rope.cos_cache.to(DEVICE), rope.sin_cache.to(DEVICE)
    positions = torch.tensor(data.draw(st.lists(st.integers(0, max_positions - 1), min_size=tokens, max_size=tokens)),
                             dtype=data.draw(st.sampled_from([torch.int32, torch.int64])), device=DEVICE)
    # Query and key as the split of a stacked q/k/v projection: rows strided, heads contiguous.
    qkv = _random((tokens, num_heads + 2 * num_kv_heads, head_dim), dtype, data.draw(st.integers(0, 2**16)))
    query, key = qkv[:, :num_heads], qkv[:, num_heads : num_heads + num_kv_heads]
    want_q, want_k = reference.rotary_embedding(positions, query, key, cos, sin, False)
    value_before = qkv[:, num_heads + num_kv_heads :].clone()
    with kernels.force("triton"):
        got_q, got_k = kernels.rotary_embedding(positions, query, key, cos, sin, inplace=inplace)
    atol = 2 * TOLERANCE[dtype] * float(qkv.abs().max())
    _assert_close(got_q, want_q, atol)
    _assert_close(got_k, want_k, atol)
    assert (got_q.data_ptr() == query.data_ptr()) == inplace
    assert torch.equal(qkv[:, num_heads + num_kv_heads :], value_before)


def test_rotary_kernel_leaves_a_token_at_an_out_of_cache_position_unrotated() -> None:
    """On CUDA positions are not range-checked on the host: the kernel must never read past its caches."""
    from kernels import triton_rotary as rotary  # after TRITON_INTERPRET is set, above
    rope = RotaryEmbedding(16, 8, 10000.0, RopeScaling())
    cos, sin = rope.cos_cache.to(DEVICE), rope.sin_cache.to(DEVICE)
    query, key = _random((3, 2, 16), torch.float32, 10), _random((3, 1, 16), torch.float32, 11)
    positions = torch.tensor([2, 8, -1], device=DEVICE)
    got_q, got_k = rotary.rotary_embedding(positions, query, key, cos, sin, False)
    want_q, want_k = reference.rotary_embedding(positions[:1], query[:1], key[:1], cos, sin, False)
    assert torch.equal(got_q[1:], query[1:]) and torch.equal(got_k[1:], key[1:])
    _assert_close(got_q[:1], want_q)
    _assert_close(got_k[:1], want_k)


# ----- validation, the same on both backends ------------------------------------------------------------

BAD_CALLS = {
    "norm weight width": lambda: kernels.rms_norm(torch.zeros(2, 8), torch.ones(7), 1e-5),
    "norm weight dtype": lambda: kernels.rms_norm(torch.zeros(2, 8), torch.ones(8, dtype=torch.float16), 1e-5),
    "norm integer input": lambda: kernels.rms_norm(torch.zeros(2, 8, dtype=torch.int32), torch.ones(8), 1e-5),
    "residual shape": lambda: kernels.add_rms_norm(torch.zeros(2, 8), torch.zeros(3, 8), torch.ones(8), 1e-5),
    "odd gate_up": lambda: kernels.silu_and_mul(torch.zeros(2, 9)),
    "odd head_dim": lambda: kernels.rotary_embedding(torch.zeros(2, dtype=torch.int64), torch.zeros(2, 2, 7),
                                                     torch.zeros(2, 1, 7), torch.zeros(8, 3), torch.zeros(8, 3)),
    "cache width": lambda: kernels.rotary_embedding(torch.zeros(2, dtype=torch.int64), torch.zeros(2, 2, 8),
                                                    torch.zeros(2, 1, 8), torch.zeros(8, 8), torch.zeros(8, 8)),
    "position past the caches": lambda: kernels.rotary_embedding(
        torch.tensor([0, 987654]), torch.zeros(2, 2, 8), torch.zeros(2, 1, 8), torch.zeros(8, 4), torch.zeros(8, 4)),
    "float positions": lambda: kernels.rotary_embedding(torch.zeros(2), torch.zeros(2, 2, 8), torch.zeros(2, 1, 8),
                                                        torch.zeros(8, 4), torch.zeros(8, 4)),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("call", BAD_CALLS.values(), ids=BAD_CALLS.keys())
def test_bad_layer_inputs_are_refused_before_any_launch(backend: str, call) -> None:
    with kernels.force(backend), pytest.raises(kernels.KernelInputError) as refused:
        call()
    assert "987654" not in str(refused.value)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batches_give_empty_results(backend: str) -> None:
    with kernels.force(backend):
        assert kernels.rms_norm(torch.zeros(0, 8), torch.ones(8), 1e-5).shape == (0, 8)
        assert kernels.add_rms_norm(torch.zeros(0, 8), torch.zeros(0, 8), torch.ones(8), 1e-5)[1].shape == (0, 8)
        assert kernels.silu_and_mul(torch.zeros(0, 8)).shape == (0, 4)
        query, key = kernels.rotary_embedding(torch.zeros(0, dtype=torch.int64), torch.zeros(0, 2, 8),
                                              torch.zeros(0, 1, 8), torch.zeros(8, 4), torch.zeros(8, 4))
        assert query.shape == (0, 2, 8) and key.shape == (0, 1, 8)
