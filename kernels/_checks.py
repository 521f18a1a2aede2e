"""Launcher-side checks and tile-size helpers shared by the kernels.

The launchers assert everything a Triton kernel cannot check itself (shapes, dtypes, strides,
devices) before launch, so a wrong call fails with a message instead of reading wrong memory.
They never look at tensor *values* (that would force a device sync on every step).
"""
from __future__ import annotations

import contextlib

import torch
import triton

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def pow2_at_least(n: int, floor: int = 1) -> int:
    """Smallest power of two >= max(n, floor): `tl.arange` lengths must be powers of two."""
    return max(floor, triton.next_power_of_2(max(int(n), 1)))


def on_device(t: torch.Tensor):
    """Context for a kernel launch on `t`'s GPU: Triton launches on the current CUDA device,
    which is per thread (0 in a fresh one), so a launch from a worker's engine or transfer
    thread for a cache on cuda:1 would otherwise go to GPU 0. No-op for CPU tensors (the
    interpreter)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def same_device(*tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors}
    assert len(devices) == 1, f"all tensors must be on one device, got {sorted(map(str, devices))}"


def check_kv_cache_pair(key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Assert a key/value cache pair of one layer; return (num_blocks, block_size, num_kv_heads, head_size).

    Each cache is `[num_blocks, block_size, num_kv_heads, head_size]`, typically the strided view
    `kv_cache[:, layer, 0]` / `kv_cache[:, layer, 1]` of the block-major cache; any strides are
    accepted as long as the last dimension is contiguous.
    """
    assert key_cache.dim() == 4, f"key_cache must be [num_blocks, block_size, H, D], got {tuple(key_cache.shape)}"
    assert key_cache.shape == value_cache.shape, (
        f"key_cache {tuple(key_cache.shape)} and value_cache {tuple(value_cache.shape)} differ"
    )
    assert key_cache.dtype == value_cache.dtype, f"cache dtypes differ: {key_cache.dtype} vs {value_cache.dtype}"
    assert key_cache.dtype in FLOAT_DTYPES, f"unsupported cache dtype {key_cache.dtype}"
    assert key_cache.stride(-1) == 1 and value_cache.stride(-1) == 1, "cache head_size dim must have stride 1"
    return tuple(key_cache.shape)  # type: ignore[return-value]


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot` input precision for operands that were loaded as `dtype` and upcast to fp32.

    fp32 inputs get full IEEE products (TF32 would drift from the fp32 reference); bf16/fp16
    values are exactly representable in TF32, so TF32 tensor cores lose nothing on Q·K.
    """
    return "ieee" if dtype == torch.float32 else "tf32"


def check_query(query: torch.Tensor, key_cache: torch.Tensor) -> int:
    """Assert `query` `[N, Hq, D]` fits a `[.., Hkv, D]` cache; return the GQA group size Hq // Hkv."""
    assert query.dim() == 3, f"query must be [tokens, Hq, D], got {tuple(query.shape)}"
    num_q_heads, head_size = query.shape[1:]
    num_kv_heads = key_cache.shape[2]
    assert head_size == key_cache.shape[3], f"query head_size {head_size} != cache head_size {key_cache.shape[3]}"
    assert num_q_heads % num_kv_heads == 0, f"Hq={num_q_heads} is not a multiple of Hkv={num_kv_heads}"
    assert query.dtype == key_cache.dtype, f"query dtype {query.dtype} != cache dtype {key_cache.dtype}"
    assert query.stride(-1) == 1, "query head_size dim must have stride 1"
    return num_q_heads // num_kv_heads


def check_block_tables(block_tables: torch.Tensor, num_seqs: int) -> None:
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_seqs, (
        f"block_tables must be [{num_seqs}, max_blocks], got {tuple(block_tables.shape)}"
    )
    assert block_tables.dtype == torch.int32, f"block_tables must be int32, got {block_tables.dtype}"
    assert block_tables.stride(1) == 1, "block_tables rows must be contiguous"
