"""The compiled CPU paged attention (`kernels.cpu_decode.paged_attention`): a step's new tokens, decode and
prefill alike, over their sequences' paged K/V, read in place.

Oracles: a naive float64 softmax reading one position at a time, and the eager reference kernel one sequence
at a time (`reference.paged_attention_per_sequence`), on the same Hypothesis-drawn batches the reference is
checked with: ragged contexts, GQA groups, block sizes 1 to 16, idle sequences, stale table entries. Head
sizes 64 and 128 take the kernel's unrolled paths, the others its general one.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kernels
from kernels import cpu_decode, reference
from kernels.errors import KernelInputError
from kernels.paged_batch import PagedBatch, build_paged_batch
from tests.paged_attention_support import OUTPUT_TOLERANCE, batches, naive_attention

pytestmark = pytest.mark.skipif(not cpu_decode.supported_cpu(), reason="the compiled kernels need AVX-512 BF16")

NATIVE_DTYPES = (torch.bfloat16, torch.float32)


def _native(batch: PagedBatch) -> torch.Tensor:
    assert cpu_decode.covers_attention(*batch.args()[:6])
    return cpu_decode.paged_attention(*batch.args())


@settings(max_examples=60, deadline=None)
@given(st.booleans().flatmap(lambda decode: batches(decode=decode)).filter(lambda b: b.query.dtype in NATIVE_DTYPES))
def test_the_compiled_attention_matches_naive_softmax_and_the_per_sequence_oracle(batch: PagedBatch) -> None:
    out = _native(batch)
    assert out.dtype == batch.query.dtype and out.shape == batch.query.shape
    tolerance = OUTPUT_TOLERANCE[batch.query.dtype]
    torch.testing.assert_close(out.double(), naive_attention(batch), atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(out, reference.paged_attention_per_sequence(*batch.args()), atol=tolerance,
                               rtol=tolerance)


@pytest.mark.parametrize("dtype", NATIVE_DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [14, 64, 128, 160])
def test_every_head_size_path_matches_the_oracle(head_dim: int, dtype: torch.dtype) -> None:
    # 64 and 128 unroll a head's sums into registers; 14 leaves a masked tail; 160 spans two passes of 128.
    # Contexts cross several 16-token blocks and the 16-token score tiles, with decode tokens, chunks, an idle one.
    batch = build_paged_batch([70, 33, 16, 1, 129, 45], [1, 33, 5, 1, 0, 1], num_heads=8, num_kv_heads=2,
                              head_dim=head_dim, block_size=16, dtype=dtype, stale_id=10**6,
                              generator=torch.Generator().manual_seed(head_dim))
    tolerance = OUTPUT_TOLERANCE[dtype]
    torch.testing.assert_close(_native(batch), reference.paged_attention_per_sequence(*batch.args()),
                               atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("query_lens", [[1, 1, 1, 1], [1, 5, 1, 3]], ids=["decode", "decode and prefill"])
def test_no_slot_past_a_tokens_own_position_is_read(query_lens: list[int]) -> None:
    # The slots past each context in its last block, the blocks no sequence holds and the table's entries past
    # a context all point at NaN: any read of them would reach the output.
    contexts = [13, 5, 21, 9]
    batch = build_paged_batch(contexts, query_lens, num_heads=4, num_kv_heads=2, head_dim=8, block_size=4,
                              dtype=torch.bfloat16, spare_blocks=3, generator=torch.Generator().manual_seed(11))
    held = {int(batch.block_tables[s, i]) for s, context in enumerate(contexts) for i in range(-(-context // 4))}
    free = sorted(set(range(batch.k_cache.shape[0])) - held)
    for cache in (batch.k_cache, batch.v_cache):
        cache[free] = float("nan")
        for seq, context in enumerate(contexts):
            cache[int(batch.block_tables[seq, (context - 1) // 4]), (context - 1) % 4 + 1:] = float("nan")
    for seq, context in enumerate(contexts):
        batch.block_tables[seq, -(-context // 4):] = free[0]
    out = _native(batch)
    assert not out.isnan().any()
    torch.testing.assert_close(out, reference.paged_attention_per_sequence(*batch.args()),
                               atol=OUTPUT_TOLERANCE[torch.bfloat16], rtol=OUTPUT_TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize("dtype", NATIVE_DTYPES, ids=str)
def test_the_same_bits_on_one_thread_and_two(dtype: torch.dtype) -> None:
    # 1 token (its heads split between the threads), 3 and 40 tokens (whole tokens each).
    threads = torch.get_num_threads()
    try:
        for query_lens in ([1], [1, 1, 1], [1] * 30 + [10]):
            contexts = [50 + 7 * i for i in range(len(query_lens))]
            batch = build_paged_batch(contexts, query_lens, num_heads=8, num_kv_heads=4, head_dim=64, block_size=16,
                                      dtype=dtype, generator=torch.Generator().manual_seed(len(query_lens)))
            torch.set_num_threads(1)
            one = _native(batch)
            torch.set_num_threads(2)
            assert torch.equal(one, _native(batch))
    finally:
        torch.set_num_threads(threads)


def _decode_batch() -> PagedBatch:
    return build_paged_batch([9, 20], [1, 1], num_heads=4, num_kv_heads=2, head_dim=16, block_size=4,
                             generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("field, corrupt, message", [
    ("cu_seqlens_q", lambda t: t.fill_(0), "cu_seqlens_q"),
    ("cu_seqlens_q", lambda t: t.copy_(torch.tensor([0, 2, 1], dtype=torch.int32)), "cu_seqlens_q"),
    ("context_lens", lambda t: t.fill_(10**6), "context_lens"),
    ("context_lens", lambda t: t.fill_(0), "context_lens"),
    ("block_tables", lambda t: t.fill_(10**6), "block_tables"),
    ("block_tables", lambda t: t.fill_(-1), "block_tables"),
], ids=["no tokens", "offsets out of order", "context past the table", "empty context", "block past the cache",
        "padding id inside a context"])
def test_bad_step_metadata_is_refused_by_name(field: str, corrupt, message: str) -> None:
    # The kernel reads every index it follows from these; each is checked before any is followed.
    batch = _decode_batch()
    corrupt(getattr(batch, field))
    with pytest.raises(KernelInputError, match=message):
        cpu_decode.paged_attention(*batch.args())


def test_the_default_cpu_backend_runs_bf16_and_float32_attention_compiled_and_float16_eagerly(monkeypatch) -> None:
    calls: list[torch.dtype] = []
    compiled = cpu_decode.paged_attention
    monkeypatch.setattr(cpu_decode, "paged_attention", lambda *args: calls.append(args[0].dtype) or compiled(*args))
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        batch = build_paged_batch([9, 20], [1, 4], num_heads=4, num_kv_heads=2, head_dim=16, block_size=4,
                                  dtype=dtype, generator=torch.Generator().manual_seed(4))
        out = kernels.paged_attention(*batch.args())
        tolerance = OUTPUT_TOLERANCE[dtype]
        torch.testing.assert_close(out, reference.paged_attention_per_sequence(*batch.args()), atol=tolerance,
                                   rtol=tolerance)
        with kernels.force("reference"):
            kernels.paged_attention(*batch.args())
    assert calls == [torch.bfloat16, torch.float32]
