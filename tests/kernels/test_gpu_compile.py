"""Every Triton kernel compiles for a real GPU (sm_90, through ptxas), not only in the interpreter.

The interpreter accepts code that the compiler rejects (and the reverse), and this machine has no
GPU, so a fresh interpreter without TRITON_INTERPRET compiles each kernel ahead of time for an
H100-class target with the SmolLM2 constexprs its launcher uses (3:1 GQA, head size 64, bf16).
Compiled kernels land in Triton's cache, so reruns are fast.
"""
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from importlib import import_module

# `kernels.write_kv` etc. are the dispatcher functions (re-exported): fetch the modules themselves.
write_kv, paged_decode_attention, prefill_attention, block_copy, norm_act = (
    import_module(f"kernels.{name}")
    for name in ("write_kv", "paged_decode_attention", "prefill_attention", "block_copy", "norm_act")
)

INT32_PTRS = {"block_tables_ptr", "context_lens_ptr", "query_start_loc_ptr", "seq_lens_ptr"}


def arg_type(name):
    if name in INT32_PTRS:
        return "*i32"
    if name in ("slot_ptr", "ids_ptr"):
        return "*i64"
    if name.endswith("_ptr"):
        return "*bf16"
    return "fp32" if name in ("qk_scale", "eps") else "i32"


def compile_for_gpu(fn, num_warps, **constexprs):
    signature = {n: "constexpr" if n in constexprs else arg_type(n) for n in fn.arg_names}
    indexed = {(fn.arg_names.index(n),): v for n, v in constexprs.items()}
    src = ASTSource(fn=fn, signature=signature, constexprs=indexed)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    assert kernel.asm["cubin"], fn.__name__


compile_for_gpu(write_kv._write_kv_kernel, 4, H=3, D=64, H_P=4, D_P=64)
for block_m in (16, 32):  # one token a row; a speculative row of up to 10 tokens × 3 heads
    compile_for_gpu(paged_decode_attention._paged_decode_kernel, 4, GROUP=3, BLOCK_M=block_m, D=64,
                    D_P=64, BLOCK_N=paged_decode_attention._BLOCK_N, DOT_PREC="tf32")
compile_for_gpu(prefill_attention._prefill_kernel, 8, GROUP=3, BLOCK_Q=21, BLOCK_M=64, D=64, D_P=64,
                BLOCK_N=prefill_attention._BLOCK_N, DOT_PREC="tf32")
compile_for_gpu(block_copy._copy_blocks_kernel, 4, GATHER=True, CHUNK=block_copy._CHUNK)
for has_r in (True, False):
    compile_for_gpu(norm_act._add_rms_norm_kernel, 4, HAS_R=has_r, BLOCK=1024)
compile_for_gpu(norm_act._silu_mul_kernel, 4, BLOCK=norm_act._SILU_BLOCK)
print("ok")
"""


def test_kernels_compile_for_sm90():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env.pop("TRITON_INTERPRET", None)
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-4000:]
