"""What sits below one worker's pool: its own KV tier (host, disk: kv_tier.py), the
cluster's KV store (kv_store.py), or both stacked, behind the one interface KVCacheManager
calls (offload, publish, claim, finish, contains, counts, flush).

    prefix walk after the pool's hits:  tier.claim(h) ─miss─▶ store.claim(h) ─miss─▶ stop
    pool eviction:                      tier.offload  (the store already has what ended)
    request end (kv_cache.free):        store.publish (its full blocks the store lacks)
"""
from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch

from baton.config import CacheConfig
from baton.engine.block_pool import Block
from baton.engine.kv_store import StoreClaim, StoreTier
from baton.engine.kv_tier import KVTier, TierCounts, tier_for
from baton.engine.store_client import MooncakeClient
from baton.transfer.layout import kv_layout, kv_layout_hash


class TierStack:
    """A KVTier (or None) with a StoreTier beside it; the KVTier interface over both."""

    def __init__(self, tier: KVTier | None, store: StoreTier) -> None:
        self.tier, self.store = tier, store

    @property
    def recomputed_blocks(self) -> int:
        return (self.tier.recomputed_blocks if self.tier is not None else 0) \
            + self.store.recomputed_blocks

    def offload(self, blocks: Sequence[Block]) -> None:
        if self.tier is not None:
            self.tier.offload(blocks)

    def publish(self, blocks: Sequence[Block]) -> None:
        self.store.publish(blocks)

    def claim(self, block_hash: int, tokens: Sequence[int]):
        claim = self.tier.claim(block_hash, tokens) if self.tier is not None else None
        return claim if claim is not None else self.store.claim(block_hash, tokens)

    def finish(self, claim, block_id: int) -> None:
        if isinstance(claim, StoreClaim):
            self.store.finish(claim, block_id)
        else:
            self.tier.finish(claim, block_id)

    def contains(self, block_hash: int) -> bool:
        return (self.tier is not None and self.tier.contains(block_hash)) \
            or self.store.contains(block_hash)

    def counts(self) -> tuple[TierCounts, ...]:
        return (*(self.tier.counts() if self.tier is not None else ()), self.store.counts())

    def flush(self) -> None:
        if self.tier is not None:
            self.tier.flush()
        self.store.flush()


def tiers_for(kv_cache: torch.Tensor, cache: CacheConfig, model: str):
    """What CacheConfig asks for below the pool of `kv_cache`: None, a KVTier, or a
    TierStack with the store at `cache.kv_store_url`, its keys in the namespace of the KV
    layout's hash (`cache.kv_store_model`, else `model`'s folder or registered name, as
    worker/flags.served_model_name: workers that may exchange blocks share keys).
    An unreachable store is not an error (the worker serves without it until it answers);
    ValueError for a bad URL."""
    tier = tier_for(kv_cache, cache)
    if not (cache.enable_prefix_caching and cache.kv_store_url):
        return tier
    client = MooncakeClient(cache.kv_store_url, cache.kv_store_segment_bytes,
                            local_host=cache.kv_store_local_host)
    name = cache.kv_store_model or model.rstrip("/").rsplit("/", 1)[-1]
    layout_hash = kv_layout_hash(kv_layout(name, kv_cache))
    store = StoreTier(kv_cache, client, layout_hash, cache.kv_store_queue_bytes)
    stack = TierStack(tier, store)
    weakref.finalize(stack, store.close)
    return stack
