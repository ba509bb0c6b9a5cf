"""The residue check: which listed KV blocks hold any non-zero byte, computed where the blocks lie.

Both backends against residue planted byte by byte (the Triton kernel on a CPU in the interpreter), and the
reference's bound on what it copies at once, measured with the torch profiler.
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
from kernels import reference  # noqa: E402

BACKENDS = ["reference", "triton"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _plant_byte(kv_cache: torch.Tensor, cache: int, block: int, byte: int, value: int) -> None:
    """Set one raw byte of one block of one cache (the block's bytes in memory order)."""
    kv_cache[cache, block].view(-1).view(torch.uint8)[byte] = value


def _check(backend: str, kv_cache: torch.Tensor, listed: list[int]) -> tuple[list[int], int]:
    with kernels.force(backend):
        return kernels.find_residue(kv_cache, listed), int(kernels.count_residue(kv_cache, listed))


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_both_backends_find_exactly_the_blocks_holding_a_planted_byte(data: st.DataObject) -> None:
    num_caches, num_blocks = 2 * data.draw(st.integers(1, 3)), data.draw(st.integers(1, 8))
    block_size, num_kv_heads = data.draw(st.sampled_from([1, 3, 8])), data.draw(st.integers(1, 2))
    head_dim, dtype = data.draw(st.sampled_from([5, 16])), data.draw(st.sampled_from(DTYPES))  # 5: odd half words
    kv_cache = torch.zeros(num_caches, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=DEVICE)
    block_bytes = kv_cache[0, 0].numel() * kv_cache.element_size()
    dirty = set()
    for _ in range(data.draw(st.integers(0, 4))):
        block = data.draw(st.integers(0, num_blocks - 1))
        _plant_byte(kv_cache, data.draw(st.integers(0, num_caches - 1)), block,
                    data.draw(st.integers(0, block_bytes - 1)), data.draw(st.integers(1, 255)))
        dirty.add(block)
    listed = data.draw(st.lists(st.integers(0, num_blocks - 1), max_size=12))
    ids = torch.tensor(listed, dtype=data.draw(st.sampled_from([torch.int32, torch.int64])))
    expected = [block for block in dict.fromkeys(listed) if block in dirty]
    for backend in BACKENDS:
        with kernels.force(backend):
            assert kernels.find_residue(kv_cache, ids) == expected, backend
            assert int(kernels.count_residue(kv_cache, ids)) == len(expected), backend
            flags = kernels.residue_flags(kv_cache, ids)
        assert flags.tolist() == [int(block in expected) for block in range(num_blocks)], backend


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_negative_zero_is_residue(backend: str, dtype: torch.dtype) -> None:
    kv_cache = torch.zeros(4, 6, 4, 2, 8, dtype=dtype, device=DEVICE)
    kv_cache[1, 4, 2, 1, 3] = -0.0
    assert _check(backend, kv_cache, [0, 4, 5, 4]) == ([4], 1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_one_nonzero_byte_in_the_last_layers_v_of_the_last_block_is_residue(backend: str, dtype: torch.dtype) -> None:
    kv_cache = torch.zeros(2 * 3, 5, 4, 2, 16, dtype=dtype, device=DEVICE)  # cache 5 is the last layer's V
    last_byte = kv_cache[0, 0].numel() * kv_cache.element_size() - 1
    _plant_byte(kv_cache, 5, 4, last_byte, 1)
    assert _check(backend, kv_cache, list(range(5))) == ([4], 1)
    assert _check(backend, kv_cache, [0, 1, 2, 3]) == ([], 0)


def test_the_count_stays_on_the_caches_device() -> None:
    kv_cache = torch.zeros(2, 3, 4, 1, 8, device=DEVICE)
    count = kernels.count_residue(kv_cache, [0, 2])
    assert count.device == kv_cache.device and count.dim() == 0 and int(count) == 0


def test_the_reference_never_copies_more_than_its_chunk_of_the_listed_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A full pool listed at once must not be copied at once (that asked a node for 61 GiB)."""
    from torch.profiler import ProfilerActivity, profile

    kv_cache = torch.zeros(4, 64, 16, 2, 64)  # 2 MiB, 32 KiB per block over the four caches
    _plant_byte(kv_cache, 3, 63, 8191, 1)
    chunk = 64 << 10
    monkeypatch.setattr(reference, "RESIDUE_CHUNK_BYTES", chunk)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiled:
        found = kernels.find_residue(kv_cache, range(64))
    assert found == [63]
    largest = max(event.cpu_memory_usage for event in profiled.events())
    assert 0 < largest <= chunk < kv_cache.numel() * kv_cache.element_size()


def test_out_of_range_ids_are_refused_before_any_read() -> None:
    with pytest.raises(kernels.KernelInputError):
        kernels.count_residue(torch.zeros(2, 3, 4, 1, 8), [0, 3])
