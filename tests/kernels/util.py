"""Shared builders and the tolerance rule for the kernel tests.

Tolerance (STYLE.md, after the Triton/FlashAttention tests):
    max|kernel - ref_fp32| <= 2 * max|torch_same_dtype - ref_fp32| + atol
where ref_fp32 runs the torch reference on the same (already rounded) inputs upcast to fp32.
"""
from __future__ import annotations

import torch

# Triton's interpreter turns fp32 into bf16 by truncation, not round-to-nearest (GPUs round), so
# a bf16 kernel output may sit one bf16 ulp (2**-7 relative) from the fp32 result: atol allows it.
_ATOL = {torch.float32: 1e-5, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def assert_close_to_fp32(kernel: torch.Tensor, same_dtype: torch.Tensor, ref_fp32: torch.Tensor) -> None:
    assert kernel.dtype == same_dtype.dtype and kernel.shape == ref_fp32.shape
    err = (kernel.float() - ref_fp32).abs().max().item()
    base = (same_dtype.float() - ref_fp32).abs().max().item()
    atol = _ATOL[kernel.dtype] * max(1.0, ref_fp32.abs().max().item())
    assert err <= 2 * base + atol, f"kernel err {err:.3g} > 2 * torch {kernel.dtype} err {base:.3g} + {atol:.3g}"


def make_kv_cache(num_blocks: int, num_layers: int, block_size: int, num_kv_heads: int, head_size: int,
                  dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random block-major cache `[num_blocks, num_layers, 2, block_size, Hkv, D]`."""
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, num_layers, 2, block_size, num_kv_heads, head_size)
    return torch.randn(shape, generator=g).to(dtype)


def make_block_tables(lens: list[int], block_size: int, num_blocks: int, max_blocks: int, fill: int,
                      seed: int = 0) -> torch.Tensor:
    """`[len(lens), max_blocks]` int32 tables of distinct shuffled block ids; unused entries = `fill`."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.full((len(lens), max_blocks), fill, dtype=torch.int32)
    for row, length in enumerate(lens):
        used = -(-length // block_size)
        assert used <= max_blocks and used <= len(ids), "test shape needs more blocks"
        tables[row, :used] = torch.tensor(ids[:used], dtype=torch.int32)
        ids = ids[used:]
    return tables


def cached_positions(cache: torch.Tensor, table_row: list[int], num_tokens: int) -> torch.Tensor:
    """`[num_tokens, H, D]` fp64, one position at a time through the block table (the oracle's gather)."""
    block_size = cache.shape[1]
    rows = [cache[table_row[p // block_size], p % block_size] for p in range(num_tokens)]
    return torch.stack(rows).double()


def oracle_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                     q_positions: list[int]) -> torch.Tensor:
    """fp64 causal attention, one query token at a time: q `[Lq, Hq, D]`, keys/values `[Lk, Hkv, D]`."""
    q, group = q.double(), q.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(group, dim=1)  # [Lk, Hq, D]
    values = values.repeat_interleave(group, dim=1)
    out = torch.empty_like(q)
    for i, pos in enumerate(q_positions):
        scores = torch.einsum("hd,khd->hk", q[i], keys[: pos + 1]) * scale  # [Hq, pos + 1]
        out[i] = torch.einsum("hk,khd->hd", scores.softmax(-1), values[: pos + 1])
    return out
