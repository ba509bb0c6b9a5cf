"""The Triton kernels compile to Hopper machine code (sm_90 cubin) without a GPU, with the memory access
patterns their speed depends on: K/V tiles stream through 16-byte asynchronous copies, the score and P.V
products run on tensor cores, and stores are 16 bytes wide. This is what CI can check of the compiled path
on a CPU-only machine; `tests/test_kernels_gpu.py` runs the compiled kernels where a GPU exists.

The compiler runs in a child process with TRITON_INTERPRET unset, since other kernel tests in this process
switch Triton to its interpreter.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
KERNELS = ("decode", "prefill", "merge", "store_kv", "zero_blocks")


def _compile_all(out_dir: Path) -> None:
    """Child process: write each kernel's PTX to out_dir/<name>.ptx (cubin is built too, by ptxas)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels import triton_paged_attention as attention
    from kernels import triton_store_kv as store
    from kernels import triton_zero_blocks as zero

    attention_types = {name: "*bf16" for name in ("query_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")}
    attention_types |= {name: "*i32" for name in ("block_tables_ptr", "context_lens_ptr", "cu_seqlens_ptr")}
    attention_types |= {name: "*fp32" for name in ("part_out_ptr", "part_max_ptr", "part_sum_ptr")}
    attention_types |= {name: "i32" for name in ("num_blocks", "partition_size", "query_token_stride",
                                                 "query_head_stride", "out_token_stride", "out_head_stride",
                                                 "table_stride", "out_token_stride")}
    attention_types["scale_log2"] = "fp32"
    llama_3_8b = dict(NUM_KV_HEADS=8, GROUP=4, HEAD_DIM=128, DIM_PAD=128, BLOCK_SIZE=16, TILE=64,
                      PRECISION="tf32", UPCAST=False)
    jobs = {
        "decode": (attention._decode_kernel, attention_types, dict(llama_3_8b, GROUP_PAD=16, NUM_SPLITS=4)),
        "prefill": (attention._prefill_kernel, attention_types, dict(llama_3_8b, QUERY_TILE=16, ROWS=64)),
        "merge": (attention._merge_kernel, attention_types,
                  dict(NUM_HEADS=32, HEAD_DIM=128, DIM_PAD=128, NUM_SPLITS=9, SPLITS_PAD=16)),
        "store_kv": (store._store_kv_kernel,
                     {"key_ptr": "*fp16", "value_ptr": "*fp16", "k_cache_ptr": "*fp16", "v_cache_ptr": "*fp16",
                      "slot_ptr": "*i64", "num_slots": "i32", "key_token_stride": "i32", "key_head_stride": "i32",
                      "value_token_stride": "i32", "value_head_stride": "i32"},
                     dict(NUM_KV_HEADS=8, HEAD_DIM=128, HEADS_PAD=8, DIM_PAD=128)),
        "zero_blocks": (zero._zero_blocks_kernel,
                        {"cache_ptr": "*i32", "block_id_ptr": "*i64", "num_ids": "i32", "num_blocks": "i32",
                         "block_words": "i32"}, dict(CHUNK=2048)),
    }
    for name, (fn, types, constants) in jobs.items():
        signature = {arg: "constexpr" if arg in constants else types[arg] for arg in fn.arg_names}
        # What a launch specialises for 16-byte aligned pointers and multiple-of-16 strides and sizes.
        aligned = {(index,): [["tt.divisibility", 16]] for index, arg in enumerate(fn.arg_names)
                   if arg not in constants and (types[arg].startswith("*") or arg.endswith(("stride", "words")))}
        compiled = triton.compile(ASTSource(fn, signature, constexprs=constants, attrs=aligned),
                                  target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3})
        assert compiled.asm["cubin"], f"ptxas produced no machine code for {name}"
        (out_dir / f"{name}.ptx").write_text(compiled.asm["ptx"])


@pytest.fixture(scope="module")
def ptx(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    out_dir = tmp_path_factory.mktemp("ptx")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    child = subprocess.run([sys.executable, __file__, str(out_dir)], env=env, capture_output=True, text=True,
                           timeout=300)
    assert child.returncode == 0, child.stderr[-4000:]
    return {name: (out_dir / f"{name}.ptx").read_text() for name in KERNELS}


@pytest.mark.parametrize("kernel", ["decode", "prefill"])
def test_attention_streams_kv_through_async_copies_into_tensor_cores(ptx: dict[str, str], kernel: str) -> None:
    code = ptx[kernel]
    assert re.search(r"cp\.async\.cg\.shared\.global[^\n]*0x10[,;]", code), "K/V tiles are not copied 16 bytes at a time"
    assert "ld.global.b16" not in code, "scalar 2-byte loads on the K/V path"
    assert re.search(r"(mma|wgmma)[.\w]*bf16", code), "the dot products do not use tensor cores"


@pytest.mark.parametrize("kernel", ["store_kv", "zero_blocks"])
def test_cache_writes_are_16_bytes_wide(ptx: dict[str, str], kernel: str) -> None:
    assert "st.global.v4.b32" in ptx[kernel]
    assert not re.search(r"st\.global\.b(8|16)\b", ptx[kernel]), "narrow stores on the cache write path"


def test_merge_kernel_compiles(ptx: dict[str, str]) -> None:
    assert ".entry _merge_kernel" in ptx["merge"]


if __name__ == "__main__":
    sys.path.insert(0, str(REPO_ROOT))
    _compile_all(Path(sys.argv[1]))
