"""The KV store tier: full KV blocks in a cluster-wide Mooncake Store, so a worker's next
prefill loads the blocks another worker computed (a decode worker's previous turn, a prefill
worker's prompt) instead of recomputing them.

    request ends ─publish─▶ slot copy ─queue─▶ writer ─put─▶ Mooncake ◀─get─ admission on
    (decode or prefill;     (engine thread,    (thread, off        Store          any worker
     kv_cache.free)          a memcpy a block)  the step)                         (prefix walk
                                                                                   after pool,
                                                                                   host, disk)

- Key: "baton-kv/<layout hash>/<block hash>" (transfer/layout.py's hash of model name,
  dtype, block size, layers, KV heads, head size; block_hash.py's chained hash), so only
  workers that could exchange the block over a transport share it.
- Value: header (magic, block hash, token count, payload bytes, CRC32 of tokens + payload),
  the block's token ids (int32), then the block [num_layers, 2, block_size, kv_heads,
  head_size] as bytes. A load checks magic, hash, tokens and CRC; a bad value is removed
  from the store and counted (`dropped_blocks`), the block recomputed, never decoded from.
- Writes: `publish(blocks)` copies each cached block the store is not known to hold into a
  preallocated slot and queues it; with no slot free the block is not written (counted in
  `queue_full_drops` and `dropped_blocks`). The writer asks the store which keys it lacks
  (one batched call) and puts those: a finished request writes its full blocks the store
  lacks.
- Reads: `claim(hash, tokens)` gets, verifies and stages the value; `finish` copies it into
  the pool block (kv_cache.py's two-phase load, as kv_tier.py).
- A store that is down (store_client.py's breaker) makes reads misses and writes no-ops:
  requests are served as without the store; `unavailable` counts it. A new connection epoch
  (the master came back after an outage, or restarted and lost every object) empties the
  set of blocks known to be stored, so finished requests publish them again (`reconnects`
  counts the epochs after the first).
"""
from __future__ import annotations

import logging
import queue
import struct
import threading
import time
import weakref
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from baton.engine.block_pool import Block
from baton.engine.kv_tier import TierCounts, TierTotals
from baton.engine.store_client import MooncakeClient
from baton.engine.tier_store import as_bytes, copy_block

log = logging.getLogger(__name__)

_MAGIC = b"BKVS"
_HEADER = struct.Struct("<4sQIQI")  # magic, block hash, num tokens, payload bytes, crc32
_KNOWN_MAX = 1 << 16  # hashes remembered as in the store (skip re-publishing them)
_BATCH = 32  # blocks the writer checks and puts per round


class StoreClaim(NamedTuple):
    tier: str  # "store": the block sits verified in the tier's staging buffer
    slot: int
    started: float


def encode_header(block_hash: int, tokens: Sequence[int],
                  payload: np.ndarray) -> tuple[bytes, bytes]:
    """(header, token bytes) of a store value; the payload follows them."""
    tok = np.asarray(tokens, dtype=np.int32).tobytes()
    crc = zlib.crc32(payload, zlib.crc32(tok))
    return _HEADER.pack(_MAGIC, block_hash, len(tokens), payload.nbytes, crc), tok


def decode_into(value: bytes, block_hash: int, tokens: Sequence[int], out: np.ndarray) -> bool:
    """Check a store value against the expected block (hash, tokens, size, CRC) and copy its
    payload into `out` (uint8, block bytes). False, `out` untouched, when anything differs."""
    n = _HEADER.size
    if len(value) < n:
        return False
    magic, h, num, size, crc = _HEADER.unpack_from(value)
    tok = np.asarray(tokens, dtype=np.int32).tobytes()
    end = n + len(tok)
    if (magic != _MAGIC or h != block_hash or num != len(tokens) or size != out.nbytes
            or len(value) != end + size or value[n:end] != tok):
        return False
    payload = memoryview(value)[end:]
    if zlib.crc32(payload, zlib.crc32(tok)) != crc:
        return False
    np.copyto(out, np.frombuffer(payload, dtype=np.uint8))
    return True


class StoreTier:
    """The store tier of the module docstring for the blocks of `kv_cache`
    [num_blocks, num_layers, 2, block_size, kv_heads, head_size].

    client: a connected-or-not MooncakeClient (owned: closed by `close`). layout_hash: the
    key namespace (transfer/layout.kv_layout_hash). queue_bytes: bytes of staging slots
    for blocks waiting to be written (≥ one block). Single engine-thread caller for
    publish/claim/finish; the writer thread touches only its slots and the client.
    """

    name = "store"

    def __init__(self, kv_cache: torch.Tensor, client: MooncakeClient, layout_hash: int,
                 queue_bytes: int = 256 << 20) -> None:
        self.kv_cache, self.client = kv_cache, client
        self.prefix = f"baton-kv/{layout_hash:016x}/"
        shape, dtype = kv_cache.shape[1:], kv_cache.dtype
        self.block_bytes = kv_cache[0].numel() * kv_cache.element_size()
        slots = max(1, queue_bytes // self.block_bytes)
        self._slots = torch.empty((slots, *shape), dtype=dtype)
        self._free = list(range(slots))
        self._free_lock = threading.Lock()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._pending = 0  # queued or being written (engine thread adds, writer subtracts)
        self._idle = threading.Condition()
        self._known: OrderedDict[int, None] = OrderedDict()  # engine thread only
        self._epoch = 0  # the client's connection epoch `_known` is about
        self._forget: queue.SimpleQueue = queue.SimpleQueue()  # writer → engine thread
        self._load_buf = torch.empty(shape, dtype=dtype)
        self.totals = TierTotals()
        self.recomputed_blocks = 0
        self.queue_full_drops = 0
        self._thread = threading.Thread(target=self._run, name="baton-kv-store-writer",
                                        daemon=True)
        self._thread.start()
        weakref.finalize(self, self._queue.put, None)

    def key(self, block_hash: int) -> str:
        return f"{self.prefix}{block_hash:016x}"

    def _known_now(self) -> OrderedDict[int, None]:
        """`_known`, emptied first when the client connected anew since (engine thread)."""
        if self.client.epoch != self._epoch:
            self._epoch = self.client.epoch
            self._known.clear()
        return self._known

    def _remember(self, block_hash: int) -> None:
        self._known_now()[block_hash] = None
        self._known.move_to_end(block_hash)
        if len(self._known) > _KNOWN_MAX:
            self._known.popitem(last=False)

    # ---- down: a finished request's blocks ---------------------------------------------
    def publish(self, blocks: Sequence[Block]) -> None:
        """Queue the cached blocks of `blocks` the store is not known to hold (engine
        thread; their KV is copied out now, so the pool may reuse them at once)."""
        known = self._known_now()
        while not self._forget.empty():  # writes that failed: not in the store after all
            known.pop(self._forget.get(), None)
        if not self.client.connected:
            return  # down (or never up): nothing to write to; the writer retries set-up
        for b in blocks:
            if b.block_hash is None or b.block_hash in known:
                continue
            with self._free_lock:
                slot = self._free.pop() if self._free else None
            if slot is None:  # the writer is behind: this block is not written
                self.queue_full_drops += 1
                self.totals.dropped_blocks += 1
                continue
            copy_block(self._slots[slot], self.kv_cache[b.block_id])
            self._remember(b.block_hash)
            with self._idle:
                self._pending += 1
            self._queue.put((b.block_hash, b.token_ids, slot))

    def _run(self) -> None:
        self.client.check()
        next_check = time.monotonic() + 1.0
        while True:
            try:
                job = self._queue.get(timeout=1.0)
            except queue.Empty:
                job = False
            if time.monotonic() >= next_check or job is False:
                self.client.check()  # set-up, breaker (store_client.py)
                next_check = time.monotonic() + 1.0
            if job is False:
                continue
            if job is None:
                return
            jobs = [job]
            while len(jobs) < _BATCH:
                try:
                    job = self._queue.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    self._queue.put(None)
                    break
                jobs.append(job)
            try:
                self._write(jobs)
            except Exception:  # a bug or a library error: these blocks are not stored
                log.exception("writing %d KV blocks to the store failed", len(jobs))
                for block_hash, _, _ in jobs:
                    self._forget.put(block_hash)
            finally:
                with self._free_lock:
                    self._free.extend(slot for _, _, slot in jobs)
                with self._idle:
                    self._pending -= len(jobs)
                    self._idle.notify_all()

    def _write(self, jobs: list[tuple[int, tuple[int, ...], int]]) -> None:
        have = self.client.exists_many([self.key(h) for h, _, _ in jobs])
        t = self.totals
        for i, (block_hash, tokens, slot) in enumerate(jobs):
            if have is not None and have[i]:
                continue
            start = time.perf_counter()
            payload = as_bytes(self._slots[slot])
            header, tok = encode_header(block_hash, tokens, payload)
            if have is None or not self.client.put(self.key(block_hash), header, tok, payload):
                if have is not None and self.client.connected:  # refused (store full)
                    t.dropped_blocks += 1
                    self._forget.put(block_hash)
                    continue
                for h, _, _ in jobs[i:]:  # the store went down: not written
                    self._forget.put(h)
                return
            t.saved_blocks += 1
            t.saved_bytes += len(header) + len(tok) + payload.nbytes
            t.save_seconds += time.perf_counter() - start

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued block is written or dropped (tests, shutdown); False on
        timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout_s)

    # ---- up: a prefix hit below the pool and the tiers -----------------------------------
    def claim(self, block_hash: int, tokens: Sequence[int]) -> StoreClaim | None:
        """Get and verify the block; None on a miss, a bad value (removed, counted) or an
        unavailable store. End a claim with `finish` before the next `claim`."""
        start = time.perf_counter()
        key = self.key(block_hash)
        value = self.client.get(key)
        if value is None:
            self.totals.misses += 1
            return None
        if not decode_into(value, block_hash, tokens, as_bytes(self._load_buf)):
            log.warning("KV block %016x: store value corrupt or for other tokens; removed, "
                        "recomputing", block_hash)
            self.client.remove(key)
            self._known.pop(block_hash, None)
            self.totals.dropped_blocks += 1
            self.recomputed_blocks += 1
            return None
        self.totals.hits += 1
        self._remember(block_hash)
        return StoreClaim("store", -1, start)

    def finish(self, claim: StoreClaim, block_id: int) -> None:
        """Copy the claimed block into pool block `block_id`."""
        copy_block(self.kv_cache[block_id], self._load_buf)
        t = self.totals
        t.loaded_blocks += 1
        t.loaded_bytes += self.block_bytes
        t.load_seconds += time.perf_counter() - claim.started

    def contains(self, block_hash: int) -> bool:
        """Known to be in the store (put or loaded here; no call: queue-order estimates)."""
        return block_hash in self._known_now()

    def counts(self) -> TierCounts:
        """The store's TierCounts: blocks = hashes known here, capacity = the segment this
        worker lends (the store's own size is the master's)."""
        n = len(self._known)
        self.totals.unavailable = self.client.unavailable
        self.totals.reconnects = self.client.reconnects
        return TierCounts("store", n, n * self.block_bytes, self.client.segment_bytes,
                          self.totals)

    def close(self) -> None:
        """Write what is queued (bounded), stop the writer, disconnect (unless the writer
        is still stuck in a call: then the process's exit ends the client)."""
        self.flush(timeout_s=10.0)
        self._queue.put(None)
        self._thread.join(10.0 if self.client.connected else 0.5)
        if self._thread.is_alive():
            self.client.abandon()
        else:
            self.client.close()
