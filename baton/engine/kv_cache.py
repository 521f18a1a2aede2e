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
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from baton.block_hash import BlockHashFn, hash_block, hash_block_tokens


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
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be ≥ 1, got {num_blocks}")
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
        out = []
        for _ in range(n):
            block_id, _ = self.free_queue.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
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


@dataclass
class _RequestBlocks:
    blocks: list[Block] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0  # leading blocks already registered in the prefix cache


class KVCacheManager:
    """Assigns pool blocks to requests; the one place block ownership changes.

    Raises KeyError for an unknown request id where one is required.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        hash_fn: BlockHashFn = hash_block,
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_fn = hash_fn
        self.pool = BlockPool(num_blocks)
        self.requests: dict[str, _RequestBlocks] = {}

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

    def get_computed_blocks(
        self, request_id: str, token_ids: Sequence[int]
    ) -> tuple[list[Block], int]:
        """Longest cached prefix of a request that holds no blocks yet.

        Returns (blocks, num_computed_tokens). At least one token is always left to compute
        (its logits are needed), so a full hit stops one block short when the prompt is
        block-aligned. Takes no references: pass the blocks to `allocate_slots`.
        """
        if not self.enable_prefix_caching:
            return [], 0
        hashes = self._hashes(request_id, token_ids)
        max_blocks = (len(token_ids) - 1) // self.block_size
        hits: list[Block] = []
        bs = self.block_size
        for i, block_hash in enumerate(hashes[:max_blocks]):
            block = self.pool.lookup(block_hash, token_ids[i * bs:(i + 1) * bs])
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * bs

    def estimate_hit_blocks(self, request_id: str, token_ids: Sequence[int], hint: int) -> int:
        """Leading full blocks of a waiting request whose hashes are cached: an estimate for
        ordering the queue, updated from a previous answer `hint` in O(blocks changed).

        Steps back from `hint` while the last counted block left the cache, then forward
        while the next one is in it; hash membership only (no token check, no Block list:
        `get_computed_blocks` stays the exact answer at admission). Exact when evictions eat
        a chain from its tail, as `free` releases it; misses a hole punched mid-prefix.
        """
        if not self.enable_prefix_caching:
            return 0
        hashes, cached = self._hashes(request_id, token_ids), self.pool.cached
        max_blocks = (len(token_ids) - 1) // self.block_size  # as get_computed_blocks
        n = min(hint, max_blocks)
        while n > 0 and hashes[n - 1] not in cached:
            n -= 1
        while n < max_blocks and hashes[n] in cached:
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
        hashes = self._hashes(request_id, token_ids[:num_full * self.block_size])
        bs = self.block_size
        for i in range(entry.num_cached_blocks, num_full):
            self.pool.cache(entry.blocks[i], hashes[i], token_ids[i * bs:(i + 1) * bs])
        entry.num_cached_blocks = num_full

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

    def free(self, request_id: str) -> None:
        """Release every block of the request (last block first, so it is evicted first)."""
        entry = self.requests.pop(request_id, None)
        if entry is None:
            return
        self.pool.release(list(reversed(entry.blocks)))
