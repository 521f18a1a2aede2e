"""Causal attention of new tokens over a paged KV cache (prefill, chunked prefill and decode).

    query [T, Hq, D]  packed: sequence s owns rows query_start_loc[s] : query_start_loc[s+1]
    seq_lens [S]      tokens of s in the cache, its new tokens included (write_kv ran first)
    block_tables [S, max_blocks] int32,  key_cache / value_cache [num_blocks, block_size, Hkv, D]

    sequence s, seq_len = 11, q_len = 3  (8 cached prefix tokens, then 3 new ones):
        key position   0 1 2 3 4 5 6 7 8 9 10
        query 0 (p=8)  x x x x x x x x x . .
        query 1 (p=9)  x x x x x x x x x x .
        query 2 (p=10) x x x x x x x x x x x      query i sits at p = seq_len - q_len + i

The Triton kernel is FlashAttention-2 (Dao, 2023) over the paged cache, as in vLLM's
`context_attention_fwd` / unified attention: one program per (sequence, KV head, query tile).
A tile's rows are (query token, query head of this KV head's group) pairs, so GQA groups share
every K/V load; keys are walked in tiles of `_BLOCK_N` positions up to the tile's last query,
each position's physical block looked up in the block table. Softmax is online, in fp32.
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

_BLOCK_N = 64  # key positions per tile
_MAX_ROWS = 64  # (query token, query head) rows per program
_LOG2E = 1.4426950408889634


def prefill_attention_ref(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Torch reference and CPU path: per sequence, gather its context and run one masked SDPA.

    Shapes as in the module docstring; returns `[T, Hq, D]` in `query.dtype`. Requires
    `0 <= q_len <= seq_len` for every sequence (q_len = 0 sequences are skipped).
    """
    out = torch.empty_like(query)
    block_size = key_cache.shape[1]
    starts = query_start_loc.tolist()
    for s, seq_len in enumerate(seq_lens.tolist()):
        q0, q1 = starts[s], starts[s + 1]
        q_len = q1 - q0
        if q_len == 0:
            continue
        ids = block_tables[s, : -(-seq_len // block_size)].long()
        # [1, Hkv, seq_len, D]: index_select beats cache[ids]; 4-D inputs keep SDPA on its fused CPU path.
        k = key_cache.index_select(0, ids).flatten(0, 1)[:seq_len].transpose(0, 1)[None]
        v = value_cache.index_select(0, ids).flatten(0, 1)[:seq_len].transpose(0, 1)[None]
        q = query[q0:q1].transpose(0, 1)[None]  # [1, Hq, q_len, D]
        mask = None
        if q_len != seq_len:  # SDPA's is_causal aligns top-left; ours aligns bottom-right
            q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
            mask = torch.arange(seq_len, device=query.device)[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
        )
        out[q0:q1] = o[0].transpose(0, 1)
    return out


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, out_ptr,
    qk_scale,  # softmax scale * log2(e): the kernel exponentiates with exp2
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh,
    stride_bt, block_size,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    D: tl.constexpr, D_P: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_begin = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_begin
    seq_len = tl.load(seq_lens_ptr + seq)
    tile_start = tl.program_id(2) * BLOCK_Q  # first query token (local to the sequence) of this tile
    if tile_start >= q_len:
        return
    prefix = seq_len - q_len

    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, D_P)
    n = tl.arange(0, BLOCK_N)
    tok = tile_start + r // GROUP  # row -> (token, head of the group)
    heads = kv_head * GROUP + r % GROUP
    row_mask = (r < BLOCK_Q * GROUP) & (tok < q_len)
    q_pos = prefix + tok  # absolute position: the last key this row may see
    q_mask = row_mask[:, None] & (d < D)[None, :]
    q_rows = (q_begin + tok).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)
    q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running row max (log2 units)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running softmax denominator
    acc = tl.zeros([BLOCK_M, D_P], tl.float32)
    block_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    kv_end = prefix + tl.minimum(tile_start + BLOCK_Q, q_len)  # one past the tile's last query position
    for start in range(0, kv_end, BLOCK_N):
        pos = start + n
        n_mask = pos < kv_end
        block = tl.load(block_row + pos // block_size, mask=n_mask, other=0).to(tl.int64)
        offset = pos % block_size
        kv_mask = n_mask[:, None] & (d < D)[None, :]
        k = tl.load(k_cache_ptr + block[:, None] * stride_kb + offset[:, None] * stride_ko
                    + kv_head * stride_kh + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale  # [BLOCK_M, BLOCK_N]
        s = tl.where(n_mask[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every row sees position 0 in the first tile
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


def _check_args(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens) -> int:
    """Assert the launcher's contract; return the GQA group size Hq // Hkv."""
    check_kv_cache_pair(key_cache, value_cache)
    group = check_query(query, key_cache)
    num_seqs = seq_lens.shape[0]
    assert seq_lens.dim() == 1 and seq_lens.dtype == torch.int32, f"seq_lens must be [S] int32, got {seq_lens.dtype}"
    assert query_start_loc.shape == (num_seqs + 1,) and query_start_loc.dtype == torch.int32, (
        f"query_start_loc must be [{num_seqs + 1}] int32, got {tuple(query_start_loc.shape)} {query_start_loc.dtype}"
    )
    check_block_tables(block_tables, num_seqs)
    same_device(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens)
    return group


def prefill_attention_triton(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_q_len: int | None = None,
) -> torch.Tensor:
    """Triton launcher: asserts the contract of `prefill_attention_ref`, then launches
    `(S, Hkv, cdiv(max_q_len, tokens per tile))` programs.

    `max_q_len` (the longest q_len) sizes the grid; pass it from host metadata to avoid the
    device sync of computing it here. Values are not checked: q_len > seq_len or block ids out
    of range are undefined behaviour.
    """
    group = _check_args(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens)
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    num_seqs, num_kv_heads, head_size = seq_lens.shape[0], key_cache.shape[2], key_cache.shape[3]
    if max_q_len is None:
        max_q_len = int((query_start_loc[1:] - query_start_loc[:-1]).max()) if num_seqs else 0
    if max_q_len == 0:
        return out
    rows = min(_MAX_ROWS, pow2_at_least(max_q_len * group, 16))
    rows = max(rows, pow2_at_least(group, 16))  # at least one whole group per tile
    block_q = rows // group
    grid = (num_seqs, num_kv_heads, triton.cdiv(max_q_len, block_q))
    with on_device(query):
        _prefill_kernel[grid](
            query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, out,
            scale * _LOG2E,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
            block_tables.stride(0), key_cache.shape[1],
            GROUP=group, BLOCK_Q=block_q, BLOCK_M=rows, D=head_size, D_P=pow2_at_least(head_size, 16),
            BLOCK_N=_BLOCK_N, DOT_PREC=dot_precision(query.dtype),
            num_warps=8 if rows >= 32 else 4,  # sm_90 ptxas: 4 warps at 64 rows spill registers
        )
    return out


def prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_q_len: int | None = None,
) -> torch.Tensor:
    """Causal attention of packed new tokens `[T, Hq, D]` over cached prefix + themselves.

    Returns `[T, Hq, D]` in `query.dtype`. CUDA tensors run Triton (`max_q_len`, if given,
    saves a device sync), CPU tensors the reference.
    """
    if query.is_cuda:
        return prefill_attention_triton(
            query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale, max_q_len
        )
    return prefill_attention_ref(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale)
