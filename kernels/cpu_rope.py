"""Rotary embedding + KV-cache write of a CPU step's rows in one native call (csrc/cpu_rope.cpp).

    qkv [T, (Hq + 2·Hkv)·D]            the step's q/k/v projections (heads contiguous)
    cos, sin_signed [max_pos, D]       rotary tables (sin's first half negated, decoder._rotate)
    positions [T] int64                slot_mapping [T] int64 (< 0: not written)
    kv_cache [NB, L, 2, BS, Hkv, D]    written in place: rotated k and v at each token's slot
    → q [T, Hq, D]                     the rotated queries; all fp32 or all bf16

The torch path of a prefill layer spends ~8 ops on this (x·cos, roll, ·sin_signed, add, split,
cat, index_copy_): on the Zen 4 VM of issue 24, 1,000 bf16 tokens of SmolLM2-135M, ~0.75 ms a
layer, 22 ms of a 750 ms prefill. The native op rounds every product and sum as those torch
ops do, so its q and K are bit-identical to theirs (tested), and it is used where the
decoder's bf16 native path runs (baton/models/decoder.py).
"""
from __future__ import annotations

import torch

from kernels import gemv as _gemv

ISA_BEST, ISA_SCALAR, ISA_AVX512 = 0, 1, 3


def available() -> bool:
    """Whether the native op runs here (the extension built)."""
    return _gemv._load() is not None


def rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """The decoder's rotary in torch ops (decoder._rotate): x [T, H, D], cos / sin_signed
    [T, 1, D] → x·cos + roll(x, D/2)·sin_signed, each op rounded to x's dtype."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed


def rope_write_ref(qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
                   positions: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                   slot_mapping: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Torch reference (shapes in the module docstring): the decoder's torch ops; writes
    `kv_cache` in place and returns q [T, Hq, D]."""
    _, _, _, bs, hkv, d = kv_cache.shape
    t = qkv.shape[0]
    heads = qkv.view(t, num_heads + 2 * hkv, d)
    c, s = cos[positions][:, None], sin_signed[positions][:, None]
    q, k = rotate_ref(heads[:, :num_heads + hkv], c, s).split([num_heads, hkv], dim=1)
    v = heads[:, num_heads + hkv:]
    for i in range(t):
        slot = int(slot_mapping[i])
        if slot >= 0:
            kv_cache[slot // bs, layer, 0, slot % bs] = k[i]
            kv_cache[slot // bs, layer, 1, slot % bs] = v[i]
    return q


def rope_write(qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
               positions: torch.Tensor, kv_cache: torch.Tensor, layer: int,
               slot_mapping: torch.Tensor, num_heads: int, isa: int = ISA_BEST) -> torch.Tensor:
    """Native `rope_write_ref`. positions and slot_mapping: contiguous int64. RuntimeError,
    before anything is written, on a position past the tables, a slot past the cache, a bad
    shape or dtype, a forced variant this CPU lacks, or without the extension."""
    ext = _gemv._load()
    if ext is None:
        raise RuntimeError("native CPU ops are unavailable (see the log)")
    d = kv_cache.shape[5]
    q = torch.empty(qkv.shape[0], num_heads * d, dtype=qkv.dtype)
    ext.rope_write_out(qkv, cos, sin_signed, positions, kv_cache, layer, slot_mapping,
                       num_heads, q, isa)
    return q.view(qkv.shape[0], num_heads, d)
