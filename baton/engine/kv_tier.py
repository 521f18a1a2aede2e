"""The KV tier below one worker's pool: blocks the pool evicts are kept, a prefix hit there is
loaded back instead of recomputed.

    pool ──evict (BlockPool hook, before the block is reused)──▶ host ──LRU victim──▶ disk
      ▲                                                            │                   │
      └────────── load on a prefix hit (KVCacheManager) ───────────┴───────────────────┘

- Identity: the chained block hash, with the block's tokens checked on every hit.
- Host tier is exclusive: a hit moves the block up (its slot is freed). Disk tier is
  inclusive: a hit copies the block up and keeps the file, so when the block comes back
  down it is only touched, not rewritten.
- Loads are two-phase (`claim`, then `finish` into a pool block) so the pool allocation in
  between, which may itself evict a block into this tier, cannot push out the block being
  loaded: a claimed host slot is out of the LRU, a claimed disk block is already read and
  verified in a staging buffer.
- A disk file that is missing, short or fails its CRC is dropped and counted; the caller
  recomputes the block (and the rest of the prompt). Bytes are never decoded from it.
- Moves on CPU: one memcpy per block (host; `copy_block`), plain file I/O (disk; why not
  NIXL here: benchmarks/kv_tier_bandwidth.py), on the engine thread; with a host tier in
  front, disk writes run on a writer thread (tier_writer.py):
  a spilled block keeps its host slot until its file is written (a hit meanwhile reads the
  slot); LRU blocks spill a little ahead of need (`spill_ahead` slots), so a save rarely
  waits for the disk (without a host tier, disk writes are synchronous).
"""
from __future__ import annotations

import functools
import logging
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from baton.config import CacheConfig
from baton.engine.block_pool import Block
from baton.engine.tier_store import DiskTier, HostTier, as_bytes, copy_block, write_block_file
from baton.engine.tier_writer import FileWriter

log = logging.getLogger(__name__)


@dataclass
class TierTotals:
    """Cumulative per-tier counts (engine thread writes; any thread may read one field).

    hits / misses: block lookups past the pool's hits that found / did not find the block
    in this tier. saved_* / loaded_*: blocks moved into / out of this tier, their bytes and
    the seconds spent. dropped_blocks: blocks this tier lost to a failed write or a corrupt,
    truncated or missing file (each recomputed when next needed). unavailable: the KV
    store tier's calls answered "down" (kv_store.py; 0 for host and disk); reconnects: its
    new connections to a master that came back or restarted.
    """

    hits: int = 0
    misses: int = 0
    saved_blocks: int = 0
    saved_bytes: int = 0
    save_seconds: float = 0.0
    loaded_blocks: int = 0
    loaded_bytes: int = 0
    load_seconds: float = 0.0
    dropped_blocks: int = 0
    unavailable: int = 0  # the KV store's calls not made or failed while it was down
    reconnects: int = 0  # the KV store's connection epochs after the first (store_client.py)


class TierCounts(NamedTuple):
    """One tier's size (blocks, bytes used, budget in bytes) and its `TierTotals`."""

    tier: str  # "host" | "disk"
    blocks: int
    bytes: int
    capacity_bytes: int
    totals: TierTotals


class _Claim(NamedTuple):
    tier: str  # "host": `slot` of the host store; "disk": the load staging buffer
    slot: int
    started: float


def tier_for(kv_cache: torch.Tensor, cache: CacheConfig) -> KVTier | None:
    """The KV tier a CacheConfig asks for under `kv_cache`, or None (tiers off)."""
    return KVTier(kv_cache, cache.kv_host_tier_bytes, cache.kv_disk_tier_dir,
                  cache.kv_disk_tier_bytes) if cache.kv_tier_enabled else None


class KVTier:
    """Host and/or disk tier for the blocks of `kv_cache`
    [num_blocks, num_layers, 2, block_size, kv_heads, head_size].

    host_bytes: host tier budget (slots = host_bytes // bytes per block; 0 = no host tier).
    disk_dir / disk_bytes: disk tier root and budget (None / 0 = no disk tier).
    Raises ValueError when neither tier would hold a single block.
    """

    def __init__(self, kv_cache: torch.Tensor, host_bytes: int = 0, disk_dir: str | None = None,
                 disk_bytes: int = 0) -> None:
        self.kv_cache = kv_cache
        shape, dtype = kv_cache.shape[1:], kv_cache.dtype
        self.block_bytes = kv_cache[0].numel() * kv_cache.element_size()
        slots = host_bytes // self.block_bytes
        self.host = HostTier(slots, shape, dtype, pin=kv_cache.is_cuda) if slots else None
        self.disk, self._writer = None, None
        if disk_dir and disk_bytes:
            if self.host is not None:  # writes can run behind: the bytes wait in host slots
                self._writer = FileWriter()
                weakref.finalize(self, self._writer.close)
            self.disk = DiskTier(disk_dir, disk_bytes, self.block_bytes,
                                 self._writer.unlink if self._writer is not None else None)
        self._writing: dict[int, int] = {}  # hash → host slot of its latest queued write
        self._pending_slots = 0
        self.spill_ahead = min(64, slots // 8) if self._writer is not None else 0
        if self.host is None and self.disk is None:
            raise ValueError(f"KV tier budgets hold no {self.block_bytes}-byte block")
        if self.disk is not None and self.disk.file_bytes(kv_cache.shape[3]) > disk_bytes:
            raise ValueError(f"disk tier budget {disk_bytes} B holds no block file")
        self._load_buf = torch.empty(shape, dtype=dtype)  # disk → (verified) → pool
        self._save_buf = torch.empty(shape, dtype=dtype)  # pool → disk when no host tier
        self.host_totals, self.disk_totals = TierTotals(), TierTotals()
        self.recomputed_blocks = 0

    # ---- down: the pool's eviction hook ------------------------------------------------
    def offload(self, blocks: Sequence[Block]) -> None:
        """BlockPool's eviction hook: keep the KV of `blocks` (cached, about to be reused)."""
        for b in blocks:
            assert b.block_hash is not None
            if self.host is not None:
                self._save_host(b.block_hash, b.token_ids, b.block_id)
            else:
                copy_block(self._save_buf, self.kv_cache[b.block_id])
                self._save_disk(b.block_hash, b.token_ids, self._save_buf)

    def publish(self, blocks: Sequence[Block]) -> None:
        """A request ended (kv_cache.free): nothing to do here (the KV store's hook)."""

    def _save_host(self, block_hash: int, tokens: tuple[int, ...], block_id: int) -> None:
        host, t = self.host, self.host_totals
        if block_hash in host:  # the pool recomputed a block the tier still had
            host.touch(block_hash)
            return
        self._reap()
        while not host.free_slots:
            if not self._make_room():  # every slot is claimed by a load
                copy_block(self._save_buf, self.kv_cache[block_id])
                self._save_disk(block_hash, tokens, self._save_buf)
                return
        start = time.perf_counter()
        copy_block(host.store[host.put(block_hash, tokens)], self.kv_cache[block_id])
        t.saved_blocks += 1
        t.saved_bytes += self.block_bytes
        t.save_seconds += time.perf_counter() - start
        while host.index and len(host.free_slots) + self._pending_slots < self.spill_ahead:
            self._spill_host_lru()

    def _make_room(self) -> bool:
        """One step toward a free host slot: wait for a queued write, else spill the LRU
        block. False when neither can free one."""
        if self._pending_slots:
            self._reap(wait=True)
        elif self.host.index:
            self._spill_host_lru()
        else:
            return False
        return True

    def _spill_host_lru(self) -> None:
        """Move the host LRU block (there is one) to disk, or drop it without a disk tier.
        With the writer its slot is freed when the write is reaped (`_reap`)."""
        block_hash, slot, tokens = self.host.lru()
        self.host.take(block_hash)
        disk = self.disk
        if self._writer is None or block_hash in disk:
            self._save_disk(block_hash, tokens, self.host.store[slot])
            self.host.free_slot(slot)
            return
        disk.evict_for(len(tokens))
        disk.add(block_hash, tokens)
        self._writing[block_hash] = slot
        self._pending_slots += 1
        job = functools.partial(_timed_write, disk.path(block_hash), block_hash, tokens,
                                as_bytes(self.host.store[slot]))
        self._writer.submit(job, (block_hash, slot))

    def _reap(self, wait: bool = False) -> None:
        """Take finished background writes: free their slots, count them, drop failures."""
        if self._writer is None:
            return
        t = self.disk_totals
        for done in self._writer.reap(wait):
            if done.tag is None:
                continue  # an unlink
            block_hash, slot = done.tag
            self.host.free_slot(slot)
            self._pending_slots -= 1
            if self._writing.get(block_hash) == slot:
                del self._writing[block_hash]
                if done.error is not None and block_hash in self.disk:
                    log.error("writing KV block %016x to the disk tier failed: %s",
                              block_hash, done.error)
                    self.disk.drop(block_hash)
                    t.dropped_blocks += 1
            if done.error is None:
                t.saved_blocks += 1
                t.saved_bytes += done.result[0]
                t.save_seconds += done.result[1]

    def flush(self) -> None:
        """Wait for every queued disk job (tests, shutdown)."""
        while self._writer is not None and self._writer.pending:
            self._reap(wait=True)

    def _save_disk(self, block_hash: int, tokens: tuple[int, ...], src: torch.Tensor) -> None:
        disk, t = self.disk, self.disk_totals
        if disk is None:
            return
        if block_hash in disk:  # inclusive tier: the file is still good
            disk.touch(block_hash)
            return
        start = time.perf_counter()
        self.flush()  # a queued unlink of this same path must not follow this write
        disk.evict_for(len(tokens))
        try:
            n = disk.write(block_hash, tokens, as_bytes(src))
        except OSError:
            log.exception("writing KV block %016x to the disk tier failed", block_hash)
            t.dropped_blocks += 1
            return
        t.saved_blocks += 1
        t.saved_bytes += n
        t.save_seconds += time.perf_counter() - start

    # ---- up: a prefix hit below the pool -------------------------------------------------
    def claim(self, block_hash: int, tokens: Sequence[int]) -> _Claim | None:
        """Find the block in host, then disk; None on a miss or a bad disk file. A claim
        must be ended by `finish` (KVCacheManager allocates the pool block in between)."""
        start = time.perf_counter()
        if self.host is not None:
            if self.host.find(block_hash, tokens):
                self.host_totals.hits += 1
                return _Claim("host", self.host.take(block_hash), start)
            self.host_totals.misses += 1
        disk = self.disk
        if disk is None:
            return None
        if not disk.find(block_hash, tokens):
            self.disk_totals.misses += 1
            return None
        slot = self._writing.get(block_hash)
        if slot is not None:  # still being written: its bytes are in the host slot
            copy_block(self._load_buf, self.host.store[slot])
        elif not disk.read_into(block_hash, tokens, as_bytes(self._load_buf)):
            log.warning("KV block %016x: disk tier file corrupt or truncated; dropped, "
                        "recomputing", block_hash)
            disk.drop(block_hash)
            self.disk_totals.dropped_blocks += 1
            self.recomputed_blocks += 1
            return None
        self.disk_totals.hits += 1
        disk.touch(block_hash)
        return _Claim("disk", -1, start)

    def finish(self, claim: _Claim, block_id: int) -> None:
        """Copy the claimed block into pool block `block_id` (and free its host slot)."""
        if claim.tier == "host":
            copy_block(self.kv_cache[block_id], self.host.store[claim.slot])
            self.host.free_slot(claim.slot)
            t = self.host_totals
        else:
            copy_block(self.kv_cache[block_id], self._load_buf)
            t = self.disk_totals
        t.loaded_blocks += 1
        t.loaded_bytes += self.block_bytes
        t.load_seconds += time.perf_counter() - claim.started

    def contains(self, block_hash: int) -> bool:
        """Hash membership in either tier (no token check; for queue-order estimates)."""
        return (self.host is not None and block_hash in self.host) or \
            (self.disk is not None and block_hash in self.disk)

    # ---- what metrics read ---------------------------------------------------------------
    def counts(self) -> tuple[TierCounts, ...]:
        """Sizes and totals of each configured tier (single reads: any thread)."""
        out = []
        if self.host is not None:
            h = self.host
            n = len(h.index)
            out.append(TierCounts("host", n, n * self.block_bytes,
                                  h.num_slots * self.block_bytes, self.host_totals))
        if self.disk is not None:
            d = self.disk
            out.append(TierCounts("disk", len(d.index), d.used_bytes, d.capacity_bytes,
                                  self.disk_totals))
        return tuple(out)


def _timed_write(path: str, block_hash: int, tokens: Sequence[int],
                 payload) -> tuple[int, float]:
    """write_block_file on the writer thread: (bytes written, seconds)."""
    start = time.perf_counter()
    n = write_block_file(path, block_hash, tokens, payload)
    return n, time.perf_counter() - start
