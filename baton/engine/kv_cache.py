"""Paged KV-cache bookkeeping: a block pool with ref counts, an LRU free queue and a prefix cache.

The KV tensor itself lives in the ModelRunner; this module only decides which block ids each
request uses. Layout of one request (block_size = 4)::

    token index :  0  1  2  3 | 4  5  6  7 | 8  9 10 11 | 12 13
    block_table :     [ 7 ]   |   [ 2 ]    |   [ 9 ]    | [ 4 ]  ← last block partly filled
    slot(t)     =  block_table[t // block_size] * block_size + t % block_size
    block hash  :     h0      |  h1=H(h0,…)| h2=H(h1,…) |  —     ← full blocks only

A full block, once its KV is computed, is registered in the prefix cache under its chained
hash. When a request finishes its blocks are released (`ref_cnt` 0) but keep their hash: they
sit in the free queue in LRU order and are evicted (hash dropped) only when a new allocation
pops them. A later request whose leading block hashes *and tokens* match takes them back
(`ref_cnt` += 1) instead of recomputing. Design after nano-vllm's BlockManager and vLLM v1's
KVCacheManager.

With a `KVTier` (kv_tier.py) an evicted block's KV goes down to host memory / disk first, and
a lookup continues the hash chain there once the pool's hits end: each block found below is
loaded into a fresh pool block and registered, so admission sees it as an ordinary hit::

    hashes : h0   h1   h2   h3   h4
    pool   : hit  hit  miss                 ─▶ tier: h2 host, h3 disk, h4 miss
    result : [b7, b2, b5*, b1*]  (* loaded now: cached, free, taken by allocate_slots)

Session hints (baton/session_hints.py) order the free blocks by class: no session / ended
first, then sessions by deadline (free_lists.py); a request's tier-held prefix is prefetched
on arrival, a pinned session's demoted prefix restored when idle (kv_prefetch.py).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from baton.block_hash import BlockHashFn, hash_block, hash_block_tokens
from baton.engine.block_pool import Block, BlockPool
from baton.engine.kv_prefetch import SessionChains, load_from_tier, pool_hits
from baton.engine.kv_source import TIER_SOURCES, KVSource, Spans, spans_of
from baton.engine.kv_tier import KVTier
from baton.session_hints import SessionHint

__all__ = ["Block", "BlockPool", "KVCacheManager"]


@dataclass
class _RequestBlocks:
    blocks: list[Block] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0  # leading blocks already registered in the prefix cache
    token_ids: Sequence[int] = ()  # the request's token list (a reference; cache_blocks)
    cached_spans: Spans = ()  # where its prefix hits came from (kv_source.py), at allocation


class KVCacheManager:
    """Assigns pool blocks to requests; the one place block ownership changes.

    tier: where evicted blocks go and prefix hits continue (None: evicted KV is dropped).
    clock: monotonic seconds for session deadlines (tests inject one).
    Raises KeyError for an unknown request id where one is required.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        hash_fn: BlockHashFn = hash_block,
        tier: KVTier | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_fn = hash_fn
        self.tier = tier if enable_prefix_caching else None
        self.pool = BlockPool(num_blocks, self.tier.offload if self.tier is not None else None,
                              clock)
        self.requests: dict[str, _RequestBlocks] = {}
        self.hints: dict[str, SessionHint] = {}  # request id → its session (bind_session)
        self.prefetched_blocks = 0  # loaded ahead of admission (`prefetch`, restores)
        self.chains = SessionChains()  # pinned sessions' last prefixes (restore_sessions)

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.pool.blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by live requests, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def block_table(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.requests[request_id].blocks]

    def num_request_blocks(self, request_id: str) -> int:
        """Blocks the request's block table holds now (0 for an unknown request)."""
        entry = self.requests.get(request_id)
        return len(entry.blocks) if entry is not None else 0

    @property
    def num_cached_blocks(self) -> int:
        """Blocks in the prefix cache (used or free)."""
        return len(self.pool.cached)

    def cached_block_hashes(self) -> list[int]:
        """Hashes of every block in the prefix cache (used or free), for KV-aware routing."""
        return list(self.pool.cached)

    def cached_spans(self, request_id: str) -> Spans:
        """Where the prefix hits of the request's first allocation came from, in prompt
        order (kv_source.py); () for an unknown request or one without hits."""
        entry = self.requests.get(request_id)
        return entry.cached_spans if entry is not None else ()

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- lifecycle -----------------------------------------------------------------------
    def _hashes(self, request_id: str, token_ids: Sequence[int]) -> list[int]:
        entry = self.requests.setdefault(request_id, _RequestBlocks())
        if len(entry.hashes) < len(token_ids) // self.block_size:
            entry.hashes = hash_block_tokens(token_ids, self.block_size, entry.hashes,
                                             self.hash_fn)
        return entry.hashes

    def block_hashes(self, request_id: str, token_ids: Sequence[int]) -> list[int]:
        """Chained hashes of the request's full blocks of `token_ids` (memoized per request)."""
        return self._hashes(request_id, token_ids)

    def peek_cached_tokens(self, request_id: str, token_ids: Sequence[int]) -> int:
        """Tokens of the request's prefix the pool holds now (block aligned, at least one
        token left to compute), as `get_computed_blocks` would find them without a tier: no
        references taken, nothing loaded. For estimates of a waiting request's work."""
        if not self.enable_prefix_caching:
            return 0
        return len(self._pool_prefix(request_id, token_ids)[2]) * self.block_size

    def _pool_prefix(self, request_id: str, token_ids: Sequence[int]
                     ) -> tuple[list[int], int, list[Block]]:
        """(block hashes, most blocks a hit may cover: one token is always left to compute,
        the leading blocks the pool holds)."""
        hashes = self._hashes(request_id, token_ids)
        max_blocks = (len(token_ids) - 1) // self.block_size
        return hashes, max_blocks, pool_hits(self.pool, self.block_size, hashes[:max_blocks],
                                             token_ids)

    def get_computed_blocks(
        self, request_id: str, token_ids: Sequence[int], reserved_blocks: int = 0
    ) -> tuple[list[Block], int]:
        """Longest cached prefix of a request that holds no blocks yet.

        Returns (blocks, num_computed_tokens). At least one token is always left to compute
        (its logits are needed), so a full hit stops one block short when the prompt is
        block-aligned. Takes no references: pass the blocks to `allocate_slots`. Blocks the
        tier had are loaded into free pool blocks here (`kv_prefetch.load_from_tier`), but only when the
        whole prompt then fits beside `reserved_blocks` others need (the scheduler's
        `_fits_whole_prompt`, whose answer loading does not change): a prompt that must wait
        does not churn other cached blocks down and its own up, step after step.
        """
        if not self.enable_prefix_caching:
            return [], 0
        hashes, max_blocks, hits = self._pool_prefix(request_id, token_ids)
        if self.tier is not None and len(hits) < max_blocks and self.fits(
                len(token_ids), hits, reserved_blocks):
            hits += load_from_tier(self.pool, self.tier, self.block_size, hashes[:max_blocks],
                                   token_ids, hits, session=self.hints.get(request_id))
        return hits, len(hits) * self.block_size

    def prefetch(self, request_id: str, token_ids: Sequence[int]) -> int:
        """Bring the request's prefix blocks the tier holds into free class-(a) pool blocks
        now, ahead of its admission (kv_prefetch.py). Returns how many were loaded."""
        if self.tier is None:
            return 0
        hashes = self._hashes(request_id, token_ids)
        max_blocks = (len(token_ids) - 1) // self.block_size
        hits = pool_hits(self.pool, self.block_size, hashes[:max_blocks], token_ids)
        if len(hits) == max_blocks:
            return 0
        loaded = load_from_tier(self.pool, self.tier, self.block_size, hashes[:max_blocks],
                                token_ids, hits, session=self.hints.get(request_id),
                                prefetch=True)
        self.prefetched_blocks += len(loaded)
        return len(loaded)

    # ---- sessions (session_hints.py; eviction order: free_lists.py) ------------------------
    def bind_session(self, request_id: str, hint: SessionHint | None) -> None:
        """A request of session `hint` arrived: refresh (or reopen) the session's deadline;
        its blocks are released into the session's free list until its final `free`."""
        if hint is None:
            return
        self.hints[request_id] = hint
        self.pool.free.set_deadline(hint.session_id, hint.ttl_s, reopen=True)

    def end_session(self, session_id: str) -> int:
        """End a session (DELETE /v1/sessions/{id} or a last turn): its free blocks become
        the first to evict; blocks its live requests hold follow when they finish. Returns
        the free blocks moved."""
        self.chains.forget(session_id)
        return self.pool.end_session(session_id)

    def restore_sessions(self) -> int:
        """Bring back from the tier the last turn's prefix of pinned sessions that lost
        blocks to eviction, into free class-(a) blocks (call when idle). Returns blocks."""
        if self.tier is None or not self.pool.free.demoted:
            return 0
        n = self.chains.restore(self.pool, self.tier, self.block_size)
        self.prefetched_blocks += n
        return n

    def fits(self, num_tokens: int, hits: Sequence[Block], reserved_blocks: int) -> bool:
        """True when `num_tokens` tokens fit with `hits` taken, beside `reserved_blocks` other
        requests still need: free blocks (evictable cached included) minus the hits that are
        free (taking them removes them from the free queue)."""
        free_hits = sum(1 for b in hits if b.ref_cnt == 0)
        need = self.blocks_needed(num_tokens) - len(hits)
        return need + reserved_blocks <= self.num_free_blocks - free_hits

    def estimate_hit_blocks(self, request_id: str, token_ids: Sequence[int], hint: int) -> int:
        """Leading full blocks of a waiting request whose hashes are cached: an estimate for
        ordering the queue, updated from a previous answer `hint` in O(blocks changed).

        Steps back from `hint` while the last counted block left the cache, then forward
        while the next one is in it (or in the tier); hash membership only (no token check,
        no Block list: `get_computed_blocks` stays the exact answer at admission). Exact when
        evictions eat a chain from its tail, as `free` releases it; misses a hole punched
        mid-prefix.
        """
        if not self.enable_prefix_caching:
            return 0
        hashes, cached = self._hashes(request_id, token_ids), self.pool.cached
        tier = self.tier

        def known(h: int) -> bool:  # in the pool, or below it (loaded at admission)
            return h in cached or (tier is not None and tier.contains(h))

        max_blocks = (len(token_ids) - 1) // self.block_size  # as get_computed_blocks
        n = min(hint, max_blocks)
        while n > 0 and not known(hashes[n - 1]):
            n -= 1
        while n < max_blocks and known(hashes[n]):
            n += 1
        return n

    def allocate_slots(
        self,
        request_id: str,
        num_total_tokens: int,
        new_computed_blocks: Sequence[Block] = (),
    ) -> list[Block] | None:
        """Make the request's block table cover `num_total_tokens` tokens.

        `new_computed_blocks` are prefix-cache hits from `get_computed_blocks` (first call
        only); they are referenced and placed first. Returns the newly allocated blocks, or
        None (and changes nothing) when the pool cannot supply them.
        """
        entry = self.requests.setdefault(request_id, _RequestBlocks())
        have = len(entry.blocks) + len(new_computed_blocks)
        need = max(0, self.blocks_needed(num_total_tokens) - have)
        reclaimed = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if need + reclaimed > self.num_free_blocks:
            if not entry.blocks:
                del self.requests[request_id]
            return None
        if new_computed_blocks:
            assert not entry.blocks, "prefix hits are only taken by a request's first allocation"
            self.pool.touch(new_computed_blocks)
            entry.blocks.extend(new_computed_blocks)
            entry.num_cached_blocks = len(entry.blocks)
            entry.cached_spans = spans_of(
                (TIER_SOURCES.get(b.loaded_from, KVSource.POOL) for b in new_computed_blocks),
                self.block_size)
            for b in new_computed_blocks:  # taken: a later hit on it is this pool's
                b.loaded_from = None
        new = self.pool.allocate(need)
        entry.blocks.extend(new)
        return new

    def cache_blocks(self, request_id: str, token_ids: Sequence[int], num_computed: int) -> None:
        """Register the request's full blocks whose KV is computed (tokens < num_computed)."""
        if not self.enable_prefix_caching:
            return
        entry = self.requests[request_id]
        num_full = min(num_computed // self.block_size, len(entry.blocks))
        if num_full <= entry.num_cached_blocks:
            return
        entry.token_ids = token_ids
        hashes = self._hashes(request_id, token_ids[:num_full * self.block_size])
        bs = self.block_size
        for i in range(entry.num_cached_blocks, num_full):
            self.pool.cache(entry.blocks[i], hashes[i], token_ids[i * bs:(i + 1) * bs])
        entry.num_cached_blocks = num_full

    def trim(self, request_id: str, num_tokens: int) -> int:
        """Release the request's blocks past the first `blocks_needed(num_tokens)`: they held
        only slots of drafted tokens the verify step rejected (speculative decoding), never
        hashed (a block is cached only once its tokens are accepted and computed), so the
        prefix cache and the KV tiers never see them. Returns how many were released."""
        entry = self.requests[request_id]
        keep = self.blocks_needed(num_tokens)
        extra = entry.blocks[keep:]
        if extra:
            assert entry.num_cached_blocks <= keep, "a trimmed block was cached"
            entry.blocks = entry.blocks[:keep]
            self.pool.release(list(reversed(extra)))
        return len(extra)

    def detach(self, request_id: str, from_block: int) -> list[Block]:
        """Take the request's blocks from index `from_block` on out of its block table, still
        referenced: no one else gets them until `release_detached`. The request keeps the
        blocks before `from_block` (and may grow again). For blocks a transfer may still be
        writing into (decode side of a failed remote prefill). KeyError: unknown request."""
        entry = self.requests[request_id]
        detached, entry.blocks = entry.blocks[from_block:], entry.blocks[:from_block]
        entry.num_cached_blocks = min(entry.num_cached_blocks, from_block)
        return detached

    def release_detached(self, blocks: Sequence[Block]) -> None:
        """Release blocks taken by `detach` (last first, so it is evicted first)."""
        self.pool.release(list(reversed(blocks)))

    def free(self, request_id: str, final: bool = True) -> None:
        """Release every block of the request (last block first, so it is evicted first),
        into its session's free list if it has one. `final` (not a preemption): forget its
        session binding, and end the session if this was its last turn."""
        entry = self.requests.pop(request_id, None)
        hint = self.hints.pop(request_id, None) if final else self.hints.get(request_id)
        if entry is not None:
            if self.tier is not None:
                self.tier.publish(entry.blocks)  # to the KV store, if any (kv_store.py)
            self.pool.release(list(reversed(entry.blocks)), hint)
        if final and hint is not None:
            if hint.end:
                self.end_session(hint.session_id)
            elif entry is not None and self.tier is not None:
                self.chains.remember(hint, entry.hashes[:entry.num_cached_blocks],
                                     entry.token_ids)
