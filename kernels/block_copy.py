"""Pack chosen KV blocks into one contiguous buffer for transfer, and unpack them back.

    kv_cache [num_blocks, num_layers, 2, block_size, Hkv, D]   (block-major: one block, all layers,
                                                                is one contiguous row)
    pack_blocks(kv_cache, block_ids=[7, 2, 9]) ─▶ buffer [3, num_layers, 2, block_size, Hkv, D]
        buffer[0] = kv_cache[7], buffer[1] = kv_cache[2], buffer[2] = kv_cache[9]
    unpack_blocks(buffer, kv_cache, block_ids=[4, 0, 5]) ─▶ kv_cache[4] = buffer[0], ...

Prefill packs the blocks it computed into a (possibly registered) staging buffer; decode
unpacks a received buffer into the blocks it allocated. Same job as vLLM's `swap_blocks` and
the block gather/scatter around NIXL staging buffers. Only the block dimension may be strided:
each block's `block_shape` must be contiguous. The Triton kernel copies raw bits (the tensors
are viewed as integers of the element's width), one program per (block, chunk of a block).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels._checks import on_device, same_device

_CHUNK = 4096  # elements per program
_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _check(cache: torch.Tensor, buffer: torch.Tensor, block_ids: torch.Tensor) -> None:
    assert cache.dim() >= 2, f"kv_cache must be [num_blocks, *block_shape], got {tuple(cache.shape)}"
    assert buffer.shape[1:] == cache.shape[1:], (
        f"buffer rows {tuple(buffer.shape[1:])} != blocks {tuple(cache.shape[1:])}"
    )
    assert buffer.shape[0] == block_ids.shape[0], f"buffer holds {buffer.shape[0]} rows for {block_ids.shape[0]} ids"
    assert buffer.dtype == cache.dtype, f"buffer dtype {buffer.dtype} != cache dtype {cache.dtype}"
    assert block_ids.dim() == 1 and block_ids.dtype == torch.int64, (
        f"block_ids must be [N] int64, got {tuple(block_ids.shape)} {block_ids.dtype}"
    )
    for name, t in (("kv_cache", cache), ("buffer", buffer)):
        assert t.shape[0] == 0 or t[0].is_contiguous(), f"{name}: each block must be contiguous"
    same_device(cache, buffer, block_ids)


def pack_blocks_ref(kv_cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference and CPU path: `out[i] = kv_cache[block_ids[i]]`; returns `out`.

    Shapes: `kv_cache` `[num_blocks, *block_shape]`, `block_ids` `[N]` int64, `out` (optional,
    e.g. a staging buffer) `[N, *block_shape]` of the cache's dtype; allocated contiguous when None.
    Raises IndexError for an id outside `[0, num_blocks)`.
    """
    if out is None:
        return kv_cache.index_select(0, block_ids)
    _check(kv_cache, out, block_ids)
    torch.index_select(kv_cache, 0, block_ids, out=out)
    return out


def unpack_blocks_ref(buffer: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    """Torch reference and CPU path: `kv_cache[block_ids[i]] = buffer[i]` in place.

    Shapes as in `pack_blocks_ref`; ids should be distinct (with repeats, which row lands is
    unspecified). Raises IndexError for an id outside `[0, num_blocks)`.
    """
    kv_cache.index_copy_(0, block_ids, buffer)


@triton.jit
def _copy_blocks_kernel(src_ptr, dst_ptr, ids_ptr, stride_src, stride_dst, block_numel,
                        GATHER: tl.constexpr, CHUNK: tl.constexpr):
    # GATHER: dst row i <- src row ids[i] (pack); else dst row ids[i] <- src row i (unpack).
    i = tl.program_id(0)
    chunk = tl.program_id(1)
    block_id = tl.load(ids_ptr + i)
    if GATHER:
        src_row = block_id
        dst_row = i.to(tl.int64)
    else:
        src_row = i.to(tl.int64)
        dst_row = block_id
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offs < block_numel
    # Raw integer bits: no arithmetic, so no fp32 upcast is needed.
    x = tl.load(src_ptr + src_row * stride_src + offs, mask=mask)
    tl.store(dst_ptr + dst_row * stride_dst + offs, x, mask=mask)


def _launch_copy(src: torch.Tensor, dst: torch.Tensor, block_ids: torch.Tensor, gather: bool) -> None:
    count = block_ids.shape[0]
    numel = math.prod(src.shape[1:])
    if count == 0 or numel == 0:
        return
    as_int = _INT_OF_WIDTH[src.element_size()]
    grid = (count, triton.cdiv(numel, _CHUNK))
    with on_device(src):
        _copy_blocks_kernel[grid](
            src.view(as_int), dst.view(as_int), block_ids, src.stride(0), dst.stride(0), numel,
            GATHER=gather, CHUNK=_CHUNK,
        )


def pack_blocks_triton(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Triton launcher of `pack_blocks`: asserts shapes, dtypes, contiguity, devices. Ids are not
    range-checked (no device sync): an id outside the cache is undefined behaviour."""
    if out is None:
        out = kv_cache.new_empty((block_ids.shape[0], *kv_cache.shape[1:]))
    _check(kv_cache, out, block_ids)
    _launch_copy(kv_cache, out, block_ids, gather=True)
    return out


def unpack_blocks_triton(buffer: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    """Triton launcher of `unpack_blocks`: asserts as `pack_blocks_triton`; ids must be distinct."""
    _check(kv_cache, buffer, block_ids)
    _launch_copy(buffer, kv_cache, block_ids, gather=False)


def pack_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy blocks `block_ids` `[N]` of `kv_cache` into `out` (or a new contiguous buffer)
    `[N, *block_shape]` and return it. CUDA tensors run Triton, CPU tensors the reference."""
    if kv_cache.is_cuda:
        return pack_blocks_triton(kv_cache, block_ids, out)
    return pack_blocks_ref(kv_cache, block_ids, out)


def unpack_blocks(buffer: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    """Write `buffer[i]` into block `block_ids[i]` of `kv_cache` in place (ids distinct).
    CUDA tensors run Triton, CPU tensors the reference."""
    if kv_cache.is_cuda:
        unpack_blocks_triton(buffer, kv_cache, block_ids)
    else:
        unpack_blocks_ref(buffer, kv_cache, block_ids)
