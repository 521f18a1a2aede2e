"""Decode attention over a paged KV cache: each sequence's new query tokens over its context.

    query [T, Hq, D]      block_tables [B, max_blocks] int32      context_lens [B] int32
    key_cache / value_cache [num_blocks, block_size, Hkv, D]      (Hq = Hkv * group)
    query_start_loc [B+1] int32 or None: sequence b owns query rows [qsl[b], qsl[b+1]);
        None = one query token per sequence (T = B), the plain decode step

    sequence b, position p ──▶ block_tables[b, p // block_size], offset p % block_size

    block_tables[b]:  [ 7 | 2 | 9 | x | x ]     context_lens[b] = 37, block_size = 16
                        0-15 16-31 32-36         (x: never read, may be 0, -1 or garbage)

A sequence's q_len > 1 query tokens are a speculative decode row (its last known token and
its drafted ones, baton/engine/spec/): they are the last q_len positions of its context and
attend causally, query i to positions [0, context_len - q_len + i]:

    context_lens[b] = 11, q_len = 3   key position 0 1 2 3 4 5 6 7 8 9 10
                                      query 0 (p=8) x x x x x x x x x . .
                                      query 1 (p=9) x x x x x x x x x x .
                                      query 2 (p=10) x x x x x x x x x x x

The Triton kernel runs one program per (sequence, KV head); the program holds the (query
token, query head) pairs that share that KV head as the rows of one tile (the group's heads
for each of the sequence's query tokens), so each K/V tile is loaded once for all of them
(GQA, and a speculative row's tokens). It walks the context in tiles of `_BLOCK_N` tokens
(each token's physical block looked up in the block table, so any block_size works) with the
online softmax of FlashAttention-2 (Dao, 2023) in fp32. Same contract as vLLM's paged
attention v1 (Kwon et al., 2023) for one token a sequence. Split-KV ("flash decoding") for
very long contexts at small batch is not done here.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels._checks import (
    check_block_tables,
    check_kv_cache_pair,
    check_query,
    dot_precision,
    on_device,
    pow2_at_least,
    same_device,
)

_BLOCK_N = 64  # context tokens per tile (may span several KV blocks)
_LOG2E = 1.4426950408889634


def _gather_context(cache: torch.Tensor, block_tables: torch.Tensor, num_tokens: int, num_blocks: torch.Tensor):
    """`[B, num_tokens, H, D]`: each row's first `num_tokens` cache positions through its block table.

    Block-table entries at or past `num_blocks[b]` are replaced by block 0 before indexing, so
    unused entries (0, -1, anything) are never followed; the positions they cover must be masked.
    """
    block_size = cache.shape[1]
    width = -(-num_tokens // block_size)
    ids = block_tables[:, :width].long()
    used = torch.arange(width, device=ids.device) < num_blocks[:, None]
    ids = torch.where(used, ids, torch.zeros_like(ids))
    rows = cache.index_select(0, ids.flatten())  # [B * width, bs, H, D]; much faster than cache[ids]
    return rows.view(ids.shape[0], width * block_size, *cache.shape[2:])[:, :num_tokens]


def paged_decode_attention_ref(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    query_start_loc: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch reference and CPU path: gather each sequence's context, mask, one batched SDPA.

    Shapes as in the module docstring; returns `[T, Hq, D]` in `query.dtype`. Every sequence
    needs `1 <= q_len <= context_lens[b]`. A multi-token row is computed as q_len one-token
    rows over the same block table, each with the context up to its own position (the causal
    mask of the module docstring). Cost: gathers `T * max(context_lens)` positions.
    """
    if query_start_loc is not None:
        block_tables, context_lens = per_token_rows(block_tables, context_lens, query_start_loc)
    batch = query.shape[0]
    if batch == 0:
        return torch.empty_like(query)
    block_size = key_cache.shape[1]
    lens = context_lens.long()
    max_len = int(lens.max())
    num_blocks = (lens + block_size - 1) // block_size
    k = _gather_context(key_cache, block_tables, max_len, num_blocks)  # [B, N, Hkv, D]
    v = _gather_context(value_cache, block_tables, max_len, num_blocks)
    mask = torch.arange(max_len, device=query.device)[None, :] < lens[:, None]  # [B, N]
    out = F.scaled_dot_product_attention(
        query[:, :, None, :],  # [B, Hq, 1, D]
        k.transpose(1, 2),  # [B, Hkv, N, D]
        v.transpose(1, 2),
        attn_mask=mask[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    )
    return out[:, :, 0]


def per_token_rows(block_tables: torch.Tensor, context_lens: torch.Tensor,
               query_start_loc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(block tables [T, max_blocks], context lengths [T]) of each query token: its row's
    table, and its row's context up to and including its own position."""
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
    rows = torch.repeat_interleave(torch.arange(len(q_lens), device=q_lens.device), q_lens)
    offset = torch.arange(len(rows), device=q_lens.device) - query_start_loc[:-1].long()[rows]
    lens = context_lens.long()[rows] - q_lens[rows] + 1 + offset
    return block_tables[rows], lens.to(torch.int32)


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, query_start_loc_ptr,
    out_ptr,
    qk_scale,  # softmax scale * log2(e): the kernel exponentiates with exp2
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh,
    stride_bt, block_size,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + b)
    q_begin = tl.load(query_start_loc_ptr + b)
    q_len = tl.load(query_start_loc_ptr + b + 1) - q_begin
    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, D_P)
    n = tl.arange(0, BLOCK_N)
    tok = r // GROUP  # row -> (query token of the sequence, head of the group)
    heads = kv_head * GROUP + r % GROUP
    row_mask = tok < q_len
    q_pos = context_len - q_len + tok  # the last key position this row may see
    q_mask = row_mask[:, None] & (d < D)[None, :]
    q_rows = (q_begin + tok).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=q_mask, other=0.0)
    q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running row max (log2 units)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running softmax denominator
    acc = tl.zeros([BLOCK_M, D_P], tl.float32)
    block_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    for start in range(0, context_len, BLOCK_N):
        pos = start + n
        n_mask = pos < context_len
        # Only entries below cdiv(context_len, block_size) are read: unused ones may be garbage.
        block = tl.load(block_row + pos // block_size, mask=n_mask, other=0).to(tl.int64)
        offset = pos % block_size
        kv_mask = n_mask[:, None] & (d < D)[None, :]
        k = tl.load(k_cache_ptr + block[:, None] * stride_kb + offset[:, None] * stride_ko
                    + kv_head * stride_kh + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale  # [BLOCK_M, BLOCK_N]
        s = tl.where(n_mask[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: the first tile always holds position 0
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + block[:, None] * stride_vb + offset[:, None] * stride_vo
                    + kv_head * stride_vh + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PREC)
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_mask)


def _check_args(query, key_cache, value_cache, block_tables, context_lens,
                query_start_loc) -> int:
    """Assert the launcher's contract; return the GQA group size Hq // Hkv."""
    check_kv_cache_pair(key_cache, value_cache)
    group = check_query(query, key_cache)
    batch = context_lens.shape[0]
    check_block_tables(block_tables, batch)
    assert context_lens.shape == (batch,) and context_lens.dtype == torch.int32, (
        f"context_lens must be [{batch}] int32, got {tuple(context_lens.shape)} {context_lens.dtype}"
    )
    if query_start_loc is None:
        assert query.shape[0] == batch, f"{query.shape[0]} query tokens for {batch} sequences"
    else:
        assert query_start_loc.shape == (batch + 1,) and query_start_loc.dtype == torch.int32, (
            f"query_start_loc must be [{batch + 1}] int32, got {tuple(query_start_loc.shape)}"
        )
        same_device(query, query_start_loc)
    same_device(query, key_cache, value_cache, block_tables, context_lens)
    return group


def paged_decode_attention_triton(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    query_start_loc: torch.Tensor | None = None,
    max_query_len: int = 1,
) -> torch.Tensor:
    """Triton launcher: asserts the contract of `paged_decode_attention_ref`, one program per
    (sequence, KV head). `max_query_len` (host metadata, no device sync) is the longest
    q_len: it sizes the tile (every token of a row in one program).

    Values are not checked (no device sync): `context_lens[b] < q_len`, q_len above
    max_query_len or block ids out of range are undefined behaviour.
    """
    group = _check_args(query, key_cache, value_cache, block_tables, context_lens,
                        query_start_loc)
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    batch, num_kv_heads, head_size = context_lens.shape[0], key_cache.shape[2], key_cache.shape[3]
    if batch == 0:
        return out
    if query_start_loc is None:
        max_query_len = 1
        query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device=query.device)
    with on_device(query):
        _paged_decode_kernel[(batch, num_kv_heads)](
            query, key_cache, value_cache, block_tables, context_lens, query_start_loc, out,
            scale * _LOG2E,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
            block_tables.stride(0), key_cache.shape[1],
            GROUP=group, BLOCK_M=pow2_at_least(max_query_len * group, 16), D=head_size,
            D_P=pow2_at_least(head_size, 16), BLOCK_N=_BLOCK_N,
            DOT_PREC=dot_precision(query.dtype), num_warps=4,
        )
    return out


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    query_start_loc: torch.Tensor | None = None,
    max_query_len: int = 1,
) -> torch.Tensor:
    """Attention of each sequence's query tokens `[T, Hq, D]` over its `context_lens[b]`
    cached tokens (the last q_len of them its own, causal; module docstring).

    Returns `[T, Hq, D]` in `query.dtype`. CUDA tensors run Triton, CPU tensors the reference.
    """
    if query.is_cuda:
        return paged_decode_attention_triton(query, key_cache, value_cache, block_tables,
                                             context_lens, scale, query_start_loc, max_query_len)
    return paged_decode_attention_ref(query, key_cache, value_cache, block_tables, context_lens,
                                      scale, query_start_loc)
