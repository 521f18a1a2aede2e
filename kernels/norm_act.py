"""Residual add + RMSNorm and SiLU·mul as one Triton kernel each (the CUDA decoder's elementwise
ops; `kernels/cpu_decode.py` holds the native CPU versions and the torch references).

    add_rms_norm:  h [T, H] (+= r [T, H], in place), w [H]  → RMSNorm(h) [T, H]
    silu_mul:      gate_up [T, 2I] = [gate | up]            → silu(gate) · up [T, I]

On a GPU a decode step of a small model is bound by kernel count, not bytes: in bf16 the torch
ops of one RMSNorm are seven kernels (cast, pow, mean, add, rsqrt, mul, cast, then the weight
product), the residual add before it an eighth, SiLU·mul two; SmolLM2-135M's batch-1 step ran
948 kernels, ~32 a layer (BENCHMARKS.md, "Measured on an H200"). Each op here is one kernel.

Roundings are the torch ops': the residual sum is rounded to h's dtype (torch's bf16 add), the
statistics are fp32 (transformers' LlamaRMSNorm), the normed value is rounded to the dtype
before the weight product, which is rounded again; silu is rounded before the product with up.
The fp32 sum of squares runs in another order than torch's mean (and the GPU's rsqrt and exp
may differ from torch's in the last bit), so outputs agree with the references to a rounding,
not bit for bit: the decoder uses these for bf16/fp16 on CUDA, where outputs are checked by
logprob closeness and both sides of a disaggregated step run the same kernels; fp32 on CUDA
keeps the torch ops (token-exact against transformers).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import FLOAT_DTYPES, on_device, pow2_at_least, same_device
from kernels.cpu_decode import add_rms_norm_ref, silu_mul_ref

__all__ = ["add_rms_norm", "add_rms_norm_ref", "add_rms_norm_triton", "silu_mul", "silu_mul_ref",
           "silu_mul_triton"]

_SILU_BLOCK = 1024


@triton.jit
def _add_rms_norm_kernel(h_ptr, r_ptr, w_ptr, out_ptr, eps, H,
                         HAS_R: tl.constexpr, BLOCK: tl.constexpr):
    # One program per row: the whole row in registers (H <= BLOCK).
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    h = tl.load(h_ptr + row * H + cols, mask=mask, other=0.0)
    if HAS_R:
        r = tl.load(r_ptr + row * H + cols, mask=mask, other=0.0)
        h = (h.to(tl.float32) + r.to(tl.float32)).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + row * H + cols, h, mask=mask)
    hf = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=0) / H + eps)
    normed = (hf * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * H + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, I, BLOCK: tl.constexpr):
    # Program (row, chunk of BLOCK columns): gate at x[row, c], up at x[row, I + c].
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    g = tl.load(x_ptr + row * 2 * I + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * 2 * I + I + cols, mask=mask, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * I + cols, (s * u).to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm_triton(h: torch.Tensor, r: torch.Tensor | None, w: torch.Tensor,
                        eps: float) -> torch.Tensor:
    """Triton `add_rms_norm_ref`: h [T, H] contiguous, updated in place to h + r when r [T, H]
    (contiguous) is given; w [H]; one float dtype for all → a new [T, H] tensor. Asserts the
    contract (AssertionError naming the argument) before launch; H ≤ 65,536."""
    assert h.dim() == 2 and h.is_contiguous(), f"h must be a contiguous [T, H], got {tuple(h.shape)}"
    assert h.dtype in FLOAT_DTYPES, f"unsupported dtype {h.dtype}"
    T, H = h.shape
    assert w.shape == (H,) and w.is_contiguous(), f"w must be [{H}], got {tuple(w.shape)}"
    assert w.dtype == h.dtype, f"w dtype {w.dtype} vs h {h.dtype}"
    if r is not None:
        assert r.shape == h.shape and r.is_contiguous() and r.dtype == h.dtype, (
            f"r must be a contiguous {tuple(h.shape)} {h.dtype}, got {tuple(r.shape)} {r.dtype}")
        same_device(h, r, w)
    else:
        same_device(h, w)
    assert H <= 65536, f"hidden size {H} exceeds one program's row"
    out = torch.empty_like(h)
    if T:
        with on_device(h):
            _add_rms_norm_kernel[(T,)](h, h if r is None else r, w, out, float(eps), H,
                                       HAS_R=r is not None, BLOCK=pow2_at_least(H, 16))
    return out


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """Triton `silu_mul_ref`: gate_up [T, 2I] contiguous float → [T, I] of its dtype."""
    assert gate_up.dim() == 2 and gate_up.is_contiguous() and gate_up.shape[1] % 2 == 0, (
        f"gate_up must be a contiguous [T, 2I], got {tuple(gate_up.shape)}")
    assert gate_up.dtype in FLOAT_DTYPES, f"unsupported dtype {gate_up.dtype}"
    T, I = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(T, I, dtype=gate_up.dtype, device=gate_up.device)
    if T:
        with on_device(gate_up):
            _silu_mul_kernel[(T, triton.cdiv(I, _SILU_BLOCK))](gate_up, out, I, BLOCK=_SILU_BLOCK)
    return out


def add_rms_norm(h: torch.Tensor, r: torch.Tensor | None, w: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """h += r (in place, when r is given), then RMSNorm(h) with weight w → [T, H]. CUDA tensors
    run the Triton kernel, CPU tensors the torch reference (the same ops as the decoder's
    torch path, so a CPU model on the CUDA path keeps its bits)."""
    return add_rms_norm_triton(h, r, w, eps) if h.is_cuda else add_rms_norm_ref(h, r, w, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] = [gate | up] → silu(gate) · up [T, I]: Triton on CUDA, the torch reference on
    CPU."""
    return silu_mul_triton(gate_up) if gate_up.is_cuda else silu_mul_ref(gate_up)
