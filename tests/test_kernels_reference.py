"""The torch reference kernels (the CPU production path) against naive float64 loops and against themselves."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kernels
from kernels import reference
from kernels.paged_batch import PagedBatch, build_paged_batch
from tests.paged_attention_support import OUTPUT_TOLERANCE, batches, naive_attention


@pytest.fixture(autouse=True)
def reference_backend():
    """These tests are the reference's: on a CPU with AVX-512 BF16 the default backend is `native`, whose
    compiled attention `tests/test_kernels_cpu_attention.py` checks against the same oracles."""
    with kernels.force("reference"):
        yield

def _assert_matches_naive(batch: PagedBatch) -> None:
    out = kernels.paged_attention(*batch.args())
    assert out.dtype == batch.query.dtype and out.shape == batch.query.shape
    expected = naive_attention(batch)
    tolerance = OUTPUT_TOLERANCE[batch.query.dtype]
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance)


@settings(max_examples=25, deadline=None)
@given(batches(decode=True))
def test_decode_matches_naive_softmax(batch: PagedBatch) -> None:
    _assert_matches_naive(batch)


@settings(max_examples=25, deadline=None)
@given(batches(decode=False))
def test_prefill_and_mixed_batches_match_naive_softmax(batch: PagedBatch) -> None:
    _assert_matches_naive(batch)


@settings(max_examples=40, deadline=None)
@given(st.booleans().flatmap(lambda decode: batches(decode=decode)))
def test_batched_kernel_equals_the_per_sequence_oracle(batch: PagedBatch) -> None:
    # Decode steps, prefill chunks and mixes of both; ragged contexts, GQA, block sizes 1 to 16, stale ids.
    batched = kernels.paged_attention(*batch.args())
    per_sequence = reference.paged_attention_per_sequence(*batch.args())
    tolerance = OUTPUT_TOLERANCE[batch.query.dtype]
    torch.testing.assert_close(batched, per_sequence, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("budget", [reference.GATHER_BUDGET_BYTES, 40 * 1024, 1])
def test_a_step_of_decode_tokens_and_prefill_chunks_equals_the_oracle(budget: int, monkeypatch) -> None:
    # Several chunks of different lengths beside decode tokens and an idle sequence (no new token); with a
    # smaller gather budget the sequences split into several calls (1 byte: one call each).
    monkeypatch.setattr(reference, "GATHER_BUDGET_BYTES", budget)
    batch = build_paged_batch([40, 9, 33, 1, 17, 64, 2, 50], [1, 9, 5, 1, 0, 12, 1, 1], num_heads=8, num_kv_heads=2,
                              head_dim=16, block_size=4, stale_id=10**6,
                              generator=torch.Generator().manual_seed(3))
    batched = kernels.paged_attention(*batch.args())
    torch.testing.assert_close(batched, reference.paged_attention_per_sequence(*batch.args()), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("contexts", [[13], [13, 13, 13], [13, 5, 13]], ids=["batch 1", "one length", "two lengths"])
def test_decode_reads_no_slot_past_a_context_with_or_without_a_mask(contexts: list[int]) -> None:
    # Decode tokens of one context length gather exactly that length and attend without a mask; the slots
    # past a context in its last block hold huge keys and values, which any unmasked read would show.
    batch = build_paged_batch(contexts, [1] * len(contexts), num_heads=8, num_kv_heads=2, head_dim=16, block_size=8,
                              dtype=torch.bfloat16, stale_id=10**6, generator=torch.Generator().manual_seed(5))
    for seq, context in enumerate(contexts):
        last_block = int(batch.block_tables[seq, (context - 1) // 8])
        batch.k_cache[last_block, context % 8:] = 1000.0
        batch.v_cache[last_block, context % 8:] = 1000.0
    with kernels.one_forward():
        batched = kernels.paged_attention(*batch.args())
    torch.testing.assert_close(batched, reference.paged_attention_per_sequence(*batch.args()),
                               atol=OUTPUT_TOLERANCE[torch.bfloat16], rtol=OUTPUT_TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize("query_lens", [[1, 1, 1, 1], [1, 5, 1, 3]], ids=["decode", "decode and prefill"])
def test_nan_in_blocks_no_sequence_holds_never_reaches_the_batched_attention(query_lens: list[int]) -> None:
    # Sequences of a call are padded to its longest context with blocks that are masked out; masked weights are
    # 0, but 0 * NaN is NaN, so the padding must read no block another sequence (or none) holds. Here the free
    # blocks, block 0 among them, hold NaN.
    contexts = [13, 5, 21, 9]
    batch = build_paged_batch(contexts, query_lens, num_heads=4, num_kv_heads=2, head_dim=8, block_size=4,
                              spare_blocks=3, stale_id=10**6, generator=torch.Generator().manual_seed(11))
    tables = batch.block_tables.clone()
    held = {int(tables[seq, index]) for seq, context in enumerate(contexts) for index in range(-(-context // 4))}
    if 0 in held:  # make block 0 a free one: swap it with a free block, contents and table entries
        free = min(set(range(batch.k_cache.shape[0])) - held)
        for cache in (batch.k_cache, batch.v_cache):
            cache[[0, free]] = cache[[free, 0]]
        batch.block_tables[tables == 0], batch.block_tables[tables == free] = free, 0
        held = held - {0} | {free}
    for block in set(range(batch.k_cache.shape[0])) - held:
        batch.k_cache[block], batch.v_cache[block] = float("nan"), float("nan")
    with kernels.one_forward():
        batched = kernels.paged_attention(*batch.args())
    assert not batched.isnan().any()
    torch.testing.assert_close(batched, reference.paged_attention_per_sequence(*batch.args()), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("query_lens", [[1], [1, 1, 1, 1], [1, 5, 1, 3]], ids=["batch 1", "decode", "mixed"])
def test_a_layers_k_and_v_in_one_kv_tensor_are_gathered_together_with_the_same_results(
        query_lens: list[int]) -> None:
    # The engine's V cache follows its K cache in memory: both are gathered in one index, bit for bit as apart.
    contexts = [13, 5, 21, 9][: len(query_lens)]
    batch = build_paged_batch(contexts, query_lens, num_heads=4, num_kv_heads=2, head_dim=8, block_size=4,
                              dtype=torch.bfloat16, generator=torch.Generator().manual_seed(12))
    kv_tensor = torch.stack((batch.k_cache, batch.v_cache, torch.full_like(batch.k_cache, float("nan"))))
    assert reference._cache_pair(kv_tensor[0], kv_tensor[1]) is not None
    assert reference._cache_pair(kv_tensor[1], kv_tensor[0]) is None
    assert reference._cache_pair(batch.k_cache, batch.v_cache) is None
    apart = kernels.paged_attention(*batch.args())
    together = kernels.paged_attention(batch.query, kv_tensor[0], kv_tensor[1], *batch.args()[3:])
    assert torch.equal(apart, together)


def test_sequences_share_a_call_while_their_padded_k_v_fits_the_budget() -> None:
    # Sorted contexts 3, 4, 9, 30 in blocks of 4, 10 bytes per token: padded 4, 4, 12, 32 tokens.
    assert reference._groups([3, 4, 9, 30], 4, 10, budget=400) == [(0, 3), (3, 4)]
    assert reference._groups([3, 4, 9, 30], 4, 10, budget=10**6) == [(0, 4)]
    assert reference._groups([3, 4, 9, 30], 4, 10, budget=1) == [(0, 1), (1, 2), (2, 3), (3, 4)]


def test_each_prefill_call_pads_its_chunks_to_its_own_longest_not_the_steps(monkeypatch) -> None:
    # A short prompt and a long one in separate calls (a 1-byte budget): the short one's call computes its
    # 3 query rows, not the 40 of the step's longest chunk, and both still equal the oracle.
    monkeypatch.setattr(reference, "GATHER_BUDGET_BYTES", 1)
    batch = build_paged_batch([3, 40], [3, 40], num_heads=4, num_kv_heads=2, head_dim=8, block_size=4,
                              generator=torch.Generator().manual_seed(7))
    plan = reference._plan(batch.query.shape[0], batch.k_cache.shape, 4, batch.block_tables, batch.context_lens,
                           batch.cu_seqlens_q)
    assert [group.q_len for group in plan] == [3, 40]
    torch.testing.assert_close(kernels.paged_attention(*batch.args()),
                               reference.paged_attention_per_sequence(*batch.args()), atol=1e-5, rtol=1e-5)


def _store_sequence(keys: torch.Tensor, values: torch.Tensor, block_size: int) -> tuple[torch.Tensor, ...]:
    """One sequence's K/V stored with store_kv into a fresh cache with pages in reverse order."""
    num_tokens, num_kv_heads, head_dim = keys.shape
    num_blocks = -(-num_tokens // block_size)
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    table = torch.arange(num_blocks - 1, -1, -1, dtype=torch.int32)
    positions = torch.arange(num_tokens)
    slots = table[positions // block_size].to(torch.int64) * block_size + positions % block_size
    kernels.store_kv(keys, values, k_cache, v_cache, slots)
    return k_cache, v_cache, table[None, :]


def test_page_size_1_and_16_give_the_same_attention() -> None:
    generator = torch.Generator().manual_seed(7)
    keys, values = torch.randn(37, 2, 16, generator=generator), torch.randn(37, 2, 16, generator=generator)
    query = torch.randn(5, 8, 16, generator=generator)
    common = (torch.tensor([37], dtype=torch.int32), torch.tensor([0, 5], dtype=torch.int32), 5, 0.25)
    outputs = []
    for block_size in (1, 16):
        k_cache, v_cache, table = _store_sequence(keys, values, block_size)
        outputs.append(kernels.paged_attention(query, k_cache, v_cache, table, *common))
    torch.testing.assert_close(outputs[0], outputs[1], atol=1e-6, rtol=1e-6)


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_store_kv_writes_each_kept_token_to_its_slot_and_nothing_else(data: st.DataObject) -> None:
    num_blocks, block_size = data.draw(st.integers(1, 5)), data.draw(st.sampled_from([1, 8, 16]))
    num_slots = num_blocks * block_size
    slots = data.draw(st.lists(st.integers(0, num_slots - 1), unique=True, max_size=min(num_slots, 20)))
    slots = [data.draw(st.sampled_from([slot, -1])) for slot in slots]
    slot_dtype = data.draw(st.sampled_from([torch.int32, torch.int64]))
    keys, values = torch.randn(len(slots), 2, 8), torch.randn(len(slots), 2, 8)
    k_cache, v_cache = torch.randn(num_blocks, block_size, 2, 8), torch.randn(num_blocks, block_size, 2, 8)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for token, slot in enumerate(slots):
        if slot >= 0:
            expected_k[slot // block_size, slot % block_size] = keys[token]
            expected_v[slot // block_size, slot % block_size] = values[token]
    kernels.store_kv(keys, values, k_cache, v_cache, torch.tensor(slots, dtype=slot_dtype))
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def test_zero_blocks_clears_every_cache_of_the_listed_blocks_only() -> None:
    kv_cache = torch.randn(6, 9, 8, 2, 16, dtype=torch.bfloat16)
    before = kv_cache.clone()
    kernels.zero_blocks(kv_cache, [4, 0, 4, 8])
    targeted = [0, 4, 8]
    others = [block for block in range(9) if block not in targeted]
    assert torch.count_nonzero(kv_cache.view(torch.int16)[:, targeted]) == 0
    assert torch.equal(kv_cache.view(torch.int16)[:, others], before.view(torch.int16)[:, others])
    assert kernels.find_residue(kv_cache, range(9)) == others


def test_find_residue_sees_negative_zero_and_reports_each_dirty_id_once() -> None:
    kv_cache = torch.zeros(4, 5, 8, 1, 16)
    kv_cache[3, 2, 7, 0, 15] = -0.0  # equal to 0.0 as a float, but its sign byte is residue
    kv_cache[0, 4, 0, 0, 0] = 1.0
    assert kernels.find_residue(kv_cache, [4, 2, 1, 2, 4]) == [4, 2]
    assert kernels.find_residue(kv_cache, torch.tensor([0, 1, 3], dtype=torch.int32)) == []


def test_inside_one_forward_the_layers_share_one_attention_plan(monkeypatch) -> None:
    # The plan depends on the step's metadata only: each layer's call reuses the first one's, with the same results.
    plans = []
    make_plan = reference._plan
    monkeypatch.setattr(reference, "_plan", lambda *args: plans.append(1) or make_plan(*args))
    batch = build_paged_batch([40, 9, 33, 1], [1, 9, 5, 1], num_heads=8, num_kv_heads=2, head_dim=16, block_size=4,
                              generator=torch.Generator().manual_seed(4))
    alone = [kernels.paged_attention(*batch.args()) for _ in range(3)]
    assert len(plans) == 3
    with kernels.one_forward():
        shared = [kernels.paged_attention(*batch.args()) for _ in range(3)]
    assert len(plans) == 4
    for separate, together in zip(alone, shared):
        assert torch.equal(separate, together)
    kernels.paged_attention(*batch.args())  # the memo ends with the forward
    assert len(plans) == 5
