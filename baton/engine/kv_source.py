"""Where a request's cached (not computed) prompt tokens came from, in prompt order.

An engine knows, when it admits a request, which of its leading blocks were hits in its own
pool and which it loaded from a KV tier below it (kv_cache.py). It keeps that as *spans*:
run-length (source, num_tokens) pairs in prompt order, so a caller can cut them at any
token (decode keeps its own spans for the prefix it held and the prefill worker's after it):

    blocks  : pool pool host host disk pool?  ← a pool hit never follows a tier load
    spans   : ((POOL, 32), (HOST_TIER, 32), (DISK_TIER, 16))          block_size = 16
    take(spans, 40) = ((POOL, 32), (HOST_TIER, 8))
    skip(spans, 40) = ((HOST_TIER, 24), (DISK_TIER, 16))

A new place KV can come from (a shared store) is one more member here, its value naming the
proto's (STORE = "store" ↔ KV_SOURCE_STORE), and that value in protos/common.proto's
KVSource; the wire (baton/worker/wire.py), the gateway's `baton_cached_by` keys and the
metrics' `source` labels follow from the names.
"""
from __future__ import annotations

import enum
from collections.abc import Iterable

Spans = tuple[tuple["KVSource", int], ...]


class KVSource(enum.Enum):
    """An engine's view of where cached KV came from: its own pool, or a tier below it."""

    POOL = "pool"
    HOST_TIER = "host_tier"
    DISK_TIER = "disk_tier"
    STORE = "store"  # the cluster's KV store (kv_store.py)
    PEER = "peer"  # read from the requesting decode worker's pool (block_holds.add_pulling)


# the `tier` a claim names (kv_tier.py, kv_store.py) → its source
TIER_SOURCES = {"host": KVSource.HOST_TIER, "disk": KVSource.DISK_TIER,
                "store": KVSource.STORE}


def spans_of(sources: Iterable[KVSource], block_size: int) -> Spans:
    """Run-length spans of one source per block (each block = block_size tokens)."""
    out: list[tuple[KVSource, int]] = []
    for s in sources:
        if out and out[-1][0] is s:
            out[-1] = (s, out[-1][1] + block_size)
        else:
            out.append((s, block_size))
    return tuple(out)


def take(spans: Spans, num_tokens: int) -> Spans:
    """The spans of the first `num_tokens` tokens (all of them when there are fewer)."""
    out, left = [], max(0, num_tokens)
    for s, n in spans:
        if left <= 0:
            break
        out.append((s, min(n, left)))
        left -= n
    return tuple(out)


def skip(spans: Spans, num_tokens: int) -> Spans:
    """The spans after the first `num_tokens` tokens."""
    out, left = [], max(0, num_tokens)
    for s, n in spans:
        if left >= n:
            left -= n
            continue
        out.append((s, n - left))
        left = 0
    return tuple(out)


def total(spans: Spans) -> int:
    """Tokens the spans cover."""
    return sum(n for _, n in spans)
