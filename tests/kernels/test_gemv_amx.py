"""The AMX bf16 GEMV and GEMM (kernels/gemv_amx.py, csrc/gemv_amx.cpp, csrc/gemm_amx.cpp)
against fp64 references.

Tolerance, per output, from the algorithm: fp32 sums of exact bf16 products in some order
(TDPBF16PS's internal order is not documented bit for bit; see gemv_amx.cpp), so
|s − e| ≤ γ_K·Σ|x_k w_k| (Higham §3.1, γ_K = K·u/(1 − K·u), u = 2^-24), and one rounding to
bf16 adds at most 2^-8·|s|: |y − e| ≤ 2^-8(|e| + γΣ) + γΣ — the bound the AVX512_BF16 GEMV is
held to (tests/kernels/test_gemv_bf16.py). Bits are then pinned by invariance: a row's result
does not depend on the other rows, the batch size, or the thread count; and the GEMM's bits
are the GEMV's for every row.
"""
from __future__ import annotations

import pytest
import torch

from kernels import gemv_amx as ga

pytestmark = pytest.mark.skipif(not ga.available(), reason="AMX does not run on this CPU/OS")
U32, U_BF16 = 2.0**-24, 2.0**-8


def _rand(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).bfloat16()


def _one_and_many_threads(run) -> tuple[torch.Tensor, torch.Tensor]:
    """run() on one thread, then on at least two."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run()
        torch.set_num_threads(max(2, threads))
        return one, run()
    finally:
        torch.set_num_threads(threads)


def _assert_bounds(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    assert y.dtype == torch.bfloat16 and y.shape == (x.shape[0], w.shape[0])
    exact = ga.gemv_amx_ref(x, w)
    k = x.shape[1]
    gamma = (k * U32 / (1 - k * U32)) * (x.double().abs() @ w.double().abs().t())
    excess = ((y.double() - exact).abs() - (U_BF16 * (exact.abs() + gamma) + gamma)).max().item()
    assert excess <= 0, f"an output exceeds the bf16 GEMV error bound by {excess:.3g}"


@pytest.mark.parametrize("k", [1, 2, 7, 31, 32, 33, 577, 1536])
@pytest.mark.parametrize("out", [1, 5, 16, 97])
@pytest.mark.parametrize("b", [1, 3, 16, 17, 32])
def test_odd_shapes_within_the_bound(k: int, out: int, b: int) -> None:
    x, w = _rand(b, k, seed=k), _rand(out, k, seed=out + 1)
    _assert_bounds(ga.gemv_amx(x, ga.pack(w), out), x, w)


def test_pack_pads_with_zeros_and_unpack_inverts_it() -> None:
    w = _rand(37, 70, seed=3)
    p = ga.pack(w)
    assert p.shape == (3, 3, 16, 32) and p.is_contiguous()
    assert torch.equal(ga.unpack(p, 37, 70), w)
    assert p.float().abs().sum() == w.float().abs().sum()  # the padding is zeros
    assert torch.equal(p[0, 1, 2], w[2, 32:64])  # unit 0, chunk 1, its row 2
    with pytest.raises(ValueError, match="bf16"):
        ga.pack(w.float())


@pytest.mark.parametrize("b", [2, 5, 16, 17, 24, 32])
def test_batch_invariant(b: int) -> None:
    """Every row of a b-row call equals that row computed alone (and inside other batches):
    the property disaggregated = colocated rests on."""
    w = _rand(200, 576, seed=5, scale=0.05)
    p = ga.pack(w)
    x = _rand(b, 576, seed=b)
    y = ga.gemv_amx(x, p, 200)
    for r in range(b):
        assert torch.equal(ga.gemv_amx(x[r:r + 1].contiguous(), p, 200)[0], y[r]), r
    other = torch.cat([_rand(3, 576, seed=99), x[-1:]])
    assert torch.equal(ga.gemv_amx(other, p, 200)[-1], y[-1])


def test_thread_count_does_not_change_bits() -> None:
    w, x = _rand(3072, 576, seed=6, scale=0.05), _rand(8, 576, seed=7)
    p = ga.pack(w)
    one, many = _one_and_many_threads(lambda: ga.gemv_amx(x, p, 3072))
    assert torch.equal(one, many)
    _assert_bounds(many, x, w)


def test_strided_x_and_out_view() -> None:
    """x rows with a stride above K (a view), out a column slice of a wider buffer."""
    w = _rand(48, 64, seed=8)
    big = _rand(4, 100, seed=9)
    x = big[:, 10:74]
    buf = torch.zeros(4, 80, dtype=torch.bfloat16)
    out = buf[:, 16:64]
    ga.gemv_amx(x, ga.pack(w), 48, out=out)
    assert torch.equal(out, ga.gemv_amx(x.contiguous(), ga.pack(w), 48))
    assert buf[:, :16].abs().sum() == 0 and buf[:, 64:].abs().sum() == 0


def test_bad_input_raises() -> None:
    w = _rand(32, 64, seed=1)
    p = ga.pack(w)
    with pytest.raises(RuntimeError, match="at most 32 rows"):
        ga.gemv_amx(_rand(33, 64, seed=2), p, 32)
    with pytest.raises(RuntimeError, match="disagree on the shape"):
        ga.gemv_amx(_rand(2, 96, seed=2), p, 32)
    with pytest.raises(RuntimeError, match="disagree on the shape"):
        ga.gemv_amx(_rand(2, 64, seed=2), p, 48)
    with pytest.raises(RuntimeError, match="bf16 only"):
        ga.gemv_amx(torch.randn(2, 64), p, 32)
    with pytest.raises(RuntimeError, match="contiguous"):
        ga.gemv_amx(_rand(2, 64, seed=2), p.transpose(0, 1), 32)
    assert ga.gemv_amx(_rand(0, 64, seed=2), p, 32).shape == (0, 32)


@pytest.mark.parametrize("k", [32, 64, 576, 1536])
@pytest.mark.parametrize("out", [1, 17, 48, 97])
@pytest.mark.parametrize("m", [1, 15, 16, 33, 64, 100])
def test_gemm_is_the_gemv_bit_for_bit(k: int, out: int, m: int) -> None:
    """Every row of the GEMM (any row count: full and tail row blocks, partial units) equals
    the GEMV of that row alone, and lies within the bound."""
    x, w = _rand(m, k, seed=k + m, scale=0.5), _rand(out, k, seed=out, scale=0.05)
    y = ga.gemm_amx(x, ga.pack_b(w), out)
    _assert_bounds(y, x, w)
    p = ga.pack(w)
    for r in range(m):
        assert torch.equal(y[r], ga.gemv_amx(x[r:r + 1], p, out)[0]), r


def test_gemm_thread_count_and_strides_do_not_change_bits() -> None:
    w, x = _rand(3072, 576, seed=6, scale=0.05), _rand(300, 576, seed=7)
    pb = ga.pack_b(w)
    one, many = _one_and_many_threads(lambda: ga.gemm_amx(x, pb, 3072))
    assert torch.equal(one, many)
    big = _rand(300, 700, seed=8)  # x rows at a stride, out a column slice of a wider buffer
    buf = torch.zeros(300, 3100, dtype=torch.bfloat16)
    ga.gemm_amx(big[:, 64:640], pb, 3072, out=buf[:, 16:3088])
    assert torch.equal(buf[:, 16:3088], ga.gemm_amx(big[:, 64:640].contiguous(), pb, 3072))
    assert buf[:, :16].abs().sum() == 0 and buf[:, 3088:].abs().sum() == 0


def test_gemm_rounds_nan_and_tiny_values_as_the_gemv() -> None:
    """Results that VCVTNE2PS2BF16 would round otherwise (NaN: payload kept; subnormal:
    flushed, though TDPBF16PS already flushes subnormal inputs and results) get c10's
    rounding, bit for bit the GEMV's store."""
    w = torch.zeros(32, 32, dtype=torch.bfloat16)
    w[:, 0] = 1.0
    w[3, 1] = 1e-30
    x = _rand(20, 32, seed=4)
    x[:, 1] = 1e-9  # products near the subnormal range
    x[:, 2] = torch.tensor(3e-39).bfloat16()  # a subnormal input
    x[5, 0] = float("nan")
    y = ga.gemm_amx(x, ga.pack_b(w), 32)
    assert y[5].view(torch.int16).eq(0x7FC0).all()
    p = ga.pack(w)
    for r in range(20):
        assert torch.equal(y[r].view(torch.int16),
                           ga.gemv_amx(x[r:r + 1], p, 32)[0].view(torch.int16)), r


def test_pack_b_layout_and_bad_input() -> None:
    w = _rand(37, 64, seed=3)
    p = ga.pack_b(w)
    assert p.shape == (3, 2, 16, 32) and p.is_contiguous()
    assert torch.equal(ga.unpack_b(p, 37, 64), w)
    assert p.float().abs().sum() == w.float().abs().sum()  # the padding is zeros
    assert p[0, 1, 3, 2 * 5].item() == w[5, 32 + 6].item()  # unit 0, chunk 1, pair 3, output 5
    assert p[0, 1, 3, 2 * 5 + 1].item() == w[5, 32 + 7].item()
    with pytest.raises(ValueError, match="bf16"):
        ga.pack_b(w.float())
    with pytest.raises(ValueError, match="multiple of 32"):
        ga.pack_b(_rand(4, 70, seed=1))
    with pytest.raises(RuntimeError, match="disagree on the shape"):
        ga.gemm_amx(_rand(40, 96, seed=2), p, 37)
    with pytest.raises(RuntimeError, match="disagree on the shape"):
        ga.gemm_amx(_rand(40, 64, seed=2), p, 49)
    with pytest.raises(RuntimeError, match="bf16 only"):
        ga.gemm_amx(torch.randn(40, 64), p, 37)
    with pytest.raises(RuntimeError, match="unit inner stride"):
        ga.gemm_amx(_rand(64, 40, seed=2).t(), p, 37)
    assert ga.gemm_amx(_rand(0, 64, seed=2), p, 37).shape == (0, 37)
