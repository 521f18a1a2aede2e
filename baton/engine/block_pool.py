"""The fixed set of KV blocks: ref counts, the LRU free queue and the hash → block map of the
prefix cache (the picture of a request's blocks is in kv_cache.py)."""
from __future__ import annotations

import itertools
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(eq=False)
class Block:
    """One KV block: `ref_cnt` live users; `block_hash`/`token_ids` set once it is cached."""

    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] = ()


class BlockPool:
    """Fixed set of `num_blocks` blocks, a free queue in LRU order and a hash → block map.

    Free queue order: the head is evicted first. Released blocks without a hash go to the head
    (nothing to keep); released cached blocks go to the tail (most recently used).

    evict_hook(blocks): called by `allocate` with the cached blocks it is about to reuse, hash
    and tokens still set and their KV still intact (the KV tier copies it down: kv_tier.py).
    """

    def __init__(self, num_blocks: int,
                 evict_hook: Callable[[list[Block]], None] | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be ≥ 1, got {num_blocks}")
        self.evict_hook = evict_hook
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash → block id

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def lookup(self, block_hash: int, token_ids: Sequence[int]) -> Block | None:
        """The cached block for `block_hash` if its tokens equal `token_ids` (collision-safe)."""
        block_id = self.cached.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        return block if block.token_ids == tuple(token_ids) else None

    def touch(self, blocks: Sequence[Block]) -> None:
        """Take a reference on cache-hit blocks (removing free ones from the free queue)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def allocate(self, n: int) -> list[Block]:
        """Pop `n` blocks from the free-queue head, evicting their cached hashes.

        Raises RuntimeError if fewer than `n` are free (callers check `num_free_blocks`).
        """
        if n > len(self.free_queue):
            raise RuntimeError(f"asked for {n} blocks, {len(self.free_queue)} free")
        out = [self.blocks[i] for i in itertools.islice(self.free_queue, n)]
        evicted = [b for b in out if b.block_hash is not None]
        if evicted and self.evict_hook is not None:
            self.evict_hook(evicted)  # before any change: if it raises, the pool is as it was
        for block in out:
            del self.free_queue[block.block_id]
            self._evict(block)
            block.ref_cnt = 1
        return out

    def release(self, blocks: Sequence[Block]) -> None:
        """Drop one reference per listing of each block; blocks reaching 0 join the free queue.

        A block listed k times must hold at least k references. A release that would take a
        block below zero (a free block, or one listed twice with one reference) raises
        AssertionError before changing anything: no block is ever queued twice.
        """
        listed = Counter(block.block_id for block in blocks)
        over = sorted(i for i, k in listed.items() if self.blocks[i].ref_cnt < k)
        if over:  # checked explicitly: `python -O` must not turn this into a corrupt queue
            raise AssertionError(f"blocks {over} released more often than referenced")
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = None
                if block.block_hash is None:
                    self.free_queue.move_to_end(block.block_id, last=False)

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
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) == block.block_id:
                del self.cached[block.block_hash]
            block.block_hash = None
            block.token_ids = ()

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash of free blocks (used blocks keep theirs)."""
        for block_id in list(self.free_queue):
            self._evict(self.blocks[block_id])
