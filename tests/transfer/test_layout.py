"""KV layout description and compatibility hash."""
from __future__ import annotations

import pytest
import torch

from baton.transfer import (
    KV_PROTOCOL_VERSION,
    KVLayoutError,
    block_bytes,
    check_compatible,
    kv_layout,
    kv_layout_hash,
)
from protos import common_pb2


def test_layout_of_a_cache():
    layout = kv_layout("m", torch.zeros(10, 3, 2, 16, 4, 64, dtype=torch.bfloat16))
    assert (layout.num_layers, layout.block_size, layout.num_kv_heads, layout.head_size) == (3, 16, 4, 64)
    assert layout.dtype == common_pb2.KV_DTYPE_BFLOAT16
    assert layout.protocol_version == KV_PROTOCOL_VERSION
    assert block_bytes(layout) == 3 * 2 * 16 * 4 * 64 * 2


def test_hash_is_stable_and_covers_every_field():
    base = common_pb2.KVLayout(model="m", dtype=common_pb2.KV_DTYPE_FLOAT32, block_size=16, num_layers=30,
                               num_kv_heads=3, head_size=64, protocol_version=1)
    # Pinned: the hash must not change between processes, machines or releases.
    assert kv_layout_hash(base) == kv_layout_hash(common_pb2.KVLayout.FromString(base.SerializeToString()))
    assert kv_layout_hash(base) == 0xD820AC486254E7E2
    seen = {kv_layout_hash(base)}
    for field, value in [("model", "m2"), ("dtype", common_pb2.KV_DTYPE_BFLOAT16), ("block_size", 32),
                         ("num_layers", 29), ("num_kv_heads", 6), ("head_size", 128), ("protocol_version", 2)]:
        other = common_pb2.KVLayout()
        other.CopyFrom(base)
        setattr(other, field, value)
        seen.add(kv_layout_hash(other))
        with pytest.raises(KVLayoutError, match=field):
            check_compatible(base, other)
    assert len(seen) == 8
    check_compatible(base, base)


def test_unsupported_caches_are_refused():
    with pytest.raises(KVLayoutError):
        kv_layout("m", torch.zeros(10, 3, 2, 16, 4))
    with pytest.raises(KVLayoutError):
        kv_layout("m", torch.zeros(10, 3, 2, 16, 4, 8, dtype=torch.int8))
    with pytest.raises(KVLayoutError):
        kv_layout("m", torch.zeros(10, 3, 3, 16, 4, 8))
