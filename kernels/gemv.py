"""Small-batch fp32 / bf16 GEMV on CPU for decode steps, streaming (out, in) weights once per step.

    x [B, in], B <= max_rows() (16–64)        w [out, in], contiguous (laid out once at load)
    y [B, out] = x @ w.T                      each y[b, o] = one contiguous dot product over w[o]
    fp32: x, w, y fp32                        bf16: x, w, y bf16, fp32 sums, y rounded once

Batch-1 decode is bound by reading every weight once per step. On the AMD EPYC VM of issue 17
torch/MKL's fp32 GEMV read 11–16 GB/s while llama.cpp's CPU backend streamed ~22 GB/s on one
thread. `kernels/csrc/gemv.cpp` follows ggml's f32 path (`ggml_vec_dot_f32`: independent SIMD
accumulators per dot product, rows split contiguously over threads): tiles of 4 weight rows,
taken from 4 distant quarters of a thread's rows (4 sequential streams) and prefetching the
next tile, times up to 3 (AVX2) or 4 (AVX-512) rows of x, so every weight vector loaded feeds up
to 16 FMA chains and B rows read the weights once. Threads: `torch.get_num_threads()`
(at::parallel_for). Measured with benchmarks/cpu_gemv.py (see BENCHMARKS.md).

The extension is compiled on first use with `torch.utils.cpp_extension.load` (needs `ninja` and a
C++ compiler) into `~/.cache/baton/ext/gemv-<hash of source, torch version, machine>`, then
reused. One build serves every x86-64 CPU: its AVX-512 / AVX2+FMA variants are selected at run
time from the CPU's flags, with a scalar loop elsewhere. If the build fails, `gemv_available()`
is False (logged once) and callers keep the torch path; nothing raises.

bf16 (`kernels/csrc/gemv_bf16.cpp`): torch's bf16 linear semantics (fp32 sums of exact bf16
products, one round-to-nearest-even at the end) in one fixed summation order shared by its
AVX512_BF16 (`_mm512_dpbf16_ps`), AVX2 (bf16 widened in registers) and scalar variants, so a
row's result does not depend on the batch, the tiling or the thread count (`gemv_bf16_order_ref`
replays that order in torch), and the variants agree bit for bit (AVX512_BF16 excepted for
subnormals, which it flushes). On CPUs with AMX a bf16 model runs `kernels/gemv_amx.py`
instead (tile products over re-laid weights; baton/models/linear.py chooses per machine).
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import platform
import shutil
from pathlib import Path

import torch

MAX_ROWS = 16  # rows the AVX-512 kernel takes (issue 17's Intel VM; above: torch's GEMM)
# AVX2 (no AVX-512): the native kernel beats torch's GEMM up to ~96 rows (AMD EPYC, fp32
# SmolLM2-135M's 121 matrices, `python benchmarks/gemv_rows.py`, quiet, best of 3: 20 rows
# 59.4 vs 111.5 ms, 36 rows 101.9 vs 159.4, 64 rows 177.7 vs 204.5, 96 rows 281.9 vs 296.8,
# 128 rows 352.3 vs 326.3), so speculative verify steps and short prefill chunks stay on it;
# bf16 on such CPUs (torch's bf16 GEMM is slow there) takes the same limit, unmeasured
MAX_ROWS_AVX2 = 64
# bf16 on CPUs with AVX512_BF16 (Zen 4 VM, SmolLM2-135M's 121 matrices streamed, `python
# benchmarks/gemv_rows.py --dtype bfloat16`, best of 3, two runs): native vs torch's oneDNN GEMM
# 16 rows 26.0 vs 42.6 ms, 24 rows 37.9 vs 48.7, 32 rows 44.6 vs 54.7 and 43.9 vs 43.1, 48 rows
# 62.9 vs 74.8 and 62.2 vs 58.2: native to 32 rows (a spec verify step of 4 rows x (1 + 7))
MAX_ROWS_BF16 = 32
ISA_BEST, ISA_SCALAR, ISA_AVX2, ISA_AVX512, ISA_AVX512_BF16 = 0, 1, 2, 3, 4
_NATIVE_DTYPES = (torch.float32, torch.bfloat16)

_SOURCE = Path(__file__).parent / "csrc" / "gemv.cpp"
# one extension: gemv.cpp's module init also registers the ops of gemv_bf16.cpp, gemv_amx.cpp
# and gemm_amx.cpp (kernels/gemv_amx.py), cpu_decode.cpp
# and cpu_norm.cpp (used by kernels/cpu_decode.py), cpu_verify.cpp (kernels/cpu_verify.py) and
# cpu_prefill.cpp (kernels/cpu_prefill.py), cpu_sample.cpp (kernels/cpu_sample.py), cpu_rope.cpp
# (kernels/cpu_rope.py); the build key hashes the headers too
_SOURCES = [_SOURCE, _SOURCE.parent / "gemv_bf16.cpp", _SOURCE.parent / "gemv_amx.cpp",
            _SOURCE.parent / "gemm_amx.cpp",
            _SOURCE.parent / "cpu_decode.cpp",
            _SOURCE.parent / "cpu_norm.cpp", _SOURCE.parent / "cpu_verify.cpp",
            _SOURCE.parent / "cpu_prefill.cpp", _SOURCE.parent / "cpu_sample.cpp",
            _SOURCE.parent / "cpu_rope.cpp"]
_HASHED = _SOURCES + [_SOURCE.parent / n for n in ("simd_exp.h", "isa.h", "bf16.h",
                                                  "scores_bf16.h", "kv_pack.h", "prefill_amx.h",
                                                  "amx.h", "release_gil.h", "kv_pacer.h")]
_log = logging.getLogger(__name__)
_ext = None
_tried = False
_max_rows: int | None = None
_max_rows_bf16 = [0]


def gemv_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Torch reference and fallback: x [B, in] @ w[out, in].T → [B, out], same dtype."""
    return x @ w.t()


def gemv_bf16_order_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The native bf16 GEMV's exact arithmetic in torch (slow; for tests): x [B, in] bf16 @
    w [out, in].T bf16 → [B, out] bf16. k in chunks of 32, zero-padded; fp32 lane j (of 16) adds
    the product of element 32c + 2j + 1, then that of 32c + 2j (exact bf16 products, one
    rounding per add: the order of AVX512_BF16's VDPBF16PS); lanes summed as a tree (j + 8, j + 4,
    j + 2, j + 1); the fp32 sum rounded to bf16 (nearest even) once."""
    k = x.shape[1]
    pad = -k % 32
    xf = torch.nn.functional.pad(x.float(), (0, pad)).view(x.shape[0], 1, -1, 16, 2)
    wf = torch.nn.functional.pad(w.float(), (0, pad)).view(1, w.shape[0], -1, 16, 2)
    lanes = torch.zeros(x.shape[0], w.shape[0], 16)
    for c in range(xf.shape[2]):
        lanes = lanes + xf[:, :, c, :, 1] * wf[:, :, c, :, 1]
        lanes = lanes + xf[:, :, c, :, 0] * wf[:, :, c, :, 0]
    for half in (8, 4, 2, 1):
        lanes = lanes[..., :half] + lanes[..., half:2 * half]
    return lanes[..., 0].to(torch.bfloat16)


def build_dir() -> Path:
    """Cache folder of this source's build: keyed by the sources' bytes, torch version,
    machine; under $BATON_CACHE_DIR (as the model cache: a container's volume) or
    ~/.cache/baton. Raises OSError when a source file is missing (a package without them)."""
    key = hashlib.sha256(b"".join(f.read_bytes() for f in _HASHED) + torch.__version__.encode()
                         + platform.machine().encode()).hexdigest()[:16]
    root = Path(os.environ.get("BATON_CACHE_DIR", Path.home() / ".cache" / "baton"))
    return root / "ext" / f"gemv-{key}"


def _ninja_on_path() -> bool:
    """Make a `ninja` visible to torch's builder: PATH's, else PyPI `ninja`'s bundled binary
    (a venv's bin folder is not on PATH when its python is called directly)."""
    if shutil.which("ninja"):
        return True
    try:
        import ninja  # PyPI package: a ninja binary inside site-packages
    except ImportError:
        return False
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    return shutil.which("ninja") is not None


def _import_built(folder: Path):
    """The extension already built in `folder` (its name carries the source hash, so a present
    library is this source's), imported without torch's builder (~1.5 s of up-to-date checks
    saved per process); None if absent, unloadable, or still being built by another process
    (torch's builder holds `lock` in the folder meanwhile; it then waits for that build)."""
    lib = folder / "baton_gemv.so"
    if not lib.is_file() or (folder / "lock").exists():
        return None
    try:
        spec = importlib.util.spec_from_file_location("baton_gemv", lib)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except Exception:  # e.g. a library left half-written: rebuild through torch
        return None


def _load():
    """Import the built extension, compiling it the first time; None, logged once, on failure."""
    global _ext, _tried
    if _tried:
        return _ext
    _tried = True
    try:
        folder = build_dir()
        _ext = _import_built(folder)
        if _ext is not None:
            return _ext
        if not _ninja_on_path():
            raise RuntimeError("ninja not found (pip install ninja)")
        from torch.utils.cpp_extension import load

        folder.mkdir(parents=True, exist_ok=True)
        _ext = load(name="baton_gemv", sources=[str(f) for f in _SOURCES],
                    build_directory=str(folder),
                    extra_cflags=["-O3", "-fopenmp", "-ffp-contract=off"],
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # any build or import failure means "use torch"
        _log.warning("native CPU GEMV unavailable, using torch matmul: %s", exc)
        _ext = None
    return _ext


def extension():
    """The built extension module (compiled on the first call), or None where it cannot be
    built; callers that call its kernels directly (baton/models/linear.py) skip `gemv`'s
    Python checks, and the extension checks its inputs itself."""
    return _load()


def gemv_available() -> bool:
    """True once the native extension is built and imported (builds it on the first call)."""
    return _load() is not None


def amx_available() -> bool:
    """True when the extension is built and this CPU and OS allow AMX tiles (amx.h's one check,
    which implies AVX512_BF16): the AMX GEMV (kernels/gemv_amx.py) and the prefill attention's
    AMX item (kernels/cpu_prefill.py) run here."""
    ext = _load()
    return ext is not None and bool(ext.has_amx())


def _run(ext, x: torch.Tensor, w: torch.Tensor, isa: int) -> torch.Tensor:
    out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype)
    (ext.gemv_out if x.dtype == torch.float32 else ext.gemv_bf16_out)(x, w, out, isa)
    return out


def gemv_native(x: torch.Tensor, w: torch.Tensor, isa: int = ISA_BEST) -> torch.Tensor:
    """Native launcher: x [B, in] CPU (unit inner stride) @ w [out, in].T → [B, out], all fp32
    or all bf16 (bf16: fp32 sums, rounded once; see gemv_bf16_order_ref).

    `w` must be contiguous; `isa` forces a variant (fp32: ISA_SCALAR / ISA_AVX2 / ISA_AVX512;
    bf16: ISA_SCALAR / ISA_AVX2 / ISA_AVX512_BF16; for tests; RuntimeError if the CPU lacks it
    or the dtype has no such variant). Asserts what it needs to read memory safely; the
    extension re-checks. Raises RuntimeError if the extension is unavailable.
    """
    ext = _load()
    if ext is None:
        raise RuntimeError("native CPU GEMV is unavailable (see the log)")
    assert x.dim() == 2 and w.dim() == 2 and x.shape[1] == w.shape[1], (
        f"x {tuple(x.shape)} and w {tuple(w.shape)} must be [B, in] and [out, in]")
    assert x.dtype == w.dtype and x.dtype in _NATIVE_DTYPES, (
        f"fp32 or bf16 only, one dtype, got {x.dtype} and {w.dtype}")
    assert w.is_contiguous() and x.stride(1) == 1, "w must be contiguous, x unit-stride in `in`"
    return _run(ext, x, w, isa)


def max_rows(dtype: torch.dtype = torch.float32) -> int:
    """Most rows of x of `dtype` the native kernel takes on this CPU (`MAX_ROWS` with
    AVX-512, `MAX_ROWS_AVX2` without; bf16 with AVX512_BF16 `MAX_ROWS_BF16`); 0 when the
    extension is unavailable."""
    global _max_rows
    if _max_rows is None:
        ext = _load()
        _max_rows = 0 if ext is None else (MAX_ROWS if ext.has_avx512() else MAX_ROWS_AVX2)
        if ext is not None and ext.has_avx512_bf16():
            _max_rows_bf16[0] = MAX_ROWS_BF16
        else:
            _max_rows_bf16[0] = _max_rows
    return _max_rows_bf16[0] if dtype == torch.bfloat16 else _max_rows


def gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [B, in] @ w [out, in].T → [B, out]: the native kernel for fp32 or bf16 CPU x with
    B <= max_rows(x.dtype) when it is available, torch's matmul otherwise (prefill, other dtypes,
    CUDA, no build)."""
    if (x.dtype in _NATIVE_DTYPES and x.dtype == w.dtype and not x.is_cuda and x.dim() == 2
            and x.stride(1) == 1 and _load() is not None and x.shape[0] <= max_rows(x.dtype)):
        return _run(_ext, x, w, ISA_BEST)
    return gemv_ref(x, w)
