"""`--dtype auto`: the serving dtype for the device at hand, chosen at run time, never at install.

    CUDA                                   → bfloat16 (nobody serves fp32 on a GPU)
    CPU with AVX512_BF16 or AMX-BF16       → bfloat16 (native bf16 dot products: oneDNN/AMX
                                             prefill 3-5x cheaper, half the decode weight bytes)
    any other CPU (e.g. AVX2-only EPYC)    → float32  (bf16 would be converted in software there:
                                             slower than fp32 for prefill, see shared/PLATFORM.md)

The CPU's flags come from /proc/cpuinfo (Linux names `avx512_bf16`, `amx_bf16`), else from
torch's own cpuinfo probes. An explicit dtype name passes through unchanged.
"""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from baton.config import parse_device, parse_dtype

BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The first processor's flags in `cpuinfo` (Linux); where that file is missing or has no
    flags line, the bf16 flags torch's cpuinfo probes report (`torch.cpu`)."""
    try:
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "flags":
                return frozenset(value.split())
    except OSError:
        pass
    probes = {"avx512_bf16": "_is_avx512_bf16_supported", "amx_bf16": "_is_amx_tile_supported"}
    return frozenset(flag for flag, probe in probes.items()
                     if getattr(torch.cpu, probe, lambda: False)())


def resolve_dtype(name: str, device: str, flags: Iterable[str] | None = None) -> str:
    """The dtype name to serve in: `name` itself unless it is "auto"; for "auto", "bfloat16" on
    CUDA or on a CPU whose flags (default: `cpu_flags()`) include AVX512_BF16 or AMX-BF16, else
    "float32". Raises ValueError for an unknown dtype or device name."""
    if name != "auto":
        parse_dtype(name)
        return name
    if parse_device(device).type == "cuda":
        return "bfloat16"
    have = frozenset(flags) if flags is not None else cpu_flags()
    return "bfloat16" if have & BF16_CPU_FLAGS else "float32"
