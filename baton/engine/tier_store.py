"""The two KV tiers below a worker's pool, each an LRU keyed by the chained block hash.

    HostTier: one preallocated tensor [num_slots, *block_shape] (the pool's dtype) and an
              OrderedDict hash → (slot, tokens); no allocation per block.
    DiskTier: one file per block in its own directory, an OrderedDict hash → (tokens) in
              memory; every file carries a header and a CRC-32 so a truncated or damaged
              file is detected on load (dropped, never decoded from).

Block file layout (little-endian)::

    magic "BKV1" | u64 block hash | u32 n_tokens | u64 payload bytes | u32 crc32
    | i32 tokens[n_tokens] | payload (one block of KV, all layers, as raw bytes)

The CRC covers the tokens and the payload. Both tiers only store and find: which tier a
block goes to and when is `KVTier`'s business (kv_tier.py).
"""
from __future__ import annotations

import os
import shutil
import struct
import tempfile
import weakref
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np
import torch

_MAGIC = b"BKV1"
_HEADER = struct.Struct("<4sQIQI")


def as_bytes(t: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor's bytes as a flat uint8 numpy view (no copy; bf16 included)."""
    return t.view(torch.uint8).reshape(-1).numpy()


def copy_block(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst ← src for one block (same shape and dtype, contiguous). CPU to CPU is one numpy
    memcpy in this thread: torch's copy_ splits 720 KiB over its OpenMP threads, and on a
    loaded 2-core machine waiting for a descheduled one costs milliseconds (measured:
    0.35–6 ms vs 0.06–0.6 ms; benchmarks/kv_tier_bandwidth.py)."""
    if dst.is_cuda or src.is_cuda:
        dst.copy_(src, non_blocking=False)
    else:
        np.copyto(as_bytes(dst), as_bytes(src))


class HostTier:
    """`num_slots` blocks of host memory, LRU by hash (the head is evicted first).

    store: [num_slots, *block_shape] of `dtype` (pinned when `pin`, for device → host copies).
    """

    def __init__(self, num_slots: int, block_shape: Sequence[int], dtype: torch.dtype,
                 pin: bool = False) -> None:
        self.store = torch.empty(num_slots, *block_shape, dtype=dtype, pin_memory=pin)
        self.index: OrderedDict[int, tuple[int, tuple[int, ...]]] = OrderedDict()
        self.free_slots = list(range(num_slots - 1, -1, -1))  # pop() gives slot 0 first

    @property
    def num_slots(self) -> int:
        return self.store.shape[0]

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.index

    def find(self, block_hash: int, tokens: Sequence[int]) -> bool:
        entry = self.index.get(block_hash)
        return entry is not None and entry[1] == tuple(tokens)

    def touch(self, block_hash: int) -> None:
        self.index.move_to_end(block_hash)

    def lru(self) -> tuple[int, int, tuple[int, ...]] | None:
        """(hash, slot, tokens) of the next victim, None when empty."""
        if not self.index:
            return None
        block_hash, (slot, tokens) = next(iter(self.index.items()))
        return block_hash, slot, tokens

    def put(self, block_hash: int, tokens: Sequence[int]) -> int:
        """Claim a free slot for `block_hash` (most recently used); the caller fills
        store[slot]. Raises IndexError when no slot is free (evict first)."""
        slot = self.free_slots.pop()
        self.index[block_hash] = (slot, tuple(tokens))
        return slot

    def take(self, block_hash: int) -> int:
        """Remove `block_hash` from the index; its slot stays unusable until `free_slot`
        (the caller still reads it). KeyError when absent."""
        slot, _ = self.index.pop(block_hash)
        return slot

    def free_slot(self, slot: int) -> None:
        self.free_slots.append(slot)


def unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def write_block_file(path: str, block_hash: int, tokens: Sequence[int],
                     payload: np.ndarray) -> int:
    """Write one block file (layout in the module docstring); returns its bytes. Touches
    nothing but the file, so it may run on another thread. Raises OSError (a short write
    leaves no file)."""
    tok = np.asarray(tokens, dtype="<i4")
    crc = zlib.crc32(payload, zlib.crc32(tok))
    header = _HEADER.pack(_MAGIC, block_hash, len(tok), payload.nbytes, crc)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        n = os.writev(fd, [header, tok.tobytes(), payload])
    finally:
        os.close(fd)
    if n != _HEADER.size + tok.nbytes + payload.nbytes:
        os.unlink(path)
        raise OSError(f"short write of {path}: {n} bytes")
    return n


class DiskTier:
    """Block files under a fresh directory inside `root`, at most `capacity_bytes` of them.

    The directory is this tier's alone (two workers may share `root`) and is removed when
    the tier is garbage-collected or the process exits. `unlink(path)` deletes a dropped
    block's file (KVTier queues it behind pending writes when they run in the background).
    """

    def __init__(self, root: str, capacity_bytes: int, block_bytes: int,
                 unlink: Callable[[str], None] | None = None) -> None:
        os.makedirs(root, exist_ok=True)
        self.unlink = unlink or unlink_quiet
        self.dir = tempfile.mkdtemp(prefix="baton-kv-", dir=root)
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.dir, True)
        self.block_bytes = block_bytes
        self.file_bytes = lambda n_tokens: _HEADER.size + 4 * n_tokens + block_bytes
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.index: OrderedDict[int, tuple[int, ...]] = OrderedDict()

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.index

    def find(self, block_hash: int, tokens: Sequence[int]) -> bool:
        return self.index.get(block_hash) == tuple(tokens)

    def touch(self, block_hash: int) -> None:
        self.index.move_to_end(block_hash)

    def path(self, block_hash: int) -> str:
        return os.path.join(self.dir, f"{block_hash:016x}.kv")

    def evict_for(self, n_tokens: int) -> list[int]:
        """Delete LRU files until one more block of `n_tokens` fits; returns their hashes."""
        need, out = self.file_bytes(n_tokens), []
        if need > self.capacity_bytes:
            raise ValueError(f"a {need}-byte block file exceeds the disk tier budget")
        while self.used_bytes + need > self.capacity_bytes:
            out.append(self.drop(next(iter(self.index))))
        return out

    def drop(self, block_hash: int) -> int:
        """Forget `block_hash` and delete its file (if any); returns the hash."""
        tokens = self.index.pop(block_hash)
        self.used_bytes -= self.file_bytes(len(tokens))
        self.unlink(self.path(block_hash))
        return block_hash

    def add(self, block_hash: int, tokens: Sequence[int]) -> int:
        """Index a block whose file is (being) written (call `evict_for` first); returns
        its file bytes."""
        n = self.file_bytes(len(tokens))
        self.index[block_hash] = tuple(tokens)
        self.used_bytes += n
        return n

    def write(self, block_hash: int, tokens: Sequence[int], payload: np.ndarray) -> int:
        """Write one block file now and index it (call `evict_for` first); returns bytes
        written. payload: flat uint8 [block_bytes]. Raises OSError (nothing indexed then)."""
        assert payload.nbytes == self.block_bytes, (payload.nbytes, self.block_bytes)
        write_block_file(self.path(block_hash), block_hash, tokens, payload)
        return self.add(block_hash, tokens)

    def read_into(self, block_hash: int, tokens: Sequence[int], out: np.ndarray) -> bool:
        """Read and verify the block file into `out` (flat uint8 [block_bytes]).

        False when the file is missing, short, long, of another block or fails its CRC:
        `out` then holds garbage and the caller must not use it (nor the entry: `drop`).
        """
        tok = np.asarray(tokens, dtype="<i4")
        want = self.file_bytes(len(tok))
        try:
            with open(self.path(block_hash), "rb", buffering=0) as f:
                if os.fstat(f.fileno()).st_size != want:
                    return False
                head = f.read(_HEADER.size + tok.nbytes)
                n = f.readinto(out)
        except OSError:
            return False
        if len(head) != _HEADER.size + tok.nbytes or n != self.block_bytes:
            return False
        magic, h, n_tok, n_payload, crc = _HEADER.unpack_from(head)
        ok = (magic == _MAGIC and h == block_hash and n_tok == len(tok)
              and n_payload == self.block_bytes and head[_HEADER.size:] == tok.tobytes())
        return ok and zlib.crc32(out, zlib.crc32(tok)) == crc
