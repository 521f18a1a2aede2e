"""The fixed set of KV blocks: ref counts, the free lists in eviction order (by session class:
free_lists.py) and the hash → block map of the prefix cache (the picture of a request's
blocks is in kv_cache.py)."""
from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from baton.engine.free_lists import FreeLists
from baton.session_hints import SessionHint


@dataclass(eq=False)
class Block:
    """One KV block: `ref_cnt` live users; `block_hash`/`token_ids` set once it is cached.
    While free, `owner` names the session list it sits in (None: class (a)); `prefetched`:
    loaded from a lower tier ahead of the request that will take it (counted when taken);
    `loaded_from`: the tier ("host", "disk") a block was loaded from, until a request takes
    it as a hit (its tokens then count as that tier's: kv_source.py) or it is reused."""

    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] = ()
    owner: str | None = None
    prefetched: bool = False
    loaded_from: str | None = None


class BlockPool:
    """Fixed set of `num_blocks` blocks, free lists in eviction order and a hash → block map.

    Free order (`FreeLists`): class (a) (no session, ended sessions) first, then sessions by
    deadline (past their TTL, then inside it), LRU inside each. Released blocks without a
    hash go to the head (nothing to keep); released cached blocks go to the tail of their
    class (most recently used). `free_queue` is class (a) (an OrderedDict, head first).

    evict_hook(blocks): called by `allocate` with the cached blocks it is about to reuse, hash
    and tokens still set and their KV still intact (the KV tier copies it down: kv_tier.py).
    """

    def __init__(self, num_blocks: int,
                 evict_hook: Callable[[list[Block]], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be ≥ 1, got {num_blocks}")
        self.evict_hook = evict_hook
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free = FreeLists(num_blocks, clock)
        self.cached: dict[int, int] = {}  # block hash → block id
        self.prefetch_hits = 0  # prefetched blocks later taken by a request (`touch`)
        self.prefetch_wasted = 0  # prefetched blocks evicted before any request took them

    @property
    def free_queue(self) -> OrderedDict[int, None]:
        """Class (a) of the free blocks, eviction order (head first)."""
        return self.free.anon

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def lookup(self, block_hash: int, token_ids: Sequence[int]) -> Block | None:
        """The cached block for `block_hash` if its tokens equal `token_ids` (collision-safe)."""
        block_id = self.cached.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        return block if block.token_ids == tuple(token_ids) else None

    def touch(self, blocks: Sequence[Block], count_prefetch: bool = True) -> None:
        """Take a reference on cache-hit blocks (removing free ones from the free lists);
        a prefetched block taken counts in `prefetch_hits` (unless not `count_prefetch`:
        a reference held only while loading beside it)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free.remove(block.block_id, block.owner)
                block.owner = None
                if block.prefetched and count_prefetch:
                    self.prefetch_hits += 1
                    block.prefetched = False
            block.ref_cnt += 1

    def allocate(self, n: int) -> list[Block]:
        """Take the first `n` free blocks in eviction order, evicting their cached hashes.

        Raises RuntimeError if fewer than `n` are free (callers check `num_free_blocks`).
        """
        if n > len(self.free):
            raise RuntimeError(f"asked for {n} blocks, {len(self.free)} free")
        if n == 0:
            return []
        out = [self.blocks[i] for i, _ in self.free.peek(n)]
        evicted = [b for b in out if b.block_hash is not None]
        if evicted and self.evict_hook is not None:
            self.evict_hook(evicted)  # before any change: if it raises, the pool is as it was
        free, anon = self.free, self.free.anon
        for block in out:
            if block.owner is None:
                del anon[block.block_id]  # the common case, inline
            else:
                free.remove(block.block_id, block.owner, evicting=True)
                block.owner = None
            self._evict(block)
            block.ref_cnt = 1
        return out

    def release(self, blocks: Sequence[Block], session: SessionHint | None = None,
                refresh: bool = True) -> None:
        """Drop one reference per listing of each block; blocks reaching 0 join the free lists:
        `session`'s (its deadline moved to now + its TTL if `refresh`) unless it is None,
        ended, or (not `refresh`) unknown.

        A block listed k times must hold at least k references. A release that would take a
        block below zero (a free block, or one listed twice with one reference) raises
        AssertionError before changing anything: no block is ever queued twice.
        """
        listed = Counter(block.block_id for block in blocks)
        over = sorted(i for i, k in listed.items() if self.blocks[i].ref_cnt < k)
        if over:  # checked explicitly: `python -O` must not turn this into a corrupt queue
            raise AssertionError(f"blocks {over} released more often than referenced")
        sid = None
        if session is not None and session.session_id:
            sid = session.session_id
            if refresh:
                self.free.set_deadline(sid, session.ttl_s)
        free, anon = self.free, self.free.anon
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if sid is None and block.block_hash is not None:
                    anon[block.block_id] = None  # the common case, inline (owner stays None)
                else:
                    block.owner = free.add(block.block_id, sid, block.block_hash is not None)

    def end_session(self, session_id: str) -> int:
        """End a session: its free blocks become the first to evict (class (a) head), and its
        requests' later releases land in (a) too. Returns how many free blocks moved."""
        moved = self.free.end(session_id)
        for block_id in moved:
            self.blocks[block_id].owner = None
        return len(moved)

    def cache(self, block: Block, block_hash: int, token_ids: Sequence[int]) -> None:
        """Register a full, computed block under `block_hash` (first writer wins)."""
        if block.block_hash is not None:
            return
        if block_hash in self.cached:
            return  # same content computed twice concurrently; keep the first copy
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self.cached[block_hash] = block.block_id

    def _evict(self, block: Block) -> None:
        block.loaded_from = None
        if block.prefetched:
            self.prefetch_wasted += 1
            block.prefetched = False
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) == block.block_id:
                del self.cached[block.block_hash]
            block.block_hash = None
            block.token_ids = ()

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash of free blocks (used blocks keep theirs); every free
        block returns to class (a)."""
        self.free.drop_sessions()
        for block_id in list(self.free.anon):
            self.blocks[block_id].owner = None
            self._evict(self.blocks[block_id])
