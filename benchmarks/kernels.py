"""KV-path kernels: decode attention bandwidth and the price of zeroing freed blocks, each against a baseline
measured in the same run.

On CUDA (H100/H200), Llama-3-8B head shapes (32 query heads, 8 KV heads, head_dim 128, fp16, block 16):
  1. decode paged attention for batch 64 x context 2048 and batch 8 x context 16384: achieved HBM
     bandwidth (K/V bytes read per call / time), % of the device's peak, and the ratio to torch's
     scaled_dot_product_attention over K/V already gathered into dense tensors (and with the gather);
  2. zero_blocks over 512 scattered blocks of a 32-layer cache: GB/s against the torch ways of zeroing the
     same blocks (one `zero_()` per block, `index_fill_`) and against a plain memset (`zero_()` of one
     contiguous tensor of the same byte count).
Targets: decode attention >= 70% of peak bandwidth; zero_blocks >= 80% of the plain memset.

On a CPU it runs the torch reference path (the CPU production path) on small shapes, in a few seconds, on
one thread (a shared CI machine's thread pool otherwise turns timings into scheduler noise).

    python benchmarks/kernels.py [--iters N]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernels  # noqa: E402
from kernels.paged_batch import PagedBatch, build_paged_batch  # noqa: E402

# Peak HBM bandwidth by device name, GB/s (vendor figures).
PEAK_BANDWIDTH_GBPS = (("H200", 4800.0), ("H100 PCIe", 2000.0), ("H100", 3350.0))
ATTENTION_TARGET, ZEROING_TARGET = 0.70, 0.80


@dataclass(frozen=True, slots=True)
class Shape:
    """A decode workload: batch x context with Llama-3-8B heads unless stated."""

    batch: int
    context: int
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16


GPU_SHAPES = (Shape(64, 2048), Shape(8, 16384))
CPU_SHAPES = (Shape(4, 256, num_heads=8, num_kv_heads=2, head_dim=64), Shape(1, 1024, num_heads=8, num_kv_heads=2, head_dim=64))


def timed(fn: Callable[[], object], device: torch.device, iters: int, rounds: int = 3) -> float:
    """Seconds per call: the best of `rounds` means over `iters` back-to-back calls, after two warm-up calls.

    The best round is the one least disturbed by other work on the machine.
    """
    fn()
    fn()
    return min(_mean_seconds(fn, device, iters) for _ in range(rounds))


def _mean_seconds(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    started = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - started) / iters


def peak_bandwidth(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BANDWIDTH_GBPS if key in name), None)


def gbps(num_bytes: int, seconds: float) -> float:
    return num_bytes / seconds / 1e9


def kv_bytes(batch: PagedBatch) -> int:
    """Bytes decode attention must read: every context token's K and V for its KV heads, plus q and out."""
    per_token = 2 * batch.k_cache.shape[2] * batch.k_cache.shape[3] * batch.k_cache.element_size()
    return int(batch.context_lens.sum()) * per_token + 2 * batch.query.numel() * batch.query.element_size()


def gathered(batch: PagedBatch, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense [batch, kv_heads, context, head_dim] K and V gathered from the pages (all contexts equal)."""
    tables = batch.block_tables.long()
    def gather(cache: torch.Tensor) -> torch.Tensor:
        pages = cache[tables].flatten(1, 2)[:, :context]
        return pages.transpose(1, 2).contiguous()
    return gather(batch.k_cache), gather(batch.v_cache)


def sdpa_decode(batch: PagedBatch, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Dense decode attention: a group's query heads ride as query rows of their KV head (no K/V repeat)."""
    seqs, kv_heads = keys.shape[0], keys.shape[1]
    queries = batch.query.view(seqs, kv_heads, -1, batch.query.shape[2])
    return F.scaled_dot_product_attention(queries, keys, values, scale=batch.scale).reshape(batch.query.shape)


def bench_decode(shape: Shape, device: torch.device, dtype: torch.dtype, iters: int) -> None:
    batch = build_paged_batch([shape.context] * shape.batch, [1] * shape.batch, num_heads=shape.num_heads,
                              num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim, block_size=shape.block_size,
                              dtype=dtype, device=device, spare_blocks=0, spare_table_columns=0)
    keys, values = gathered(batch, shape.context)
    paged_out = kernels.paged_attention(*batch.args())
    dense_out = sdpa_decode(batch, keys, values)
    error = (paged_out.float() - dense_out.float()).abs().max().item()
    paged = timed(lambda: kernels.paged_attention(*batch.args()), device, iters)
    dense = timed(lambda: sdpa_decode(batch, keys, values), device, iters)
    with_gather = timed(lambda: sdpa_decode(batch, *gathered(batch, shape.context)), device, max(1, iters // 4))
    num_bytes, peak = kv_bytes(batch), peak_bandwidth(device)
    print(f"decode attention  batch {shape.batch:3d} x context {shape.context:5d}  "
          f"({num_bytes / 1e6:.0f} MB of K/V, backend {kernels.selected_backend(device)}, max |paged - sdpa| {error:.1e})")
    print(f"  paged_attention        {paged * 1e6:10.1f} us  {gbps(num_bytes, paged):8.1f} GB/s"
          + (f"  {gbps(num_bytes, paged) / peak:6.1%} of {peak:.0f} GB/s peak"
             f"  [target >= {ATTENTION_TARGET:.0%}: {'met' if gbps(num_bytes, paged) / peak >= ATTENTION_TARGET else 'NOT met'}]"
             if peak else ""))
    print(f"  sdpa, K/V pre-gathered {dense * 1e6:10.1f} us  {gbps(num_bytes, dense):8.1f} GB/s   paged / sdpa speed {dense / paged:5.2f}x")
    print(f"  gather + sdpa          {with_gather * 1e6:10.1f} us  {gbps(num_bytes, with_gather):8.1f} GB/s   paged / (gather + sdpa) {with_gather / paged:5.2f}x")


def bench_zeroing(device: torch.device, dtype: torch.dtype, iters: int, small: bool) -> None:
    layers, num_blocks, freed = (4, 64, 16) if small else (32, 2048, 512)
    shape = Shape(1, 1) if not small else Shape(1, 1, num_kv_heads=2, head_dim=64)
    kv_cache = torch.ones(2 * layers, num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim,
                          dtype=dtype, device=device)
    ids = torch.randperm(num_blocks)[:freed].sort().values
    ids_list = ids.tolist()
    device_ids = ids.to(device)
    num_bytes = 2 * layers * freed * kv_cache[0, 0].numel() * kv_cache.element_size()
    plain = torch.empty(num_bytes, dtype=torch.uint8, device=device)

    def per_block() -> None:
        for block_id in ids_list:
            kv_cache[:, block_id].zero_()

    results = {
        "zero_blocks": timed(lambda: kernels.zero_blocks(kv_cache, ids), device, iters),
        "torch zero_() per block": timed(per_block, device, max(1, iters // 4)),
        "torch index_fill_": timed(lambda: kv_cache.index_fill_(1, device_ids, 0), device, iters),
        "plain memset, same bytes": timed(plain.zero_, device, iters),
    }
    print(f"zero freed blocks  {freed} of {num_blocks} blocks x {2 * layers} caches = {num_bytes / 1e6:.0f} MB "
          f"(backend {kernels.selected_backend(device)})")
    memset = results["plain memset, same bytes"]
    for label, seconds in results.items():
        print(f"  {label:26s} {seconds * 1e6:10.1f} us  {gbps(num_bytes, seconds):8.1f} GB/s  "
              f"{memset / seconds:6.1%} of memset")
    share = memset / results["zero_blocks"]
    print(f"  zero_blocks vs memset: {share:.1%}  [target >= {ZEROING_TARGET:.0%}: {'met' if share >= ZEROING_TARGET else 'NOT met'}]")
    assert kernels.find_residue(kv_cache, ids) == [], "zero_blocks left residue"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=None, help="timed calls per measurement")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = device.type == "cuda"
    iters = args.iters or (50 if on_gpu else 10)
    if not on_gpu:
        torch.set_num_threads(1)
    name = torch.cuda.get_device_name(device) if on_gpu else "CPU (torch reference path)"
    peak = peak_bandwidth(device)
    print(f"device: {name}" + (f", peak HBM {peak:.0f} GB/s" if peak else ""))
    torch.manual_seed(0)
    for shape in GPU_SHAPES if on_gpu else CPU_SHAPES:
        bench_decode(shape, device, torch.float16 if on_gpu else torch.float32, iters)
    bench_zeroing(device, torch.float16 if on_gpu else torch.float32, iters, small=not on_gpu)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
