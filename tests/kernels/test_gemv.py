"""The native small-batch GEMV (kernels/gemv.py) against its torch reference.

Tolerance: the classical bound for a dot product summed in any order in fp32 (Higham, Accuracy
and Stability of Numerical Algorithms, §3.1): |fl(x·w) − x·w| ≤ γ_K · Σ_k |x_k w_k| with
γ_K = K·u / (1 − K·u), u = 2^-24, checked per output against an fp64 product. A wrong tail,
row or batch index breaks it by about one |x_k w_k|, far above γ_K·Σ for K ≤ 1536.
"""
from __future__ import annotations

import logging

import pytest
import torch

from kernels import gemv as g

needs_native = pytest.mark.skipif(not g.gemv_available(), reason="native GEMV did not build here")

U = 2.0**-24


def _isas() -> list[int]:
    """Every variant this CPU runs (the scalar loop always; SIMD where the flags allow)."""
    try:
        flags = set(open("/proc/cpuinfo").read().split())
    except OSError:
        flags = set()
    isas = [g.ISA_BEST, g.ISA_SCALAR]
    if "avx2" in flags and "fma" in flags:
        isas.append(g.ISA_AVX2)
    if "avx512f" in flags:
        isas.append(g.ISA_AVX512)
    return isas


def _assert_within_dot_bound(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    exact = x.double() @ w.double().t()
    k = x.shape[1]
    bound = (k * U / (1 - k * U)) * (x.double().abs() @ w.double().abs().t())
    assert y.shape == exact.shape and y.dtype == torch.float32
    excess = ((y.double() - exact).abs() - bound).max().item()
    assert excess <= 0, f"an output exceeds the fp32 dot-product error bound by {excess:.3g}"


def _rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@needs_native
@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize("k", [1, 7, 8, 17, 33, 577, 1000])
@pytest.mark.parametrize("out", [1, 5, 97])
@pytest.mark.parametrize("b", [1, 3, 16])
def test_odd_shapes_every_isa(isa: int, k: int, out: int, b: int) -> None:
    x, w = _rand(b, k, seed=k), _rand(out, k, seed=out + 1)
    _assert_within_dot_bound(g.gemv_native(x, w, isa), x, w)


@needs_native
@pytest.mark.parametrize("out,k", [(960, 576), (576, 576), (3072, 576), (576, 1536), (4099, 576)])
@pytest.mark.parametrize("b", [1, 8])
def test_smollm2_shapes(out: int, k: int, b: int) -> None:
    """SmolLM2's qkv, o, gate_up, down and a scaled-down lm_head, on 1 and 2 threads."""
    x, w = _rand(b, k, seed=1), _rand(out, k, seed=2) * 0.05
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            _assert_within_dot_bound(g.gemv_native(x, w), x, w)
    finally:
        torch.set_num_threads(threads)


@needs_native
@pytest.mark.parametrize("isa", [i for i in _isas() if i != g.ISA_SCALAR])
@pytest.mark.parametrize("b", [1, 4, 5, 7, 8, 12, 16])
@pytest.mark.parametrize("k", [64, 577])
def test_batch_invariant_and_tiles_sum_like_single_rows(isa: int, b: int, k: int) -> None:
    """Each output is one fixed summation (16 lanes over k, then _mm512_reduce_add_ps or
    hsum256): a weight row inside a 4- or 3-row tile gives the bits of the same row alone, and a row of
    x gives the same bits at any batch size (the B rows only share weight loads)."""
    x, w = _rand(b, k, seed=b), _rand(24, k, seed=k)
    y = g.gemv_native(x, w, isa)
    alone = torch.cat([g.gemv_native(x, w[o:o + 1], isa) for o in range(24)], 1)
    assert torch.equal(y, alone)
    assert torch.equal(y[:1], g.gemv_native(x[:1], w, isa))


@needs_native
def test_strided_rows_of_x() -> None:
    """x may be a column slice of a wider buffer (row stride > in_features)."""
    wide, w = _rand(4, 100, seed=3), _rand(9, 70, seed=4)
    x = wide[:, 10:80]
    _assert_within_dot_bound(g.gemv_native(x, w), x, w)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dispatch_native_up_to_max_rows_torch_above(dtype: torch.dtype) -> None:
    w = _rand(33, 40, seed=5).to(dtype)
    assert g.max_rows() == (g.MAX_ROWS if g._load().has_avx512() else g.MAX_ROWS_AVX2)
    assert g.max_rows(torch.bfloat16) == (g.MAX_ROWS_BF16 if g._load().has_avx512_bf16()
                                          else g.max_rows())
    small = _rand(g.max_rows(dtype), 40, seed=6).to(dtype)
    big = _rand(g.max_rows(dtype) + 1, 40, seed=7).to(dtype)
    assert torch.equal(g.gemv(small, w), g.gemv_native(small, w))
    assert torch.equal(g.gemv(big, w), g.gemv_ref(big, w))
    half = small.double()  # other dtypes take torch's path
    assert torch.equal(g.gemv(half, w.double()), g.gemv_ref(half, w.double()))


@needs_native
def test_launcher_rejects_bad_inputs() -> None:
    x, w = _rand(2, 16, seed=8), _rand(8, 16, seed=9)
    with pytest.raises(AssertionError, match="fp32"):
        g.gemv_native(x.double(), w.double())
    with pytest.raises(AssertionError, match="contiguous"):
        g.gemv_native(x, _rand(16, 8, seed=10).t())
    with pytest.raises(AssertionError, match="must be"):
        g.gemv_native(x, _rand(8, 15, seed=11))


@needs_native
def test_a_built_library_is_imported_without_the_builder(monkeypatch, tmp_path) -> None:
    def no_builder(*args, **kwargs):
        raise AssertionError("torch's builder ran although the library was built")

    import torch.utils.cpp_extension as cpp

    monkeypatch.setattr(cpp, "load", no_builder)
    monkeypatch.setattr(g, "_ext", None)
    monkeypatch.setattr(g, "_tried", False)
    assert g.gemv_available()
    assert g._import_built(tmp_path) is None  # an empty folder: nothing to import
    (tmp_path / "baton_gemv.so").write_bytes((g.build_dir() / "baton_gemv.so").read_bytes())
    (tmp_path / "lock").touch()  # another process is still building there
    assert g._import_built(tmp_path) is None
    (tmp_path / "lock").unlink()
    assert g._import_built(tmp_path) is not None


def test_failed_build_falls_back_to_torch(monkeypatch, caplog) -> None:
    monkeypatch.setattr(g, "_ext", None)
    monkeypatch.setattr(g, "_tried", False)
    monkeypatch.setattr(g, "_max_rows", None)
    monkeypatch.setattr(g, "_import_built", lambda folder: None)  # as on a fresh machine
    monkeypatch.setattr(g, "_ninja_on_path", lambda: False)
    x, w = _rand(1, 12, seed=12), _rand(5, 12, seed=13)
    with caplog.at_level(logging.WARNING, logger=g.__name__):
        assert not g.gemv_available()
        assert torch.equal(g.gemv(x, w), g.gemv_ref(x, w))
        g.gemv_available()
    assert len([r for r in caplog.records if "unavailable" in r.message]) == 1
    with pytest.raises(RuntimeError, match="unavailable"):
        g.gemv_native(x, w)
