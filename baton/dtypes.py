"""The dtypes an engine can run, and what `--dtype auto` means on the machine at hand.

    auto → "bfloat16" on CUDA, and on a CPU with AVX512_BF16 or AMX-BF16 (a bf16 decode step
           reads half the bytes; oneDNN's bf16 GEMM is several times its fp32 one with AMX,
           though not on an Intel CPU without AMX, where the prompt GEMMs then run in fp32:
           baton/models/linear.py);
           "float32" on any other CPU (AVX2-only x86, where bf16 matmuls are emulated and far
           slower than fp32: PLATFORM.md measured 393 ms a step against 61).

Decided at run time, never at install: machines of one kind have been an AMD EPYC with AVX2
only and an Intel Xeon with AMX in successive sessions. No torch import (the gateway and
`baton up` use this too).
"""
from __future__ import annotations

import functools
from collections.abc import Iterable

DTYPES = ("float32", "bfloat16", "float16")
ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


@functools.cache
def cpu_vendor(path: str = "/proc/cpuinfo") -> str:
    """The first CPU's vendor_id ("GenuineIntel", "AuthenticAMD"; "" where there is none)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


@functools.cache
def cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str]:
    """The first CPU's feature flags from /proc/cpuinfo (empty where there is none: auto
    then chooses float32, the dtype every CPU runs well)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def resolve_dtype(name: str, device: str = "cpu", flags: Iterable[str] | None = None) -> str:
    """`name` itself unless it is "auto"; then the module docstring's rule for `device`
    ("cpu", "cuda", "cuda:N"), with `flags` the CPU's (default: this machine's).
    ValueError for a name that is neither "auto" nor in DTYPES, or an unknown device."""
    if name != "auto":
        if name not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {list(DTYPES)}, got {name!r}")
        return name
    kind = device.partition(":")[0]
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {device!r}")
    if kind == "cuda":
        return "bfloat16"
    have = cpu_flags() if flags is None else frozenset(flags)
    return "bfloat16" if have & BF16_CPU_FLAGS else "float32"
