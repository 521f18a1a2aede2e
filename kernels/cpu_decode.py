"""Fused fp32 / bf16 CPU decode ops: rotary + KV-cache write + paged attention in one native call,
and residual add + RMSNorm, SiLU·mul (each beside its torch reference).

    qkv [T, (Hq + 2·Hkv)·D]          one decode token per sequence (rows: q heads, k heads, v heads)
    cos, sin_signed [max_pos, D]     rotary tables (sin's first half negated, see decoder._rotate)
    positions [T] int64              slot_mapping [T] int64 (< 0: do not write)
    kv_cache [NB, L, 2, BS, Hkv, D]  block_tables [T, max_blocks] int32, context_lens [T] int32
    → out [T, Hq·D]                  qkv, tables, cache and out all fp32 or all bf16

On CPU the torch path of a decode layer is ~15 small ops (rotary, cat, index_copy_, index_select
of every context, view/transpose, SDPA); after a layer's GEMVs each costs 5-50 µs here, and the
gather copies each sequence's K and V before SDPA reads them again. `kernels/csrc/cpu_decode.cpp`
does it in one pass per (token, KV head) — the work items the threads share, so a lone decode
row uses every core — reading K/V in place through the block table; the rotated q/k are
bit-identical to the torch path's, attention agrees to fp32 rounding (softmax summed in another
order; exp to ~1 ulp). `kernels/csrc/cpu_norm.cpp` holds `add_rms_norm` (h += r; RMSNorm(h), one
pass instead of torch's add + ~6 rms_norm kernels) and `silu_mul` (gate/up halves → silu·up).
All are built into the `kernels.gemv` extension. In fp32 their scalar variants (CPUs without
AVX-512) are a correctness fallback, and the decoder uses these ops only where `use_fused(dtype)`.

bf16: the cache is read in place (widened to fp32 in registers, no conversion of the pool);
every torch bf16 op of the reference is replayed with its rounding (rotary products and sum,
residual add, normed value, weight product, silu), so the written K/V and the residual stream
are bit-identical to the torch path's; the attention's scores, softmax and weighted sum of V are
fp32 throughout and round once to bf16 (torch's bf16 SDPA also rounds the probabilities to bf16
before P·V, so the native op is the closer of the two to fp32 attention).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import gemv as _gemv
from kernels.cpu_rope import rope_write_ref

ISA_BEST, ISA_SCALAR, ISA_AVX512 = 0, 1, 3


def available() -> bool:
    """True when the native extension (shared with kernels.gemv) is built and imported."""
    return _gemv.gemv_available()


def fast_available() -> bool:
    """True when the native ops run their AVX-512F variants here. Their scalar variants are a
    portable correctness fallback only (the scalar attention is slower than the torch path), so
    the decoder takes the fused step only when this holds; AVX2-only CPUs keep the torch ops."""
    return available() and bool(_gemv._load().has_avx512())


def use_fused(dtype: torch.dtype) -> bool:
    """Whether a CPU decode step of a `dtype` model should take these ops. fp32: only where
    `fast_available()`. bf16: wherever the extension is built, scalar variants included: torch's
    bf16 ops are slow on a CPU without AVX-512 too (in a rough check on a loaded AVX2 EPYC the
    scalar fused step was not slower than the torch one), and the native attention is batch
    invariant where torch's batched SDPA (contexts padded to the longest, masked) is not."""
    if dtype == torch.bfloat16:
        return available()
    return dtype == torch.float32 and fast_available()


def decode_attention_ref(qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
                         positions: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                         slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                         context_lens: torch.Tensor, scale: float, num_heads: int) -> torch.Tensor:
    """Torch reference (shapes in the module docstring): rotate, write K/V
    (`kernels.cpu_rope.rope_write_ref`), then each token's SDPA over its gathered context.
    Writes `kv_cache` in place like the native op."""
    q = rope_write_ref(qkv, cos, sin_signed, positions, kv_cache, layer, slot_mapping, num_heads)
    return attend_ref(q, kv_cache, layer, block_tables, context_lens, scale)


def attend_ref(q: torch.Tensor, kv_cache: torch.Tensor, layer: int, block_tables: torch.Tensor,
               context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention part of `decode_attention_ref`: rotated q [T, Hq, D] over each token's context
    [0, context_lens[t]) read through its block table → [T, Hq·D], SDPA in q's dtype."""
    _, _, _, bs, hkv, d = kv_cache.shape
    t, num_heads = q.shape[0], q.shape[1]
    out = torch.empty(t, num_heads, d, dtype=q.dtype)
    for i in range(t):
        n = int(context_lens[i])
        pos = torch.arange(n)
        blocks = block_tables[i].long()[pos // bs]
        keys = kv_cache[blocks, layer, 0, pos % bs].transpose(0, 1)  # [Hkv, N, D]
        vals = kv_cache[blocks, layer, 1, pos % bs].transpose(0, 1)
        qi = q[i].view(hkv, num_heads // hkv, d)  # query head j uses KV head j // group
        out[i] = F.scaled_dot_product_attention(qi, keys, vals, scale=scale).reshape(num_heads, d)
    return out.view(t, num_heads * d)


def supported(kv_cache: torch.Tensor, num_heads: int) -> bool:
    """Whether the native op takes this cache and head count (fp32 or bf16 CPU, group <= 8,
    even D <= 512)."""
    hkv, d = kv_cache.shape[4], kv_cache.shape[5]
    return (kv_cache.dtype in (torch.float32, torch.bfloat16) and not kv_cache.is_cuda
            and kv_cache.is_contiguous() and num_heads % hkv == 0 and num_heads // hkv <= 8
            and d % 2 == 0 and d <= 512)


def decode_attention(qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
                     positions: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                     slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float, num_heads: int,
                     isa: int = ISA_BEST) -> torch.Tensor:
    """Native op (shapes in the module docstring; writes `kv_cache` in place). `isa` forces a
    variant for tests (RuntimeError if the CPU lacks it). The extension checks every index it
    follows (positions, slots, context lengths, block ids) and raises RuntimeError on a bad one,
    before writing anything. Raises RuntimeError if the extension is unavailable."""
    ext = _gemv._load()
    if ext is None:
        raise RuntimeError("native CPU ops are unavailable (see the log)")
    out = torch.empty(qkv.shape[0], num_heads * kv_cache.shape[5], dtype=kv_cache.dtype)
    ext.decode_attention_out(qkv, cos, sin_signed, positions, kv_cache, layer, slot_mapping,
                             block_tables, context_lens, scale, num_heads, out, isa)
    return out


def decode_attend(query: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                  block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                  isa: int = ISA_BEST) -> torch.Tensor:
    """`decode_attention`'s attention alone (reference: `attend_ref`): query [T, Hq, D] already
    rotated, the step's K/V already in the cache (a decode row of a step that also prefills,
    whose rotary and KV write ran for all its rows: kernels.cpu_rope). A token's output is the
    same bits as `decode_attention` gives it from the unrotated row. block_tables [T, max_blocks]
    and context_lens [T]: contiguous int32. RuntimeError on a bad shape, dtype or index, or
    without the extension."""
    ext = _gemv._load()
    if ext is None:
        raise RuntimeError("native CPU ops are unavailable (see the log)")
    t, hq, d = query.shape
    out = torch.empty(t, hq * d, dtype=kv_cache.dtype)
    ext.decode_attend_out(query.reshape(t, hq * d), kv_cache, layer, block_tables, context_lens,
                          scale, out, isa)
    return out.view(t, hq, d)


def add_rms_norm_ref(h: torch.Tensor, r: torch.Tensor | None, w: torch.Tensor,
                     eps: float) -> torch.Tensor:
    """Torch reference: h += r in place (if r is given), then transformers' LlamaRMSNorm of h
    (statistics in fp32, the normed value rounded to h's dtype before the weight product)."""
    if r is not None:
        h += r
    hf = h.float()
    return w * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)


def rows_out(rows: int, t: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """An op's output [t, width]: the first t rows of a buffer of max(rows, t) rows whose other
    rows are zeros, so a GEMM that pads its input to `rows` (baton/models/linear.py
    `bucket_rows`) takes the buffer itself instead of a padded copy."""
    if rows <= t:
        return torch.empty(t, width, dtype=dtype)
    buf = torch.empty(rows, width, dtype=dtype)
    buf[t:].zero_()
    return buf[:t]


def add_rms_norm(h: torch.Tensor, r: torch.Tensor | None, w: torch.Tensor, eps: float,
                 isa: int = ISA_BEST, rows: int = 0) -> torch.Tensor:
    """Native `add_rms_norm_ref`: h [T, H] fp32 or bf16 contiguous (updated in place when r [T, H]
    is given), w [H], all one dtype → [T, H] (with rows > T: `rows_out`'s view). RuntimeError on
    a wrong shape/dtype or without the extension."""
    ext = _gemv._load()
    if ext is None:
        raise RuntimeError("native CPU ops are unavailable (see the log)")
    out = rows_out(rows, h.shape[0], h.shape[-1], h.dtype) if h.dim() == 2 else torch.empty_like(h)
    ext.add_rms_norm_out(h, _EMPTY if r is None else r, w, eps, out, isa)
    return out


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """Torch reference: [T, 2I] = [gate | up] → silu(gate) · up [T, I]."""
    gate, up = gate_up.chunk(2, dim=1)
    return F.silu(gate) * up


def silu_mul(gate_up: torch.Tensor, isa: int = ISA_BEST, rows: int = 0) -> torch.Tensor:
    """Native `silu_mul_ref` (fp32 or bf16 contiguous [T, 2I] → [T, I], same dtype; bf16: silu
    rounded to bf16 before the product, as torch's two ops; with rows > T `rows_out`'s view);
    RuntimeError as above."""
    ext = _gemv._load()
    if ext is None:
        raise RuntimeError("native CPU ops are unavailable (see the log)")
    out = rows_out(rows, gate_up.shape[0], gate_up.shape[1] // 2, gate_up.dtype)
    ext.silu_mul_out(gate_up, out, isa)
    return out


_EMPTY = torch.empty(0)
