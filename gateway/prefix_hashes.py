"""Block hashes of a prompt, reusing the hashes of the session's previous prompt.

An agent's turn k+1 starts with turn k's prompt, so the chained hashes of those blocks are
already known: only blocks past the common prefix are hashed (baton.block_hash, the same hash
the workers report). The previous prompt is kept as int32 bytes per session (a bounded LRU),
so the common prefix is found with a few C-level byte compares.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

from baton.block_hash import hash_block_tokens


class SessionHashCache:
    def __init__(self, max_bytes: int = 64 << 20) -> None:
        self._entries: OrderedDict[str, tuple[int, bytes, list[int]]] = OrderedDict()
        self._bytes = 0
        self._max_bytes = max_bytes

    def hashes(self, token_ids: list[int], block_size: int, session_id: str = "") -> list[int]:
        ids = np.asarray(token_ids, dtype=np.int32)
        if not session_id:
            return hash_block_tokens(ids, block_size)
        data = ids.tobytes()
        start = self._reusable(session_id, data, block_size)
        hashes = hash_block_tokens(ids, block_size, start)
        self._store(session_id, (block_size, data, hashes))
        return hashes

    def _reusable(self, session_id: str, data: bytes, block_size: int) -> list[int]:
        entry = self._entries.get(session_id)
        if entry is None or entry[0] != block_size:
            return []
        _, old, old_hashes = entry
        step = 4 * block_size  # bytes per block
        n = min(len(old_hashes), len(data) // step)
        if data[:n * step] == old[:n * step]:
            return old_hashes[:n]
        lo, hi = 0, n  # the longest equal prefix, in blocks: lo matches, hi does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if data[:mid * step] == old[:mid * step] else (lo, mid)
        return old_hashes[:lo]

    def _store(self, session_id: str, entry: tuple[int, bytes, list[int]]) -> None:
        old = self._entries.pop(session_id, None)
        if old is not None:
            self._bytes -= len(old[1])
        self._entries[session_id] = entry
        self._bytes += len(entry[1])
        while self._bytes > self._max_bytes and len(self._entries) > 1:
            _, dropped = self._entries.popitem(last=False)
            self._bytes -= len(dropped[1])
