"""Bringing blocks up from the KV tier into the pool: at admission (a prefix hit continued
below the pool) and ahead of it (prefetch, when a request arrives at the worker).

    arrival ──prefetch──▶ tier blocks of its prefix loaded into free class-(a) pool blocks,
                          cached, left free in the session's list (`prefetched` set)
    admission ──get_computed_blocks──▶ ordinary pool hits: nothing left to load; each
                          prefetched block taken counts in BlockPool.prefetch_hits
    idle engine ──SessionChains.restore──▶ a pinned session whose blocks were evicted
                          (nothing else was free) gets its last turn's prefix back, so its
                          next turn (after a tool call) finds it in the pool

Prefetch takes only class-(a) free blocks (no session, ended sessions, uncached: free_lists.py),
so it never evicts another session's blocks to make room for this one's; it stops at the first
tier miss, like the admission-time load. On the engine thread (one memcpy or file read per
block, as kv_tier.py's loads), while the request waits in the queue.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from baton.engine.block_pool import Block, BlockPool
from baton.session_hints import SessionHint

if TYPE_CHECKING:
    from baton.engine.kv_tier import KVTier


def load_from_tier(pool: BlockPool, tier: KVTier, block_size: int, hashes: Sequence[int],
                   token_ids: Sequence[int], hits: list[Block], *,
                   session: SessionHint | None = None, prefetch: bool = False,
                   refresh: bool = True) -> list[Block]:
    """Continue the chain after `hits` in the tier: load each next block found there into
    a free pool block and cache it. Returns the loaded blocks, left free (ref_cnt 0; in
    `session`'s free list when given).

    The pool's hits (and each loaded block) are referenced meanwhile, so allocating for
    the next load cannot evict the prefix it extends. Stops at the first miss, a bad
    file, or when no free pool block is left (`prefetch`: no free class-(a) block; loaded
    blocks are marked `prefetched`). `refresh`: the release moves `session`'s deadline (a
    request of it is here), else the blocks join its list as it stands (a restore).
    """
    bs, loaded = block_size, []
    pool.touch(hits, count_prefetch=False)
    try:
        for i in range(len(hits), len(hashes)):
            tokens = token_ids[i * bs:(i + 1) * bs]
            room = len(pool.free_queue) if prefetch else pool.num_free_blocks
            if not room or pool.cached.get(hashes[i]) is not None:
                break  # no room, or a same-hash block with other tokens owns the hash
            claim = tier.claim(hashes[i], tokens)
            if claim is None:
                break
            (block,) = pool.allocate(1)
            tier.finish(claim, block.block_id)
            pool.cache(block, hashes[i], tokens)
            block.prefetched = prefetch
            block.loaded_from = claim.tier
            loaded.append(block)
    finally:
        pool.release(list(reversed(hits + loaded)), session, refresh)
    return loaded


def pool_hits(pool: BlockPool, block_size: int, hashes: Sequence[int],
              token_ids: Sequence[int]) -> list[Block]:
    """The leading blocks of `hashes` cached in the pool (tokens checked)."""
    hits: list[Block] = []
    bs = block_size
    for i, block_hash in enumerate(hashes):
        block = pool.lookup(block_hash, token_ids[i * bs:(i + 1) * bs])
        if block is None:
            break
        hits.append(block)
    return hits


class SessionChains:
    """The last finished turn's cached prefix of each session inside its TTL (hashes and a
    reference to its token list), to bring back from the tier what eviction demoted while
    the session was pinned (FreeLists.demoted) once the engine is idle (`restore`).

    Bounded: the `max_sessions` most recent chains are kept.
    """

    def __init__(self, max_sessions: int = 1024) -> None:
        self.chains: OrderedDict[str, tuple[SessionHint, list[int], Sequence[int]]] = \
            OrderedDict()
        self.max_sessions = max_sessions

    def remember(self, hint: SessionHint, hashes: list[int], token_ids: Sequence[int]) -> None:
        """After a session's turn: its `hashes` (full cached blocks) of `token_ids`."""
        if hint.end or hint.ttl_s <= 0 or not hashes:
            self.chains.pop(hint.session_id, None)
            return
        self.chains[hint.session_id] = (hint, hashes, token_ids)
        self.chains.move_to_end(hint.session_id)
        while len(self.chains) > self.max_sessions:
            self.chains.popitem(last=False)

    def forget(self, session_id: str) -> None:
        self.chains.pop(session_id, None)

    def restore(self, pool: BlockPool, tier: KVTier, block_size: int) -> int:
        """Reload demoted prefixes of pinned sessions into free class-(a) blocks, sessions in
        the order they were demoted; their deadlines are not moved. Returns blocks loaded."""
        demoted, loaded = pool.free.demoted, 0
        while demoted and pool.free_queue:
            sid, _ = demoted.popitem(last=False)
            chain = self.chains.get(sid)
            if chain is None or not pool.free.is_pinned(sid):
                continue
            hint, hashes, token_ids = chain
            hits = pool_hits(pool, block_size, hashes, token_ids)
            if len(hits) < len(hashes):
                loaded += len(load_from_tier(pool, tier, block_size, hashes, token_ids, hits,
                                             session=hint, prefetch=True, refresh=False))
        return loaded
