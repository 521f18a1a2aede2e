"""The native bf16 GEMV (kernels/gemv.py, csrc/gemv_bf16.cpp) against torch references.

Tolerances:
- STYLE.md's rule against the fp64 product of the same bf16 inputs:
  max|kernel − ref| ≤ 2·max|torch bf16 − ref| + atol (atol: one bf16 ulp of the largest output).
- Per output, from the algorithm: the fp32 sum s obeys |s − e| ≤ γ_K·Σ|x_k w_k| (any summation
  order, Higham §3.1, γ_K = K·u/(1 − K·u), u = 2^-24; bf16 products are exact in fp32), and one
  rounding to bf16 adds at most 2^-8·|s| (8-bit significand), so |y − e| ≤ 2^-8(|e| + γΣ) + γΣ.
- Bit for bit: the scalar and AVX2 variants against `gemv_bf16_order_ref` (the documented
  summation order replayed in torch). The AVX512_BF16 variant is held to the bounds only:
  VDPBF16PS flushes subnormals, and this order was written from Intel's pseudo-code.
"""
from __future__ import annotations

import pytest
import torch

from kernels import gemv as g

needs_native = pytest.mark.skipif(not g.gemv_available(), reason="native GEMV did not build here")
U32, U_BF16 = 2.0**-24, 2.0**-8


def _flags() -> set[str]:
    try:
        return set(open("/proc/cpuinfo").read().split())
    except OSError:
        return set()


def _variant(isa: int, need: set[str], name: str):
    missing = need - _flags()
    return pytest.param(isa, id=name, marks=pytest.mark.skipif(
        bool(missing), reason=f"this CPU has no {name} variant (flags missing: {sorted(missing)})"))


VARIANTS = [pytest.param(g.ISA_BEST, id="best"), pytest.param(g.ISA_SCALAR, id="scalar"),
            _variant(g.ISA_AVX2, {"avx2", "fma"}, "avx2"),
            _variant(g.ISA_AVX512_BF16, {"avx512_bf16", "avx512bw"}, "avx512_bf16")]
SIMD = VARIANTS[2:]


def _bits_exact(isa: int) -> bool:
    """Whether `isa` (as run here) must equal gemv_bf16_order_ref bit for bit."""
    return isa in (g.ISA_SCALAR, g.ISA_AVX2) or (
        isa == g.ISA_BEST and not g._load().has_avx512_bf16())


def _rand(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).bfloat16()


def _assert_bounds(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    assert y.dtype == torch.bfloat16 and y.shape == (x.shape[0], w.shape[0])
    exact = x.double() @ w.double().t()
    k = x.shape[1]
    gamma = (k * U32 / (1 - k * U32)) * (x.double().abs() @ w.double().abs().t())
    excess = ((y.double() - exact).abs() - (U_BF16 * (exact.abs() + gamma) + gamma)).max().item()
    assert excess <= 0, f"an output exceeds the bf16 GEMV error bound by {excess:.3g}"
    err = (y.double() - exact).abs().max().item()
    base = (g.gemv_ref(x, w).double() - exact).abs().max().item()
    atol = U_BF16 * exact.abs().max().item()
    assert err <= 2 * base + atol, f"err {err:.3g} > 2 * torch bf16 err {base:.3g} + {atol:.3g}"


@needs_native
@pytest.mark.parametrize("isa", VARIANTS)
@pytest.mark.parametrize("k", [1, 2, 7, 31, 32, 33, 577, 1000])
@pytest.mark.parametrize("out", [1, 5, 97])
@pytest.mark.parametrize("b", [1, 2, 3, 16])
def test_odd_shapes_every_variant(isa: int, k: int, out: int, b: int) -> None:
    x, w = _rand(b, k, seed=k), _rand(out, k, seed=out + 1)
    y = g.gemv_native(x, w, isa)
    _assert_bounds(y, x, w)
    if _bits_exact(isa):
        assert torch.equal(y, g.gemv_bf16_order_ref(x, w))


def test_order_ref_is_itself_within_the_bounds() -> None:
    """The bit-exact oracle is a correct GEMV (so matching it is not matching a wrong sum)."""
    for b, k, out in ((1, 577, 9), (4, 64, 24), (2, 3, 5)):
        x, w = _rand(b, k, seed=b + k), _rand(out, k, seed=out)
        _assert_bounds(g.gemv_bf16_order_ref(x, w), x, w)


@needs_native
@pytest.mark.parametrize("out,k", [(960, 576), (576, 576), (3072, 576), (576, 1536), (4099, 576)])
@pytest.mark.parametrize("b", [1, 8])
def test_smollm2_shapes_on_one_and_two_threads(out: int, k: int, b: int) -> None:
    """SmolLM2's qkv, o, gate_up, down and a scaled-down lm_head: same bits on 1 and 2 threads."""
    x, w = _rand(b, k, seed=1), _rand(out, k, seed=2, scale=0.05)
    threads = torch.get_num_threads()
    try:
        ys = []
        for n in (1, 2):
            torch.set_num_threads(n)
            ys.append(g.gemv_native(x, w))
    finally:
        torch.set_num_threads(threads)
    _assert_bounds(ys[0], x, w)
    assert torch.equal(ys[0], ys[1])


@needs_native
@pytest.mark.parametrize("isa", SIMD + [pytest.param(g.ISA_SCALAR, id="scalar")])
@pytest.mark.parametrize("b", [1, 2, 3, 4, 5, 8, 13, 16])
@pytest.mark.parametrize("k", [64, 577])
def test_batch_invariant(isa: int, b: int, k: int) -> None:
    """A row of x gives the same bits whatever the batch it rides in (its position in it and
    the other rows included), and a weight row the same bits inside a tile or alone."""
    x, w = _rand(b, k, seed=b), _rand(26, k, seed=k)
    y = g.gemv_native(x, w, isa)
    for i in range(b):
        assert torch.equal(y[i:i + 1], g.gemv_native(x[i:i + 1], w, isa)), f"row {i} of {b}"
    other = torch.cat([_rand(3, k, seed=99), x[-1:]])  # the last row among different neighbours
    assert torch.equal(g.gemv_native(other, w, isa)[-1], y[-1])
    alone = torch.cat([g.gemv_native(x, w[o:o + 1], isa) for o in range(w.shape[0])], 1)
    assert torch.equal(y, alone)


@needs_native
@pytest.mark.parametrize("isa", VARIANTS)
def test_nan_and_inf_stay_in_their_outputs(isa: int) -> None:
    x, w = _rand(3, 70, seed=3), _rand(6, 70, seed=4)
    w[1, 69] = float("nan")  # in the tail chunk
    w[4, 5] = float("inf")
    y = g.gemv_native(x, w, isa)
    assert y[:, 1].isnan().all() and y[:, 4].isinf().all()
    keep = [0, 2, 3, 5]
    _assert_bounds(y[:, keep], x, w[keep])


@needs_native
def test_strided_rows_of_x() -> None:
    """(Dispatch by dtype and row count: tests/kernels/test_gemv.py.)"""
    wide, w = _rand(4, 100, seed=3), _rand(9, 70, seed=4)
    x = wide[:, 10:80]
    assert torch.equal(g.gemv_native(x, w), g.gemv_native(x.contiguous(), w))
    _assert_bounds(g.gemv_native(x, w), x, w)


@needs_native
def test_rejects_bad_inputs() -> None:
    """The extension's own checks (the Python launcher's are tests/kernels/test_gemv.py's)."""
    x, w = _rand(2, 16, seed=8), _rand(8, 16, seed=9)
    with pytest.raises(AssertionError, match="one dtype"):
        g.gemv_native(x, w.float())
    ext = g._load()
    with pytest.raises(RuntimeError, match="gemv_bf16: w must be contiguous"):
        ext.gemv_bf16_out(x, _rand(16, 8, seed=10).t(), torch.empty(2, 8, dtype=torch.bfloat16), 0)
    with pytest.raises(RuntimeError, match="gemv_bf16: out has the wrong shape"):
        ext.gemv_bf16_out(x, w, torch.empty(2, 7, dtype=torch.bfloat16), 0)
    with pytest.raises(RuntimeError, match="gemv_bf16: bf16 only"):
        ext.gemv_bf16_out(x, w, torch.empty(2, 8), 0)
    with pytest.raises(RuntimeError, match="no plain AVX-512F variant"):
        g.gemv_native(x, w, g.ISA_AVX512)


@needs_native
@pytest.mark.skipif("avx512_bf16" in _flags(), reason="this CPU has AVX512_BF16")
def test_forcing_a_missing_variant_raises() -> None:
    with pytest.raises(RuntimeError, match="no AVX512_BF16"):
        g.gemv_native(_rand(1, 8, seed=1), _rand(2, 8, seed=2), g.ISA_AVX512_BF16)
