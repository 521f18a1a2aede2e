"""CPU path of the paged-attention kernels: index tensors built once per step, shared by every layer.

The `<name>_ref` functions are the references: each call re-derives its indices from the block
tables, which costs more than the attention itself for one decode token (on the 2-core CPU here,
~0.8 ms per layer). `PagedAttentionPlan` derives every index once per step, on the whole
block-major cache viewed as rows of one token's heads:

    kv_cache [num_blocks, L, 2, block_size, H, D]  ──view──▶  rows [num_blocks·L·2·block_size, H, D]
    row(block, layer, kv, offset) = ((block·L + layer)·2 + kv)·block_size + offset

so a layer costs one `index_copy_` (new K and V into their slots), one `index_select` (every
sequence's context, K and V together) and the SDPA calls: the same math as the references,
with the per-layer bookkeeping gone. Tests compare every method against its `_ref`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import cpu_decode, cpu_prefill


class PagedAttentionPlan:
    """Per-step indices for writing K/V and attending over the paged cache on CPU.

    Args (all CPU tensors):
        kv_cache_shape: (num_blocks, num_layers, 2, block_size, num_kv_heads, head_size).
        slot_mapping: [T] int64, slot of each new token (negative: skip, already cached).
        num_decode_tokens: Td; rows [0, Td) of the step are decode rows' query tokens.
        decode_block_tables: [Bd, max_blocks] int32 or None; decode_context_lens: [Bd] int32
            (tokens in cache including the new ones, each >= the row's query tokens).
        prefill_block_tables: [S, max_blocks] int32 or None; prefill_query_start_loc: [S+1]
            int32 offsets into the prefill rows; prefill_seq_lens: [S] int32 (cache length
            including the new tokens, >= q_len).

    Block-table entries past a sequence's last needed block are never followed. Raises
    IndexError (at `write_kv`) for a slot past the cache.
        decode_query_start_loc: [Bd+1] int32, or None when every decode row has one query
            token (Bd = Td); a row with more (a speculative decode row) attends causally, as
            `paged_decode_attention_ref` with its query_start_loc.
    """

    def __init__(
        self,
        kv_cache_shape: tuple[int, ...],
        slot_mapping: torch.Tensor,
        num_decode_tokens: int,
        decode_block_tables: torch.Tensor | None = None,
        decode_context_lens: torch.Tensor | None = None,
        prefill_block_tables: torch.Tensor | None = None,
        prefill_query_start_loc: torch.Tensor | None = None,
        prefill_seq_lens: torch.Tensor | None = None,
        decode_query_start_loc: torch.Tensor | None = None,
    ) -> None:
        _, num_layers, _, block_size, num_kv_heads, head_size = kv_cache_shape
        self.num_kv_heads, self.head_size = num_kv_heads, head_size
        self._bs = block_size
        self._block_rows = num_layers * 2 * block_size  # rows per block, all layers
        layer_offsets = torch.arange(num_layers, dtype=torch.int64)[:, None] * (2 * block_size)

        # write: [L, 2·Tk] rows, K rows then V rows of the kept tokens, on the first write_kv
        # (a bf16 step with the native ops writes through kernels.cpu_rope instead)
        self._slot_mapping = slot_mapping
        self._write = None  # (source rows or None for all, rows per layer)

        # decode: the native op's tables; the torch path's indices on its first use
        self.num_decode_tokens = num_decode_tokens
        self._decode_query_start_loc = decode_query_start_loc  # speculative rows when given
        self._native_decode = None  # decided on the first decode_attention call
        self._decode_torch = None  # (rows per layer, shape, mask, multi): _decode_plan()
        if num_decode_tokens:
            self._decode_tables = decode_block_tables.int().contiguous()
            self._decode_lens = decode_context_lens.int().contiguous()

        # prefill: each sequence's (q0, q1, block table, seq_len); the torch path's gather
        # rows are derived on its first use (the native bf16 op reads the cache in place)
        self._kv_shape = kv_cache_shape
        self._layer_offsets = layer_offsets
        self._prefill_seqs = []
        if prefill_seq_lens is not None and len(prefill_seq_lens):
            starts = prefill_query_start_loc.tolist()
            for s, seq_len in enumerate(prefill_seq_lens.tolist()):
                if starts[s + 1] > starts[s]:
                    self._prefill_seqs.append((starts[s], starts[s + 1],
                                               prefill_block_tables[s], seq_len))
        self._prefill = None  # torch path: (q0, q1, n0, n1, mask or None for plain causal)
        self._native_prefill = None  # decided on the first prefill_attention call

    def _decode_plan(self) -> tuple:
        """The torch path's decode indices: [L, 2·Bd·N] rows of each sequence's first N
        positions (N = the longest context), the gathered shape, the mask of keys past a
        sequence's length (None when every length is N), and the speculative rows' layout
        (`_multi_token_rows`, None without such rows)."""
        if self._decode_torch is None:
            lens = self._decode_lens.long()
            n = int(lens.max())
            pos = torch.arange(n)
            rows = self._table_rows(self._decode_tables, lens, pos)  # [Bd, N]
            shape = (2, len(lens), n, self.num_kv_heads, self.head_size)
            rows = (torch.stack([rows, rows + self._bs]).flatten()[None]
                    + self._layer_offsets).unbind()
            mask = multi = None
            if self._decode_query_start_loc is not None:
                multi = _multi_token_rows(lens, self._decode_query_start_loc, pos)
            elif bool((lens != n).any()):
                mask = (pos[None, :] < lens[:, None])[:, None, None, :]
            self._decode_torch = (rows, shape, mask, multi)
        return self._decode_torch

    def _rows(self, slots: torch.Tensor) -> torch.Tensor:
        """Layer-0 K row of each slot."""
        return (slots // self._bs) * self._block_rows + slots % self._bs

    def _table_rows(self, tables: torch.Tensor, lens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """[B, N] layer-0 K rows of positions `pos` through each block table; positions at or past
        a sequence's length point at block 0 (their scores are masked)."""
        idx = (pos // self._bs)[None, :].expand(tables.shape[0], -1)
        used = pos[None, :] < lens[:, None]
        blocks = torch.where(used, tables.long().gather(1, idx), 0)
        return blocks * self._block_rows + pos % self._bs

    def write_kv(self, kv_rows: torch.Tensor, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Write this step's key/value `[T, H, D]` of `layer` into `kv_rows` (the cache as rows
        `[num_blocks·L·2·block_size, H, D]`, a view), in place. Same result as `write_kv_ref`."""
        if self._write is None:
            slots, src = self._slot_mapping, None
            keep = slots >= 0
            if not bool(keep.all()):
                src = keep.nonzero().squeeze(1)
                slots = slots[src]
            base = self._rows(slots)
            self._write = (src, (torch.cat([base, base + self._bs])[None]
                                 + self._layer_offsets).unbind())
        src, rows = self._write
        if src is not None:
            key, value = key[src], value[src]
        kv_rows.index_copy_(0, rows[layer], torch.cat([key, value]))

    def decode_attention(self, kv_rows: torch.Tensor, layer: int, query: torch.Tensor,
                         scale: float) -> torch.Tensor:
        """query `[Td, Hq, D]` → `[Td, Hq, D]`; same math as `paged_decode_attention_ref`.
        One query token a row, fp32 or bf16 where `kernels.cpu_decode.use_fused`: that module's
        native attention, in place (a row's bits as in a decode-only step's fused op, whatever
        else the step holds). Otherwise torch's SDPA over the gathered contexts:

        The GQA group rides in SDPA's query-length dimension ([Bd, Hkv, group, D]), so K/V are
        never repeated per query head; a speculative row's tokens ride there too (padded to
        the longest row, [Bd, Hkv, group·Q, D], masked causally)."""
        t, hq, d = query.shape
        if self._native_decode is None:
            self._native_decode = (self._decode_query_start_loc is None
                                   and cpu_decode.use_fused(query.dtype)
                                   and cpu_decode.supported(kv_rows.view(self._kv_shape), hq))
        if self._native_decode:  # kernels/cpu_decode.py: in place, as a decode-only step's
            return cpu_decode.decode_attend(query.contiguous(), kv_rows.view(self._kv_shape),
                                            layer, self._decode_tables, self._decode_lens, scale)
        rows, shape, mask, multi = self._decode_plan()
        k, v = kv_rows.index_select(0, rows[layer]).view(shape).transpose(2, 3).unbind()
        hkv, g = self.num_kv_heads, hq // self.num_kv_heads  # k, v: [Bd, Hkv, N, D] each
        if multi is None:
            q = query.reshape(t, hkv, g, d)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
            return out.reshape(t, hq, d)
        nq, places, allowed = multi
        b = k.shape[0]
        padded = query.new_zeros(b * nq, hq, d).index_copy_(0, places, query)
        q = padded.view(b, nq, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * nq, d)
        mask = allowed.repeat(1, g, 1)[:, None]  # [Bd, 1, g·Q, N]: rows (head, token)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        out = out.view(b, hkv, g, nq, d).permute(0, 3, 1, 2, 4).reshape(b * nq, hq, d)
        return out.index_select(0, places)

    def _gather_plan(self) -> None:
        """The torch path's indices: [L, 2·ΣN] rows of each sequence's whole context,
        sequences back to back, and each sequence's SDPA slice and mask."""
        self._prefill, all_rows, n0 = [], [], 0
        for q0, q1, table, seq_len in self._prefill_seqs:
            pos = torch.arange(seq_len)
            all_rows.append(self._table_rows(table[None], torch.tensor([seq_len]), pos)[0])
            mask = None
            if q1 - q0 != seq_len:  # SDPA's is_causal aligns top-left; ours bottom-right
                q_pos = torch.arange(seq_len - (q1 - q0), seq_len)
                mask = pos[None, :] <= q_pos[:, None]
            self._prefill.append((q0, q1, n0, n0 + seq_len, mask))
            n0 += seq_len
        rows = torch.cat(all_rows)
        self._prefill_len = n0
        self._prefill_rows = (torch.stack([rows, rows + self._bs]).flatten()[None]
                              + self._layer_offsets).unbind()

    def prefill_attention(self, kv_rows: torch.Tensor, layer: int, query: torch.Tensor,
                          scale: float, rows: int = 0) -> torch.Tensor:
        """query `[Tp, Hq, D]` (packed prefill rows) → `[Tp, Hq, D]`; same math as
        `prefill_attention_ref` (causal, aligned to each sequence's end). bf16 on a CPU with
        AVX512_BF16: `kernels.cpu_prefill`'s native op per sequence (chunking-invariant);
        otherwise torch's SDPA over the gathered context. rows > Tp: the output is the first
        Tp rows of a zero-tailed buffer of `rows` (`kernels.cpu_decode.rows_out`)."""
        tp, hq, d = query.shape
        out = cpu_decode.rows_out(rows, tp, hq * d, query.dtype).view(tp, hq, d)
        if not self._prefill_seqs:
            return out
        if self._native_prefill is None:
            self._native_prefill = (query.dtype == torch.bfloat16 and cpu_prefill.available()
                                    and cpu_prefill.supported(query, kv_rows.view(self._kv_shape)))
        if self._native_prefill:  # kernels/cpu_prefill.py: in place, no gather
            cache = kv_rows.view(self._kv_shape)
            for q0, q1, table, seq_len in self._prefill_seqs:
                out[q0:q1] = cpu_prefill.prefill_attention(query[q0:q1], cache, layer, table,
                                                           seq_len, scale)
            return out
        if self._prefill is None:
            self._gather_plan()
        kv = kv_rows.index_select(0, self._prefill_rows[layer]).view(
            2, self._prefill_len, self.num_kv_heads, self.head_size)
        for q0, q1, n0, n1, mask in self._prefill:
            o = F.scaled_dot_product_attention(
                query[q0:q1].transpose(0, 1)[None], kv[0, n0:n1].transpose(0, 1)[None],
                kv[1, n0:n1].transpose(0, 1)[None], attn_mask=mask, is_causal=mask is None,
                scale=scale, enable_gqa=True)
            out[q0:q1] = o[0].transpose(0, 1)
        return out


def _multi_token_rows(lens: torch.Tensor, query_start_loc: torch.Tensor,
                      pos: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(Q, places, allowed) of decode rows with q_len query tokens each: Q = the longest
    q_len; places [Td] int64, each token's index in the rows padded to Q ([Bd·Q]); allowed
    [Bd, Q, N] bool, token t of row b sees positions <= lens[b] - q_len[b] + t (a padding
    token repeats the row's last, so no row of SDPA is all masked)."""
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
    nq = int(q_lens.max())
    tok = torch.arange(nq)
    real = tok[None, :] < q_lens[:, None]  # [Bd, Q]
    places = (torch.arange(len(q_lens))[:, None] * nq + tok[None, :])[real]
    last = lens[:, None] - q_lens[:, None] + torch.minimum(tok[None, :], q_lens[:, None] - 1)
    return nq, places, pos[None, None, :] <= last[:, :, None]
