"""Small-batch bf16 GEMV on Intel AMX tiles, for decode steps on CPUs that have AMX.

    w [out, in] bf16  →  pack(w): [ceil(out/16), ceil(in/32), 16, 32] bf16 (once, at load)
    x [B, in] bf16, B <= MAX_ROWS  →  gemv_amx(x, packed, out) = y [B, out] bf16, fp32 sums
    w [out, in] bf16  →  pack_b(w): [ceil(out/16), in/32, 16, 32] bf16 (once; in % 32 == 0)
    x [M, in] bf16, any M  →  gemm_amx(x, packed_b, out) = y [M, out] bf16, the same bits
    [gate; up] →  pack_b(interleave_gate_up(w)); gemm_amx_silu(x, it, I) = silu(g)·u [M, I]

`kernels/csrc/gemv_amx.cpp` (built into the `kernels.gemv` extension) runs each 16-output ×
32-input block of W as one TDPBF16PS against up to 16 rows of x, so a step of 8–32 rows costs
about what one row does (the weight reads), where the AVX512_BF16 GEMV (kernels/gemv.py) is
compute-bound from ~5 rows on such CPUs. Batch and thread invariant (a row's result depends on
its x row and W only), but not the AVX512_BF16 GEMV's bits: AMX rounds inside one TDPBF16PS in
its own way, so a model takes one of the two for all its small steps (baton/models/linear.py),
and the reference for tests is closeness to fp32 products (`gemv_amx_ref` is the exact-sum
bound, not a bit replay).

`gemm_amx` (`kernels/csrc/gemm_amx.cpp`) is the GEMM of more rows (prefill): x is the tiles' A
operand read in place, W the B operand re-laid by `pack_b` (16-output units, each 32-input
chunk as 16 input pairs × 16 outputs × 2), 2 × 2 tiles per block, the threads' shares equal.
Its products and their order per result are `gemv_amx`'s, so its bits are too, for any row
count: a row's result does not depend on the step's other rows or how many there are (oneDNN's
GEMM, which it replaces for such matrices, picks kernels by row count).

`gemm_amx_silu` is that GEMM for the MLP's [gate; up] matrix (packed by `pack_b` after
`interleave_gate_up`) with SiLU·mul applied to each (gate, up) pair of tiles as they are
rounded: the bits of `gemm_amx` then `kernels.cpu_decode.silu_mul`, without writing and reading
back the [M, 2·I] product.

Both run where `available()`: CPUID's AMX-TILE and AMX-BF16, the OS's tile state (XCR0) and
Linux's ARCH_REQ_XCOMP_PERM; decided from those, never from a timing.
"""
from __future__ import annotations

import torch

from kernels import gemv as _gemv

MAX_ROWS = 32  # two B tiles of 16 x rows; more rows go to torch's GEMM (as MAX_ROWS_BF16)
OUT_UNIT, IN_CHUNK = 16, 32  # one A tile: 16 outputs × 32 inputs


available = _gemv.amx_available  # the extension is built and AMX tiles run here


def pack(w: torch.Tensor) -> torch.Tensor:
    """W [out, in] bf16 (CPU) → the kernel's layout [ceil(out/16), ceil(in/32), 16, 32] bf16:
    units of 16 outputs, each unit's 32-input chunks contiguous, zero-padded. A new tensor
    (W's size, padding aside). Raises ValueError for a non-2-D or non-bf16 W."""
    if w.dim() != 2 or w.dtype != torch.bfloat16:
        raise ValueError(f"pack: W must be 2-D bf16, got {tuple(w.shape)} {w.dtype}")
    out_f, in_f = w.shape
    pad_o, pad_i = -out_f % OUT_UNIT, -in_f % IN_CHUNK
    wp = torch.nn.functional.pad(w, (0, pad_i, 0, pad_o)) if pad_o or pad_i else w
    units, chunks = (out_f + pad_o) // OUT_UNIT, (in_f + pad_i) // IN_CHUNK
    return wp.reshape(units, OUT_UNIT, chunks, IN_CHUNK).permute(0, 2, 1, 3).contiguous()


def unpack(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """`pack`'s inverse: [units, chunks, 16, 32] → W [out_features, in_features] (a copy)."""
    units, chunks = packed.shape[:2]
    w = packed.permute(0, 2, 1, 3).reshape(units * OUT_UNIT, chunks * IN_CHUNK)
    return w[:out_features, :in_features].contiguous()


def gemv_amx(x: torch.Tensor, packed: torch.Tensor, out_features: int,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """x [B, in] bf16 (unit stride in `in`, B <= MAX_ROWS) @ W.T with W given as `pack(W)` →
    [B, out_features] bf16, written into `out` when given. RuntimeError where the extension is
    missing or AMX is not allowed, or on a shape, dtype or stride the kernel refuses."""
    return _call("gemv_amx_out", x, packed, out_features, out)


def _call(op: str, x: torch.Tensor, packed: torch.Tensor, out_features: int,
          out: torch.Tensor | None) -> torch.Tensor:
    """The extension's `op`(x, packed, out), `out` a new [rows, out_features] bf16 if None."""
    ext = _gemv._load()
    if ext is None:
        raise RuntimeError("native CPU ops are unavailable (see the log)")
    if out is None:
        out = torch.empty(x.shape[0], out_features, dtype=torch.bfloat16)
    getattr(ext, op)(x, packed, out)
    return out


def pack_b(w: torch.Tensor) -> torch.Tensor:
    """W [out, in] bf16 (CPU, in % 32 == 0) → `gemm_amx`'s layout [ceil(out/16), in/32, 16, 32]
    bf16: units of 16 outputs, each unit's 32-input chunk stored as 16 input pairs × 16 outputs
    × 2 (the B operand of TDPBF16PS), outputs zero-padded. A new tensor (W's size, padding
    aside). Raises ValueError for a non-2-D or non-bf16 W, or in % 32 != 0."""
    if w.dim() != 2 or w.dtype != torch.bfloat16:
        raise ValueError(f"pack_b: W must be 2-D bf16, got {tuple(w.shape)} {w.dtype}")
    out_f, in_f = w.shape
    if in_f % IN_CHUNK:
        raise ValueError(f"pack_b: W's inputs must be a multiple of {IN_CHUNK}, got {in_f}")
    pad_o = -out_f % OUT_UNIT
    wp = torch.nn.functional.pad(w, (0, 0, 0, pad_o)) if pad_o else w
    units, chunks = (out_f + pad_o) // OUT_UNIT, in_f // IN_CHUNK
    # [unit, out 16, chunk, pair 16, 2] -> [unit, chunk, pair, out, 2]
    return (wp.reshape(units, OUT_UNIT, chunks, IN_CHUNK // 2, 2).permute(0, 2, 3, 1, 4)
            .reshape(units, chunks, IN_CHUNK // 2, 2 * OUT_UNIT).contiguous())


def unpack_b(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """`pack_b`'s inverse → W [out_features, in_features] (a copy)."""
    units, chunks = packed.shape[:2]
    w = packed.reshape(units, chunks, IN_CHUNK // 2, OUT_UNIT, 2).permute(0, 3, 1, 2, 4)
    return w.reshape(units * OUT_UNIT, chunks * IN_CHUNK)[:out_features, :in_features].contiguous()


def gemm_amx(x: torch.Tensor, packed_b: torch.Tensor, out_features: int,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, in] bf16 (unit stride in `in`, any row stride and M) @ W.T with W given as
    `pack_b(W)` → [M, out_features] bf16 (into `out` when given), bit for bit what `gemv_amx`
    gives each row. RuntimeError where the extension is missing or AMX is not allowed, or on a
    shape, dtype or stride the kernel refuses."""
    return _call("gemm_amx_out", x, packed_b, out_features, out)


def interleave_gate_up(w: torch.Tensor) -> torch.Tensor:
    """[gate; up] [2·I, in] (I % 16 == 0) → its rows as 16-row units in the order gate unit 0,
    up unit 0, gate unit 1, ... (a new tensor): `pack_b` of it is what `gemm_amx_silu` takes,
    each thread's pair of units one (gate, up) pair. ValueError on another shape."""
    rows = w.shape[0] if w.dim() == 2 else 0
    if rows % (2 * OUT_UNIT):
        raise ValueError(f"interleave_gate_up: [2·I, in] with I % {OUT_UNIT} == 0 expected, "
                         f"got {tuple(w.shape)}")
    units = rows // (2 * OUT_UNIT)
    return w.reshape(2, units, OUT_UNIT, -1).transpose(0, 1).reshape(rows, -1).contiguous()


def deinterleave_gate_up(y: torch.Tensor) -> torch.Tensor:
    """The columns of x @ `interleave_gate_up(W)`.T [M, 2·I] back in W's order ([gate | up],
    a new tensor)."""
    m, cols = y.shape
    return y.reshape(m, cols // (2 * OUT_UNIT), 2, OUT_UNIT).transpose(1, 2).reshape(m, cols)


def gemm_amx_silu(x: torch.Tensor, packed_b: torch.Tensor, inter: int,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(x @ gate.T) · (x @ up.T) [M, inter] bf16 (into `out` when given) for x [M, in] bf16
    and `packed_b` = pack_b(interleave_gate_up([gate; up])): the SiLU·mul runs on each pair of
    C tiles as they are rounded, so the [M, 2·inter] product is never written. Bit for bit
    `gemm_amx` then `kernels.cpu_decode.silu_mul` (bf16: each product rounded, then
    bf16(bf16(silu(g))·u)). RuntimeError as `gemm_amx`, or when inter % 16 != 0."""
    return _call("gemm_amx_silu_out", x, packed_b, inter, out)


def gemv_amx_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The exact result the kernel approximates: x [B, in] @ w [out, in].T in fp64, [B, out]
    fp64; the kernel's bf16 output is within one bf16 rounding (2^-8 relative) of it plus its
    fp32 summation error (in × 2^-24 × sum|x·w|)."""
    return x.double() @ w.double().t()
