"""KV layout descriptions and the compatibility hash both ends check before blocks move.

    kv_cache [num_blocks, num_layers, 2, block_size, num_kv_heads, head_size]   contiguous
    block b = kv_cache[b] = bytes [b * block_bytes, (b + 1) * block_bytes) of the cache

Two workers may exchange blocks only when their layouts agree on everything but num_blocks.
The hash covers exactly those fields plus the protocol version, so a handshake, an endpoint
or a first KV chunk can carry one fixed64 instead of the whole layout.
"""
from __future__ import annotations

import hashlib
import math

import torch

from protos import common_pb2

# Bump on any change to the block byte layout or to the transfer protocol.
KV_PROTOCOL_VERSION = 1

_KV_DTYPES = {
    torch.float32: common_pb2.KV_DTYPE_FLOAT32,
    torch.float16: common_pb2.KV_DTYPE_FLOAT16,
    torch.bfloat16: common_pb2.KV_DTYPE_BFLOAT16,
}
_ELEMENT_SIZE = {common_pb2.KV_DTYPE_FLOAT32: 4, common_pb2.KV_DTYPE_FLOAT16: 2, common_pb2.KV_DTYPE_BFLOAT16: 2}


class KVLayoutError(ValueError):
    """Two KV layouts (or a layout and a kv_cache tensor) disagree; no block may move."""


def kv_layout(model: str, kv_cache: torch.Tensor) -> common_pb2.KVLayout:
    """The KVLayout of a block-major `kv_cache` serving `model`. Raises KVLayoutError on a
    tensor that is not 6-d, contiguous and of a supported dtype."""
    if kv_cache.dim() != 6:
        raise KVLayoutError(
            "kv_cache must be [num_blocks, num_layers, 2, block_size, num_kv_heads, head_size], "
            f"got shape {tuple(kv_cache.shape)}")
    if kv_cache.dtype not in _KV_DTYPES:
        raise KVLayoutError(f"unsupported kv_cache dtype {kv_cache.dtype}")
    _, num_layers, two, block_size, num_kv_heads, head_size = kv_cache.shape
    if two != 2 or not kv_cache.is_contiguous():
        raise KVLayoutError(f"kv_cache must be contiguous with a K/V dim of 2, got {tuple(kv_cache.shape)}")
    return common_pb2.KVLayout(
        model=model, dtype=_KV_DTYPES[kv_cache.dtype], block_size=block_size, num_layers=num_layers,
        num_kv_heads=num_kv_heads, head_size=head_size, protocol_version=KV_PROTOCOL_VERSION)


def _describe(layout: common_pb2.KVLayout) -> tuple:
    return (layout.protocol_version, layout.model, common_pb2.KVDType.Name(layout.dtype),
            layout.block_size, layout.num_layers, layout.num_kv_heads, layout.head_size)


def kv_layout_hash(layout: common_pb2.KVLayout) -> int:
    """Compatibility hash of a layout: unsigned 64-bit (fits a proto fixed64), equal on every
    machine and process for equal layouts (BLAKE2b over a canonical text of the fields)."""
    text = "baton-kv|" + "|".join(map(str, _describe(layout)))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def block_bytes(layout: common_pb2.KVLayout) -> int:
    """Bytes of one block: all layers, K and V."""
    return (layout.num_layers * 2 * layout.block_size * layout.num_kv_heads * layout.head_size
            * _ELEMENT_SIZE[layout.dtype])


def check_compatible(local: common_pb2.KVLayout, remote: common_pb2.KVLayout) -> None:
    """Raise KVLayoutError naming every field where `remote` differs from `local`."""
    names = ("protocol_version", "model", "dtype", "block_size", "num_layers", "num_kv_heads", "head_size")
    diffs = [f"{n}: {a!r} != {b!r}" for n, a, b in zip(names, _describe(local), _describe(remote)) if a != b]
    if diffs:
        raise KVLayoutError("KV layouts differ (" + "; ".join(diffs) + ")")


def check_kv_cache(kv_cache: torch.Tensor, layout: common_pb2.KVLayout) -> None:
    """Raise KVLayoutError unless `kv_cache` is a contiguous cache of exactly `layout`."""
    check_compatible(layout, kv_layout(layout.model, kv_cache))
    assert math.prod(kv_cache.shape[1:]) * kv_cache.element_size() == block_bytes(layout)
