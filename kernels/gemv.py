"""Small-batch fp32 GEMV on CPU for decode steps, streaming (out, in) weights once per step.

    x [B, in] fp32, B <= 16 (decode rows)     w [out, in] fp32, contiguous (laid out once at load)
    y [B, out] = x @ w.T                      each y[b, o] = one contiguous dot product over w[o]

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

MAX_ROWS = 16  # above this the step is a prefill: torch's GEMM is at parity there
ISA_BEST, ISA_SCALAR, ISA_AVX2, ISA_AVX512 = 0, 1, 2, 3

_SOURCE = Path(__file__).parent / "csrc" / "gemv.cpp"
# one extension: gemv.cpp's module init also registers the ops of cpu_decode.cpp and
# cpu_norm.cpp (used by kernels/cpu_decode.py) and cpu_verify.cpp (kernels/cpu_verify.py);
# the build key hashes the headers too
_SOURCES = [_SOURCE, _SOURCE.parent / "cpu_decode.cpp", _SOURCE.parent / "cpu_norm.cpp",
            _SOURCE.parent / "cpu_verify.cpp"]
_HASHED = _SOURCES + [_SOURCE.parent / "simd_exp.h", _SOURCE.parent / "isa.h"]
_log = logging.getLogger(__name__)
_ext = None
_tried = False


def gemv_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Torch reference and fallback: x [B, in] @ w[out, in].T → [B, out], same dtype."""
    return x @ w.t()


def build_dir() -> Path:
    """Cache folder of this source's build: keyed by the sources' bytes, torch version, machine."""
    key = hashlib.sha256(b"".join(f.read_bytes() for f in _HASHED) + torch.__version__.encode()
                         + platform.machine().encode()).hexdigest()[:16]
    return Path.home() / ".cache" / "baton" / "ext" / f"gemv-{key}"


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
    _ext = _import_built(build_dir())
    if _ext is not None:
        return _ext
    try:
        if not _ninja_on_path():
            raise RuntimeError("ninja not found (pip install ninja)")
        from torch.utils.cpp_extension import load

        folder = build_dir()
        folder.mkdir(parents=True, exist_ok=True)
        _ext = load(name="baton_gemv", sources=[str(f) for f in _SOURCES],
                    build_directory=str(folder),
                    extra_cflags=["-O3", "-fopenmp", "-ffp-contract=off"],
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # any build or import failure means "use torch"
        _log.warning("native CPU GEMV unavailable, using torch matmul: %s", exc)
        _ext = None
    return _ext


def gemv_available() -> bool:
    """True once the native extension is built and imported (builds it on the first call)."""
    return _load() is not None


def gemv_native(x: torch.Tensor, w: torch.Tensor, isa: int = ISA_BEST) -> torch.Tensor:
    """Native launcher: x [B, in] fp32 CPU (unit inner stride) @ w [out, in].T → [B, out] fp32.

    `w` must be contiguous; `isa` forces a variant (ISA_SCALAR / ISA_AVX2 / ISA_AVX512, for
    tests; RuntimeError if the CPU lacks it). Asserts what it needs to read memory safely; the
    extension re-checks. Raises RuntimeError if the extension is unavailable.
    """
    ext = _load()
    if ext is None:
        raise RuntimeError("native CPU GEMV is unavailable (see the log)")
    assert x.dim() == 2 and w.dim() == 2 and x.shape[1] == w.shape[1], (
        f"x {tuple(x.shape)} and w {tuple(w.shape)} must be [B, in] and [out, in]")
    assert x.dtype == w.dtype == torch.float32, f"fp32 only, got {x.dtype} and {w.dtype}"
    assert w.is_contiguous() and x.stride(1) == 1, "w must be contiguous, x unit-stride in `in`"
    out = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)
    ext.gemv_out(x, w, out, isa)
    return out


def gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [B, in] @ w [out, in].T → [B, out]: the native kernel for fp32 CPU x with B <= MAX_ROWS
    when it is available, torch's matmul otherwise (prefill, other dtypes, CUDA, no build)."""
    if (x.dtype == torch.float32 and x.shape[0] <= MAX_ROWS and not x.is_cuda
            and x.dim() == 2 and x.stride(1) == 1 and _load() is not None):
        out = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)
        _ext.gemv_out(x, w, out, ISA_BEST)
        return out
    return gemv_ref(x, w)
