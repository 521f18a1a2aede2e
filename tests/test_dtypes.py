"""`--dtype auto` resolution (baton/dtypes.py) with injected CPU flag sets."""
from __future__ import annotations

import pytest
import torch

from baton.dtypes import cpu_flags, resolve_dtype

EPYC_AVX2 = {"fpu", "sse2", "avx", "avx2", "fma", "f16c"}
XEON_SPR = EPYC_AVX2 | {"avx512f", "avx512bw", "avx512_bf16", "avx512_fp16", "amx_bf16",
                        "amx_tile", "amx_int8"}


@pytest.mark.parametrize("flags,want", [
    (EPYC_AVX2, "float32"),
    (EPYC_AVX2 | {"avx512f", "avx512bw"}, "float32"),  # AVX-512 without bf16 dot products
    (EPYC_AVX2 | {"avx512f", "avx512_bf16"}, "bfloat16"),  # e.g. Cooper Lake, Zen 4
    (EPYC_AVX2 | {"amx_bf16", "amx_tile"}, "bfloat16"),
    (XEON_SPR, "bfloat16"),
    (set(), "float32"),
])
def test_auto_on_cpu_follows_the_bf16_flags(flags, want):
    assert resolve_dtype("auto", "cpu", flags) == want


@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_auto_on_cuda_is_bf16_whatever_the_host_cpu(device):
    assert resolve_dtype("auto", device, EPYC_AVX2) == "bfloat16"


@pytest.mark.parametrize("name", ["float32", "bfloat16", "float16"])
def test_explicit_names_pass_through(name):
    assert resolve_dtype(name, "cpu", XEON_SPR) == name
    assert resolve_dtype(name, "cuda", set()) == name


def test_bad_names_raise():
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("fp8", "cpu", set())
    with pytest.raises(ValueError, match="device"):
        resolve_dtype("auto", "tpu", set())


def test_cpu_flags_read_the_cpuinfo_flags_line(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: X\nflags\t\t: fpu avx2 avx512_bf16 amx_bf16\n"
                    "bugs\t\t: none\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert cpu_flags(info) == {"fpu", "avx2", "avx512_bf16", "amx_bf16"}
    assert resolve_dtype("auto", "cpu", cpu_flags(info)) == "bfloat16"


def test_cpu_flags_without_cpuinfo_fall_back_to_torch(tmp_path):
    flags = cpu_flags(tmp_path / "missing")
    assert flags <= {"avx512_bf16", "amx_bf16"}  # only what torch's probes can report


def test_this_machine_agrees_with_torchs_own_probe():
    """/proc/cpuinfo against torch's independent cpuid probe (cpuinfo library)."""
    bf16 = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert resolve_dtype("auto", "cpu") == ("bfloat16" if bf16 else "float32")
