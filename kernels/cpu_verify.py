"""Fused fp32 CPU op of a decode step whose rows carry several query tokens (speculative
decoding's verify rows), beside its torch reference: rotary + KV write + paged attention,
causal within a row, each row's context read once for all its tokens.

    qkv [T, (Hq + 2·Hkv)·D] fp32     query tokens, rows back to back (q heads, k heads, v heads)
    cos, sin_signed [max_pos, D]     rotary tables (sin's first half negated, decoder._rotate)
    positions [T] int64              slot_mapping [T] int64 (< 0: do not write)
    kv_cache [NB, L, 2, BS, Hkv, D]  block_tables [B, max_blocks] int32
    context_lens [B] int32           the row's context, its own tokens included (>= q_len)
    query_start_loc [B+1] int32      row b owns tokens [qsl[b], qsl[b+1]), q_len >= 1
    → out [T, Hq·D] fp32

kernels/cpu_decode.py's op takes one token a sequence; a row of 1 + k tokens through it would
read its context 1 + k times (and race: a token must see the K/V its row's earlier tokens
write in the same call). `kernels/csrc/cpu_verify.cpp` works per (row, KV head): writes the
row's K/V, then reads every context position once for all of the row's tokens and query
heads. Rotated q/k are bit-identical to the torch path's; attention agrees to fp32 rounding
(other summation order). Built into the `kernels.gemv` extension; one C++ body compiled for
AVX-512F, AVX2 and baseline, chosen at run time.
"""
from __future__ import annotations

import torch

from kernels import gemv as _gemv
from kernels.cpu_decode import decode_attention_ref
from kernels.paged_decode_attention import per_token_rows

ISA_BEST, ISA_SCALAR, ISA_AVX2, ISA_AVX512 = 0, 1, 2, 3


def available() -> bool:
    """True when the native extension (shared with kernels.gemv) is built and imported."""
    return _gemv.gemv_available()


def supported(kv_cache: torch.Tensor, num_heads: int) -> bool:
    """Whether the native op takes this cache and head count (fp32 CPU, contiguous, D % 8)."""
    hkv, d = kv_cache.shape[4], kv_cache.shape[5]
    return (kv_cache.dtype == torch.float32 and not kv_cache.is_cuda and kv_cache.is_contiguous()
            and num_heads % hkv == 0 and d % 8 == 0)


def verify_attention_ref(qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
                         positions: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                         slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                         context_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                         num_heads: int) -> torch.Tensor:
    """Torch reference (shapes in the module docstring; writes `kv_cache` in place): each
    token as a one-token row over its row's block table and its context up to itself, through
    `cpu_decode.decode_attention_ref` (which writes every token's K/V before attending)."""
    tables, lens = per_token_rows(block_tables, context_lens, query_start_loc)
    return decode_attention_ref(qkv, cos, sin_signed, positions, kv_cache, layer, slot_mapping,
                                tables, lens, scale, num_heads)


def verify_attention(qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
                     positions: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                     slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                     num_heads: int, isa: int = ISA_BEST) -> torch.Tensor:
    """Native op (module docstring; writes `kv_cache` in place). `isa` forces a variant for
    tests (RuntimeError if the CPU lacks it). The extension checks every index it follows
    (row starts, context lengths, block ids, positions, slots) before writing anything and
    raises RuntimeError on a bad one, or if the extension is unavailable."""
    ext = _gemv._load()
    if ext is None:
        raise RuntimeError("native CPU ops are unavailable (see the log)")
    out = torch.empty(qkv.shape[0], num_heads * kv_cache.shape[5], dtype=torch.float32)
    ext.verify_attention_out(qkv, cos, sin_signed, positions, kv_cache, layer, slot_mapping,
                             block_tables, context_lens, query_start_loc, scale, num_heads, out,
                             isa)
    return out
