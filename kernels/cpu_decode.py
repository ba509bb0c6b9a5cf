"""The decoder's batch-1 decode forward and the paged attention of every step, compiled for the CPU
(`kernels/cpu_decode.c`): building them, running them.

A CPU decode step of one sequence is bound by reading every weight once, and through torch's eager ops it
ran at about 43% of that floor on the `bench` model (about 2.75 ms of oneDNN products plus 1.9 ms of small
ops and their Python, per step): `benchmarks/engine_host.py`. The C forward streams each product's weights
once with AVX-512 BF16 dot products and runs a layer's small ops between them on cached data, in one OpenMP
region of torch's own runtime. It covers exactly one case, the commonest on a CPU node: one sequence's one
new token, bf16 weights and KV cache, on a CPU with AVX-512 BF16. Every other forward (prefill, batches,
speculative verification, float32) runs the eager model as before.

The attention of those other forwards runs compiled too (`paged_attention`, bf16 or float32 K/V): the eager
kernel gathers each layer's pages of a step's sequences into one padded copy and attends under a mask, which
took about two fifths of the `engine_throughput.py` workload in bf16; the C kernel reads each token's context
in place through the block table, 16 tokens' scores at a time.

It is the `native` kernel backend (`kernels.dispatch`): the default on such a CPU, `force("reference")` or
`VEIL_KERNELS=reference` turns it off (the eager forward is its test oracle). It is compiled when a bf16 or
float32 model loads (`engine.loader`), in about a second, with the machine's C compiler (`CC`, else `cc`), into a cache folder
(`VEIL_KERNEL_CACHE`, else `~/.cache/veil/kernels`), keyed by the source, flags and compiler: like Triton's
kernels on a GPU, the code that runs is this package's source, built where it runs. Where it cannot be
built (no compiler, no OpenMP runtime in torch), the default falls back to the eager forward and
`build().reason` says why; an explicit `VEIL_KERNELS=native` then refuses instead.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from kernels.errors import KernelBackendError, KernelInputError

SOURCE = Path(__file__).with_name("cpu_decode.c")
FLAGS = ("-O3", "-std=gnu11", "-fPIC", "-shared", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl",
         "-mavx512bf16", "-mfma")
COMPILE_TIMEOUT_S = 300  # a hang, not a speed: the build takes about a second

# Return codes of veil_decode_one, as the C source numbers them.
_ERRORS = {
    1: "cu_seqlens_q must be [0, 1] for one sequence's one new token",
    2: "positions holds a position outside the rotary caches",
    3: "slot_mapping holds a slot outside the cache",
    4: "context_lens holds a context longer than block_tables can address, or empty",
    5: "block_tables holds a block id outside the cache within the sequence's context",
    6: "no memory for the forward's activations",
}


class _Dims(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in (
        "hidden", "intermediate", "layers", "heads", "kv_heads", "head_dim", "num_blocks", "block_size",
        "table_width", "max_positions", "threads", "vocab")] + [("eps", ctypes.c_double), ("scale", ctypes.c_double)]


class _AttentionDims(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in (
        "heads", "kv_heads", "head_dim", "block_size", "num_blocks", "table_width", "table_stride", "seqs", "tokens",
        "query_stride", "threads", "bf16")] + [("scale", ctypes.c_double)]


class _Step(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in ("position", "slot", "context", "query_offsets", "block_table")]


@dataclass(frozen=True, slots=True)
class Build:
    """The compiled library, or None and why not."""

    library: ctypes.CDLL | None
    reason: str


def supported_cpu() -> bool:
    """Whether this CPU runs the compiled forward: AVX-512 with BF16 dot products."""
    return torch.cpu._is_avx512_bf16_supported()


@functools.cache
def build() -> Build:
    """The library, compiled on the first call of the process (or found already built in the cache folder)."""
    if not supported_cpu():
        return Build(None, "this CPU has no AVX-512 BF16")
    runtime = _openmp_runtime()
    if runtime is None:
        return Build(None, "torch has loaded no OpenMP runtime (libgomp) for the compiled forward to share")
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return Build(None, "no C compiler (set CC, or install gcc)")
    try:
        path = _compiled(compiler, runtime)
        library = ctypes.CDLL(str(path))
    except KernelBackendError as error:
        return Build(None, str(error))
    except OSError as error:  # built, but the loader refuses it (a missing symbol, another architecture)
        return Build(None, f"cannot load {path.name}: {type(error).__name__}")
    library.veil_decode_one.restype = ctypes.c_int
    library.veil_decode_one.argtypes = [ctypes.POINTER(_Dims)] + [ctypes.c_void_p] * 11
    library.veil_paged_attention.restype = ctypes.c_int
    library.veil_paged_attention.argtypes = [ctypes.POINTER(_AttentionDims)] + [ctypes.c_void_p] * 7
    library.veil_product.restype = None
    library.veil_product.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3
    return Build(library, f"compiled at {path}")


def _openmp_runtime() -> Path | None:
    """The OpenMP runtime torch runs its threads on, as loaded in this process: the one to link against."""
    try:
        with open("/proc/self/maps", encoding="ascii", errors="replace") as maps:
            for line in maps:
                name = line.rsplit(maxsplit=1)[-1]
                if Path(name).name.startswith("libgomp"):
                    return Path(name)
    except OSError:
        return None
    return None


def _cache_folder() -> Path:
    configured = os.environ.get("VEIL_KERNEL_CACHE")
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "veil" / "kernels"


def _compiled(compiler: str, runtime: Path) -> Path:
    """The shared library for this source, flags, compiler and runtime: built once, then found by its digest.
    Where the cache folder cannot be created or written (a read-only home), it is built into a private
    temporary folder of this process instead, removed at exit: slower to start, never refused."""
    key = hashlib.sha256(SOURCE.read_bytes())
    for part in (*FLAGS, compiler, str(runtime)):
        key.update(b"\0" + part.encode())
    name = f"cpu_decode-{key.hexdigest()[:16]}.so"
    folder = _cache_folder()
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        partial = _partial_file(folder, name)
    except OSError:
        folder = Path(tempfile.mkdtemp(prefix="veil-kernels-"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        partial = _partial_file(folder, name)
    target = folder / name
    if partial is None:
        return target  # built before, by this user
    command = [compiler, *FLAGS, "-o", partial, str(SOURCE), str(runtime), f"-Wl,-rpath,{runtime.parent}", "-lm"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S, check=False)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no message"])[-1]
            raise KernelBackendError(f"compiling {SOURCE.name} with {compiler} failed: {last}")
        os.replace(partial, target)  # atomic: a process beside this one finds the whole file or none
    except (OSError, subprocess.TimeoutExpired) as error:
        raise KernelBackendError(f"compiling {SOURCE.name} with {compiler} failed: {type(error).__name__}") from None
    finally:
        Path(partial).unlink(missing_ok=True)
    return target


def _partial_file(folder: Path, name: str) -> str | None:
    """A new file in `folder` to build `name` into, or None where `name` is there already; the folder and
    the library must be private to this user (KernelBackendError), and OSError where it cannot be written."""
    _check_private(folder)
    target = folder / name
    if target.is_file():
        _check_private(target)
        return None
    handle, partial = tempfile.mkstemp(prefix=target.stem, suffix=".so.partial", dir=folder)
    os.close(handle)
    return partial


def _check_private(path: Path) -> None:
    """A library found by its name is loaded into the process: only this user may have written it (as ssh
    treats its keys), else anyone who could write the folder could run code inside the node."""
    status = path.stat()
    if status.st_uid != os.getuid() or status.st_mode & 0o022:
        raise KernelBackendError(f"the kernel cache {path} is writable by another user; use a private folder "
                                 "(VEIL_KERNEL_CACHE)")


def library() -> ctypes.CDLL:
    """The compiled library, or KernelBackendError saying why there is none (for an explicit `native`)."""
    built = build()
    if built.library is None:
        raise KernelBackendError(f"the native CPU decode is not available: {built.reason}")
    return built.library


@dataclass(slots=True)
class DecodePlan:
    """A model's weights as the C forward reads them: built once per model, dropped when its tensors move."""

    dims: _Dims
    weights: ctypes.Array
    final_norm: Tensor
    cos_cache: Tensor
    sin_cache: Tensor
    kept: tuple[Tensor, ...]  # every tensor a pointer in `weights` points into, alive as long as the plan
    head: Tensor | None  # the output head [vocab, hidden] where the C forward can read it (`forward(logits=True)`)
    head_bias: Tensor | None


def plan_for(model: torch.nn.Module) -> DecodePlan | None:
    """The plan of a `LlamaFamilyForCausalLM` whose every weight the C forward can read (bf16, contiguous, on the
    CPU), or None: then its decode runs eagerly."""
    config = model.config
    layers = list(model.model.layers)
    rotary = model.rotary
    if (not layers or config.head_dim % 2 or config.num_attention_heads % config.num_key_value_heads
            or rotary.cos_cache.dtype != torch.bfloat16 or rotary.sin_cache.dtype != torch.bfloat16):
        return None
    pointers: list[int] = []
    kept: list[Tensor] = []
    for layer in layers:
        for tensor in _layer_weights(layer):
            if tensor is not None and not _readable(tensor):
                return None
            pointers.append(0 if tensor is None else tensor.data_ptr())
            kept += [] if tensor is None else [tensor]
    final_norm = model.model.norm.weight
    if not all(_readable(t) for t in (final_norm, rotary.cos_cache, rotary.sin_cache)):
        return None
    dims = _Dims(hidden=config.hidden_size, intermediate=config.intermediate_size, layers=len(layers),
                 heads=config.num_attention_heads, kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
                 max_positions=rotary.cos_cache.shape[0], eps=config.rms_norm_eps,
                 scale=layers[0].self_attn.scale)
    weights = (ctypes.c_void_p * len(pointers))(*pointers)
    head, head_bias = model.lm_head.weight, model.lm_head.bias
    if not (_readable(head) and head.shape[1] == config.hidden_size and (head_bias is None or _readable(head_bias))):
        head = head_bias = None
    dims.vocab = 0 if head is None else head.shape[0]
    return DecodePlan(dims, weights, final_norm, rotary.cos_cache, rotary.sin_cache, tuple(kept), head, head_bias)


def _layer_weights(layer: torch.nn.Module) -> list[Tensor | None]:
    """One decoder layer's tensors in the C source's W_* order (W_PER_LAYER of them)."""
    attention, mlp = layer.self_attn, layer.mlp
    q_norm = attention.q_norm.weight if attention.q_norm is not None else None
    k_norm = attention.k_norm.weight if attention.k_norm is not None else None
    return [layer.input_layernorm.weight, attention.qkv_proj.weight, attention.qkv_proj.bias, q_norm, k_norm,
            attention.o_proj.weight, attention.o_proj.bias, layer.post_attention_layernorm.weight,
            mlp.gate_up_proj.weight, mlp.gate_up_proj.bias, mlp.down_proj.weight, mlp.down_proj.bias]


def _readable(tensor: Tensor) -> bool:
    return tensor.device.type == "cpu" and tensor.dtype == torch.bfloat16 and tensor.is_contiguous()


def covers(input_ids: Tensor, kv_cache: Tensor, block_tables: Tensor, context_lens: Tensor, positions: Tensor,
           slot_mapping: Tensor, cu_seqlens_q: Tensor) -> bool:
    """Whether a forward over these step inputs is the one the C forward runs: one sequence's one new token,
    kept in the cache (a slot of -1 skips it: the eager forward handles that), inputs laid out as the engine
    builds them. Reads metadata only; the values are checked in C."""
    return (input_ids.shape[0] == 1 and block_tables.dim() == 2 and block_tables.shape[0] == 1
            and kv_cache.dtype == torch.bfloat16 and kv_cache.device.type == "cpu" and kv_cache.dim() == 5
            and kv_cache.is_contiguous() and block_tables.dtype == torch.int32 and block_tables.stride(1) == 1
            and context_lens.dtype == torch.int32 and context_lens.shape == (1,)
            and cu_seqlens_q.dtype == torch.int32 and cu_seqlens_q.shape == (2,)
            and positions.dtype == torch.int64 and positions.shape == (1,)
            and slot_mapping.dtype == torch.int64 and slot_mapping.shape == (1,)
            and int(slot_mapping[0]) >= 0)


def forward(plan: DecodePlan, embedded: Tensor, kv_cache: Tensor, block_tables: Tensor, context_lens: Tensor,
            positions: Tensor, slot_mapping: Tensor, cu_seqlens_q: Tensor, logits: bool = False) -> Tensor:
    """The final hidden state [1, hidden] of the one new token whose embedding is `embedded` [1, hidden]; its
    K and V are written into `kv_cache` at its slot in every layer (see `covers` for the inputs).

    `logits`: returns instead the output head's logits [1, vocab] in float32 (`compute_logits` of that hidden
    state, the same values), computed in the same call; the plan must have the head (`plan.head`)."""
    dims = plan.dims
    expected = (2 * dims.layers, kv_cache.shape[1], kv_cache.shape[2], dims.kv_heads, dims.head_dim)
    if tuple(kv_cache.shape) != expected or embedded.dtype != torch.bfloat16:
        raise KernelInputError(f"the KV tensor [{', '.join(map(str, kv_cache.shape))}] does not fit the model: "
                               f"expected [{', '.join(map(str, expected))}] in bfloat16")
    dims.num_blocks, dims.block_size, dims.table_width = kv_cache.shape[1], kv_cache.shape[2], block_tables.shape[1]
    dims.threads = torch.get_num_threads()
    embedded = embedded.contiguous()
    step = _Step(positions.data_ptr(), slot_mapping.data_ptr(), context_lens.data_ptr(), cu_seqlens_q.data_ptr(),
                 block_tables.data_ptr())
    if logits:
        if plan.head is None:
            raise KernelInputError("the compiled forward cannot read this model's output head")
        out = torch.empty((1, dims.vocab), dtype=torch.float32)
        head = (None, plan.head.data_ptr(), None if plan.head_bias is None else plan.head_bias.data_ptr(), out.data_ptr())
    else:
        out = torch.empty((1, dims.hidden), dtype=torch.bfloat16)
        head = (out.data_ptr(), None, None, None)
    status = library().veil_decode_one(ctypes.byref(dims), ctypes.addressof(plan.weights), plan.final_norm.data_ptr(),
                                       kv_cache.data_ptr(), plan.cos_cache.data_ptr(), plan.sin_cache.data_ptr(),
                                       ctypes.addressof(step), embedded.data_ptr(), *head)
    if status != 0:
        raise KernelInputError(_ERRORS.get(status, f"the native decode failed (code {status})"))
    return out


def can_project(hidden: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """Whether `project` computes `F.linear(hidden, weight, bias)`: one bf16 row on the CPU, weights it can read."""
    return (hidden.dim() == 2 and hidden.shape[0] == 1 and hidden.shape[1] == weight.shape[1] and _readable(hidden)
            and _readable(weight) and (bias is None or _readable(bias)))


def project(hidden: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """`F.linear(hidden, weight, bias)` for one bf16 row (`can_project`), as the forward's own products sum:
    the output head of a batch-1 decode, streamed as the layers' weights are."""
    out = torch.empty((1, weight.shape[0]), dtype=torch.bfloat16)
    library().veil_product(weight.data_ptr(), 0 if bias is None else bias.data_ptr(), hidden.data_ptr(),
                           out.data_ptr(), weight.shape[0], weight.shape[1], torch.get_num_threads())
    return out


def covers_attention(query: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, context_lens: Tensor,
                     cu_seqlens_q: Tensor) -> bool:
    """Whether `paged_attention` computes this `kernels.paged_attention` call: K/V/queries all bf16 or all
    float32 on the CPU, laid out as the engine builds them (a layer's caches are views into the KV tensor,
    each block contiguous; the queries a view of the qkv product). Reads metadata only; the values (offsets,
    contexts, block ids) are checked in C."""
    dtype = k_cache.dtype
    return (dtype in (torch.bfloat16, torch.float32) and query.dtype == dtype and v_cache.dtype == dtype
            and query.device.type == k_cache.device.type == v_cache.device.type == "cpu"
            and query.dim() == 3 and query.stride(2) == 1 and query.stride(1) == query.shape[2]
            and k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
            and block_tables.dtype == torch.int32 and block_tables.dim() == 2 and block_tables.stride(1) == 1
            and context_lens.dtype == torch.int32 and context_lens.is_contiguous()
            and cu_seqlens_q.dtype == torch.int32 and cu_seqlens_q.is_contiguous()
            and context_lens.shape == (block_tables.shape[0],) and cu_seqlens_q.shape == (block_tables.shape[0] + 1,))


_ATTENTION_ERRORS = {
    1: "cu_seqlens_q must split the step's tokens among the sequences in order",
    4: "context_lens holds a context longer than block_tables can address, or shorter than its new tokens",
    5: "block_tables holds a block id outside the cache within a sequence's context",
    6: "no memory for the attention's scores",
}


def paged_attention(query: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, context_lens: Tensor,
                    cu_seqlens_q: Tensor, max_seqlen_q: int, scale: float) -> Tensor:
    """`kernels.paged_attention` on the CPU (`covers_attention`): each new token over its sequence's context up
    to its own position, read in place from the paged cache by the compiled kernel; rounded as the eager
    kernel rounds (in bf16, SDPA's bf16 softmax weights). `max_seqlen_q` is not needed: the offsets say it."""
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    tokens, heads = query.shape[0], query.shape[1]
    dims = _AttentionDims(heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size,
                          num_blocks=num_blocks, table_width=block_tables.shape[1],
                          table_stride=block_tables.stride(0), seqs=block_tables.shape[0], tokens=tokens,
                          query_stride=query.stride(0), threads=torch.get_num_threads(),
                          bf16=int(k_cache.dtype == torch.bfloat16), scale=scale)
    out = torch.empty((tokens, heads, head_dim), dtype=query.dtype)
    status = library().veil_paged_attention(ctypes.byref(dims), query.data_ptr(), k_cache.data_ptr(),
                                            v_cache.data_ptr(), block_tables.data_ptr(), context_lens.data_ptr(),
                                            cu_seqlens_q.data_ptr(), out.data_ptr())
    if status != 0:
        raise KernelInputError(_ATTENTION_ERRORS.get(status, f"the native attention failed (code {status})"))
    return out
