"""Each Triton kernel against its torch reference, on shapes drawn by hypothesis.

On a CPU the kernels run in the Triton interpreter, so shapes stay small; on a CUDA machine the same tests
run the compiled kernels on the GPU. Tolerances for attention (Triton vs reference, both accumulating in
float32): float32 1e-4, float16 4e-3, bfloat16 3.2e-2 absolute and relative — the half-precision bounds
cover rounding the probabilities to the cache dtype before the P.V product, as flash-style kernels do, plus
one rounding of the output.
"""

from __future__ import annotations

import os

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    # Read by Triton when the kernel modules are imported, which dispatch does lazily on the first call.
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import kernels  # noqa: E402
from kernels import reference  # noqa: E402
from kernels.paged_batch import PagedBatch, build_paged_batch  # noqa: E402

ATTENTION_TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3.2e-2}
DTYPES = list(ATTENTION_TOLERANCE)


def _triton_attention(batch: PagedBatch) -> torch.Tensor:
    with kernels.force("triton"):
        return kernels.paged_attention(*batch.args())


def _assert_attention_matches_reference(batch: PagedBatch) -> None:
    out = _triton_attention(batch)
    expected = reference.paged_attention(*batch.args())
    tolerance = ATTENTION_TOLERANCE[batch.query.dtype]
    assert out.dtype == batch.query.dtype and out.shape == batch.query.shape
    torch.testing.assert_close(out.float(), expected.float(), atol=tolerance, rtol=tolerance)


@st.composite
def attention_batches(draw: st.DrawFn, decode: bool) -> PagedBatch:
    block_size = draw(st.sampled_from([8, 16, 32]))
    num_seqs = draw(st.integers(1, 3))
    exact = st.sampled_from([multiple for multiple in (block_size, 2 * block_size, 3 * block_size) if multiple <= 48])
    contexts = draw(st.lists(st.one_of(st.just(1), st.integers(1, 40), exact), min_size=num_seqs, max_size=num_seqs))
    query_lens = [1] * num_seqs if decode else [draw(st.integers(0, context)) for context in contexts]
    num_kv_heads = draw(st.sampled_from([1, 2]))
    return build_paged_batch(
        contexts, query_lens, num_heads=num_kv_heads * draw(st.sampled_from([1, 2, 4, 8])),
        num_kv_heads=num_kv_heads, head_dim=draw(st.sampled_from([16, 32])), block_size=block_size,
        dtype=draw(st.sampled_from(DTYPES)), device=DEVICE, stale_id=draw(st.sampled_from([None, 10**6])),
        spare_table_columns=draw(st.integers(0, 2)),
        generator=torch.Generator(DEVICE).manual_seed(draw(st.integers(0, 2**31))),
    )


@settings(max_examples=20, deadline=None)
@given(attention_batches(decode=True))
def test_decode_attention_matches_reference(batch: PagedBatch) -> None:
    _assert_attention_matches_reference(batch)


@settings(max_examples=20, deadline=None)
@given(attention_batches(decode=False))
def test_prefill_and_chunked_prefill_attention_match_reference(batch: PagedBatch) -> None:
    _assert_attention_matches_reference(batch)


@pytest.mark.parametrize(
    ("head_dim", "group", "contexts", "query_lens"),
    [
        (64, 4, [40, 16], [1, 1]),  # a head dim of the issue, decode
        (64, 2, [40, 23], [9, 23]),  # ... chunked prefill and a whole prompt
        (80, 4, [33, 8], [1, 1]),  # a head dim that is not a power of two
        (80, 1, [33, 8], [5, 8]),
    ],
)
def test_issue_head_dims_match_reference(head_dim: int, group: int, contexts: list[int], query_lens: list[int]) -> None:
    batch = build_paged_batch(contexts, query_lens, num_heads=2 * group, num_kv_heads=2, head_dim=head_dim,
                              block_size=16, dtype=torch.float16, device=DEVICE,
                              generator=torch.Generator(DEVICE).manual_seed(head_dim + group))
    _assert_attention_matches_reference(batch)


def test_decode_plan_splits_long_contexts_and_keeps_one_partition_when_the_grid_is_full() -> None:
    from kernels.triton_paged_attention import CPU_COMPUTE_UNITS, balanced_splits, decode_plan

    cpu = torch.device("cpu")
    splits, partition = decode_plan(num_seqs=1, num_kv_heads=1, max_context=48, device=cpu)
    assert splits == 3 and partition == 16
    assert decode_plan(num_seqs=2 * CPU_COMPUTE_UNITS, num_kv_heads=1, max_context=48, device=cpu) == (1, 48)
    assert decode_plan(num_seqs=1, num_kv_heads=1, max_context=5, device=cpu) == (1, 16)
    # An H100 SXM has 132 multiprocessors; Llama-3-8B has 8 KV heads.
    assert balanced_splits(64 * 8, units=132, most=4) == 1  # batch 64: 512 programs, 3.9 per unit
    assert balanced_splits(8 * 8, units=132, most=32) == 6  # batch 8: 384 programs, 2.9 per unit
    assert balanced_splits(1, units=132, most=32) == 32  # one sequence cannot fill the device: most parallel


@pytest.mark.parametrize("num_seqs", [1, 16])  # 1: split-K with a merge (on a CPU), 16: one partition
def test_split_and_unsplit_decode_match_reference(num_seqs: int) -> None:
    contexts = [1 + (7 * seq) % 40 for seq in range(num_seqs - 1)] + [40]
    batch = build_paged_batch(contexts, [1] * num_seqs, num_heads=8, num_kv_heads=1, head_dim=16, block_size=8,
                              dtype=torch.float32, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(3))
    _assert_attention_matches_reference(batch)


def test_decode_skips_sequences_without_a_new_token() -> None:
    batch = build_paged_batch([12, 30, 5], [1, 0, 1], num_heads=4, num_kv_heads=2, head_dim=16, block_size=8,
                              device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(5))
    _assert_attention_matches_reference(batch)


@settings(max_examples=20, deadline=None)
@given(st.data())
def test_store_kv_matches_reference_bit_for_bit(data: st.DataObject) -> None:
    num_blocks, block_size = data.draw(st.integers(1, 4)), data.draw(st.sampled_from([8, 16]))
    num_kv_heads, head_dim = data.draw(st.integers(1, 3)), data.draw(st.sampled_from([16, 24, 64]))
    dtype = data.draw(st.sampled_from(DTYPES))
    num_slots = num_blocks * block_size
    slots = data.draw(st.lists(st.integers(0, num_slots - 1), unique=True, min_size=1, max_size=12))
    slots = [data.draw(st.sampled_from([slot, -1])) for slot in slots]
    slot_mapping = torch.tensor(slots, dtype=data.draw(st.sampled_from([torch.int32, torch.int64])), device=DEVICE)
    # K and V as slices of a fused projection output: rows strided, heads contiguous.
    fused = torch.randn(len(slots), 3 * num_kv_heads, head_dim, device=DEVICE).to(dtype)
    key, value = fused[:, :num_kv_heads], fused[:, num_kv_heads : 2 * num_kv_heads]
    caches = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, device=DEVICE).to(dtype)
    expected = caches.clone()
    reference.store_kv(key, value, expected[0], expected[1], slot_mapping)
    with kernels.force("triton"):
        kernels.store_kv(key, value, caches[0], caches[1], slot_mapping)
    assert torch.equal(caches.view(torch.uint8), expected.view(torch.uint8))


@settings(max_examples=20, deadline=None)
@given(st.data())
def test_zero_blocks_zeroes_every_targeted_byte_and_leaves_every_other_byte(data: st.DataObject) -> None:
    num_caches, num_blocks = 2 * data.draw(st.integers(1, 3)), data.draw(st.integers(1, 8))
    block_size, head_dim = data.draw(st.sampled_from([8, 16])), data.draw(st.sampled_from([16, 32]))
    dtype = data.draw(st.sampled_from(DTYPES))
    targeted = data.draw(st.lists(st.integers(0, num_blocks - 1), max_size=10))
    id_dtype = data.draw(st.sampled_from([torch.int32, torch.int64]))
    kv_cache = torch.randn(num_caches, num_blocks, block_size, 2, head_dim, device=DEVICE).to(dtype)
    before = kv_cache.clone()
    with kernels.force("triton"):
        kernels.zero_blocks(kv_cache, torch.tensor(targeted, dtype=id_dtype, device=DEVICE))
    raw, raw_before = kv_cache.view(torch.uint8), before.view(torch.uint8)
    untouched = [block for block in range(num_blocks) if block not in targeted]
    assert torch.count_nonzero(raw[:, sorted(set(targeted))]) == 0
    assert torch.equal(raw[:, untouched], raw_before[:, untouched])
    assert kernels.find_residue(kv_cache, range(num_blocks)) == untouched


def test_zero_blocks_handles_blocks_of_an_odd_number_of_half_words() -> None:
    kv_cache = torch.randn(2, 4, 3, 1, 5, device=DEVICE).to(torch.float16)  # 15 halves per block
    before = kv_cache.clone()
    with kernels.force("triton"):
        kernels.zero_blocks(kv_cache, [1, 2])
    assert torch.count_nonzero(kv_cache[:, 1:3].view(torch.int16)) == 0
    assert torch.equal(kv_cache[:, [0, 3]].view(torch.int16), before[:, [0, 3]].view(torch.int16))


def test_strided_index_tensors_are_read_by_position() -> None:
    batch = build_paged_batch([20, 9, 33], [1, 1, 1], num_heads=4, num_kv_heads=2, head_dim=16, block_size=8,
                              device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(9))
    wide_tables = torch.full((3, 2 * batch.block_tables.shape[1]), -7, dtype=torch.int32, device=DEVICE)
    wide_tables[:, ::2] = batch.block_tables
    spread_lens = torch.stack([batch.context_lens, torch.zeros_like(batch.context_lens)], dim=1)[:, 0]
    strided = PagedBatch(batch.query, batch.k_cache, batch.v_cache, wide_tables[:, ::2], spread_lens,
                         batch.cu_seqlens_q, batch.max_seqlen_q, batch.scale)
    assert strided.block_tables.stride(1) == 2 and strided.context_lens.stride(0) == 2
    torch.testing.assert_close(_triton_attention(strided), reference.paged_attention(*batch.args()),
                               atol=1e-4, rtol=1e-4)
