"""The dispatch point: backend choice, and bad input refused the same way by both backends before any write."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before the lazily imported Triton modules load

import pytest  # noqa: E402

import kernels  # noqa: E402
from kernels import cpu_decode  # noqa: E402
from kernels.paged_batch import build_paged_batch  # noqa: E402

BACKENDS = ["reference", "triton"]
MARKER = 987654  # a distinctive index value that must never appear in an error message


def test_cpu_tensors_use_native_or_the_reference_and_cuda_tensors_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VEIL_KERNELS", raising=False)
    # native: the reference's kernels plus the compiled batch-1 decode, on CPUs with AVX-512 BF16
    assert kernels.selected_backend(torch.device("cpu")) == ("native" if cpu_decode.supported_cpu() else "reference")
    monkeypatch.setattr(cpu_decode, "supported_cpu", lambda: False)
    assert kernels.selected_backend(torch.device("cpu")) == "reference"
    assert kernels.selected_backend(torch.device("cuda", 0)) == "triton"


def test_environment_forces_a_backend_and_force_overrides_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VEIL_KERNELS", "triton")
    assert kernels.selected_backend(torch.device("cpu")) == "triton"
    with kernels.force("reference"):
        assert kernels.selected_backend(torch.device("cuda", 0)) == "reference"
    assert kernels.selected_backend(torch.device("cpu")) == "triton"
    monkeypatch.setenv("VEIL_KERNELS", "reference")
    assert kernels.selected_backend(torch.device("cuda", 0)) == "reference"


def test_unknown_backend_names_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(kernels.KernelBackendError):
        with kernels.force("cuda-graphs"):
            pass
    monkeypatch.setenv("VEIL_KERNELS", "fast")
    with pytest.raises(kernels.KernelBackendError, match="VEIL_KERNELS"):
        kernels.selected_backend(torch.device("cpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter requirement applies to CPU tensors only")
def test_triton_on_cpu_without_the_interpreter_says_what_to_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET")
    kv_cache = torch.ones(2, 2, 8, 1, 16)
    with kernels.force("triton"), pytest.raises(kernels.KernelBackendError, match="TRITON_INTERPRET=1"):
        kernels.zero_blocks(kv_cache, [0])
    assert torch.count_nonzero(kv_cache) == kv_cache.numel()


def test_environment_selected_triton_runs_the_triton_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VEIL_KERNELS", "triton")
    batch = build_paged_batch([9, 20], [1, 1], num_heads=4, num_kv_heads=2, head_dim=16, block_size=8,
                              generator=torch.Generator().manual_seed(1))
    kernels.paged_attention(*batch.args())
    import sys

    assert "kernels.triton_paged_attention" in sys.modules


# --- bad input: each case builds fresh tensors, calls a kernel, and names what must not have changed ---

def _store_case(**changes: object) -> tuple[Callable[[], object], list[torch.Tensor]]:
    parts: dict[str, object] = dict(
        key=torch.randn(3, 2, 16), value=torch.randn(3, 2, 16),
        k_cache=torch.zeros(4, 8, 2, 16), v_cache=torch.zeros(4, 8, 2, 16),
        slot_mapping=torch.tensor([0, 5, -1]),
    )
    parts.update(changes)
    return (lambda: kernels.store_kv(**parts)), [parts["k_cache"], parts["v_cache"]]  # type: ignore[arg-type]


def _attention_case(**changes: object) -> tuple[Callable[[], object], list[torch.Tensor]]:
    batch = build_paged_batch([9, 20], [1, 4], num_heads=4, num_kv_heads=2, head_dim=16, block_size=8,
                              generator=torch.Generator().manual_seed(2))
    parts = dict(zip(["query", "k_cache", "v_cache", "block_tables", "context_lens", "cu_seqlens_q",
                      "max_seqlen_q", "scale"], batch.args()))
    parts.update(changes)
    return (lambda: kernels.paged_attention(**parts)), []  # type: ignore[arg-type]


def _zero_case(block_ids: object, kv_cache: torch.Tensor | None = None) -> tuple[Callable[[], object], list[torch.Tensor]]:
    cache = torch.ones(4, 6, 8, 2, 16) if kv_cache is None else kv_cache
    return (lambda: kernels.zero_blocks(cache, block_ids)), [cache]  # type: ignore[arg-type]


def _table_with(value: int) -> torch.Tensor:
    table = torch.full((2, 4), -1, dtype=torch.int32)
    table[0, :2] = torch.tensor([0, 1])
    table[1, :3] = torch.tensor([2, value, 3])
    return table


BAD_INPUTS: dict[str, Callable[[], tuple[Callable[[], object], list[torch.Tensor]]]] = {
    "store: slot past the cache": lambda: _store_case(slot_mapping=torch.tensor([0, MARKER, -1])),
    "store: slot below -1": lambda: _store_case(slot_mapping=torch.tensor([0, -2, 1])),
    "store: float slots": lambda: _store_case(slot_mapping=torch.tensor([0.0, 1.0, 2.0])),
    "store: slot count differs from tokens": lambda: _store_case(slot_mapping=torch.tensor([0, 1])),
    "store: key dtype differs from cache": lambda: _store_case(key=torch.randn(3, 2, 16).half()),
    "store: head_dim differs": lambda: _store_case(key=torch.randn(3, 2, 8), value=torch.randn(3, 2, 8)),
    "store: k and v caches differ": lambda: _store_case(v_cache=torch.zeros(4, 16, 2, 16)),
    "store: cache not contiguous": lambda: _store_case(k_cache=torch.zeros(8, 4, 2, 16).transpose(0, 1)),
    "store: 3-d cache": lambda: _store_case(k_cache=torch.zeros(32, 2, 16), v_cache=torch.zeros(32, 2, 16)),
    "attention: query dtype differs": lambda: _attention_case(query=torch.randn(5, 4, 16).half()),
    "attention: heads not a multiple of kv heads": lambda: _attention_case(query=torch.randn(5, 3, 16)),
    "attention: int64 block tables": lambda: _attention_case(block_tables=_table_with(4).long()),
    "attention: block id past the cache": lambda: _attention_case(block_tables=_table_with(MARKER)),
    "attention: padding inside a context": lambda: _attention_case(block_tables=_table_with(-1)),
    "attention: context shorter than new tokens": lambda: _attention_case(
        context_lens=torch.tensor([9, 3], dtype=torch.int32)),
    "attention: context past the table": lambda: _attention_case(context_lens=torch.tensor([9, 33], dtype=torch.int32)),
    "attention: offsets do not end at the token count": lambda: _attention_case(
        cu_seqlens_q=torch.tensor([0, 1, 4], dtype=torch.int32)),
    "attention: max_seqlen_q too small": lambda: _attention_case(max_seqlen_q=3),
    "attention: one context per sequence": lambda: _attention_case(context_lens=torch.tensor([9], dtype=torch.int32)),
    "zero: id past the cache, listed with good ones": lambda: _zero_case([1, MARKER, 2]),
    "zero: negative id": lambda: _zero_case(torch.tensor([0, -1])),
    "zero: float ids": lambda: _zero_case(torch.tensor([0.0])),
    "zero: 2-d ids": lambda: _zero_case(torch.tensor([[0, 1]])),
    "zero: not the whole 5-d KV tensor": lambda: _zero_case([0], torch.ones(6, 8, 2, 16)),
    "zero: non-contiguous KV tensor": lambda: _zero_case([0], torch.ones(6, 4, 8, 2, 16).transpose(0, 1)),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_refused_before_anything_is_written(backend: str, case: str) -> None:
    call, guarded = BAD_INPUTS[case]()
    snapshots = [tensor.clone() for tensor in guarded]
    with kernels.force(backend), pytest.raises(kernels.KernelInputError) as raised:
        call()
    message = str(raised.value)
    assert str(MARKER) not in message and "tensor(" not in message
    assert message  # says what was wrong
    for tensor, snapshot in zip(guarded, snapshots):
        assert torch.equal(tensor, snapshot)


def test_input_errors_are_value_errors_of_the_package_hierarchy() -> None:
    assert issubclass(kernels.KernelInputError, ValueError)
    assert issubclass(kernels.KernelInputError, kernels.KernelError)
    assert issubclass(kernels.KernelBackendError, kernels.KernelError)


def test_find_residue_refuses_out_of_range_ids() -> None:
    with pytest.raises(kernels.KernelInputError):
        kernels.find_residue(torch.zeros(2, 3, 8, 1, 16), [3])


def test_empty_inputs_are_no_ops() -> None:
    kv_cache = torch.ones(2, 3, 8, 1, 16)
    kernels.zero_blocks(kv_cache, [])
    assert torch.count_nonzero(kv_cache) == kv_cache.numel()
    assert kernels.find_residue(kv_cache, []) == []
    k_cache = torch.ones(3, 8, 1, 16)
    kernels.store_kv(torch.zeros(0, 1, 16), torch.zeros(0, 1, 16), k_cache, k_cache.clone(), torch.zeros(0, dtype=torch.int64))
    assert torch.count_nonzero(k_cache) == k_cache.numel()


def test_inside_one_forward_a_later_layers_own_tensors_are_still_checked() -> None:
    # The step's metadata is checked by the first layer's calls only; a later layer's own tensors (queries,
    # keys, caches) beside the same metadata are checked all the same, and bad ones refused before any write.
    store = dict(key=torch.randn(3, 2, 16), value=torch.randn(3, 2, 16), k_cache=torch.zeros(4, 8, 2, 16),
                 v_cache=torch.zeros(4, 8, 2, 16), slot_mapping=torch.tensor([0, 5, -1]))
    batch = build_paged_batch([9, 20], [1, 4], num_heads=4, num_kv_heads=2, head_dim=16, block_size=8,
                              generator=torch.Generator().manual_seed(2))
    positions, cos, sin = torch.tensor([0, 3, 7]), torch.randn(8, 8), torch.randn(8, 8)
    with kernels.one_forward():
        kernels.store_kv(**store)
        kernels.paged_attention(*batch.args())
        kernels.rotary_embedding(positions, store["key"], store["value"], cos, sin)
        untouched = torch.zeros(8, 4, 2, 16).transpose(0, 1)
        for bad in ({"key": store["key"].half()}, {"k_cache": untouched, "v_cache": untouched}):
            with pytest.raises(kernels.KernelInputError):
                kernels.store_kv(**{**store, **bad})
        assert torch.count_nonzero(untouched) == 0
        with pytest.raises(kernels.KernelInputError):
            kernels.paged_attention(batch.query.half(), *batch.args()[1:])
        with pytest.raises(kernels.KernelInputError):
            kernels.paged_attention(batch.query[:, :3], *batch.args()[1:])
        with pytest.raises(kernels.KernelInputError):
            kernels.rotary_embedding(positions, store["key"], torch.randn(3, 2, 8), cos, sin)
