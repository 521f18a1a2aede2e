"""The pool's free blocks in eviction order, by session class (BlockPool owns one).

Three classes, evicted in this order, LRU inside each (issue 13, session hints)::

    (a) anon     blocks of requests without a session, of ended sessions, uncached blocks
                 (uncached ones at the head: nothing to keep)          OrderedDict, LRU
    (b) expired  sessions past their deadline (last use + TTL)    ┐ one list per session,
    (c) pinned   sessions inside their deadline (soft-pinned)     ┘ sessions by deadline

(b) and (c) are one order: sessions by deadline, earliest first. Every expired deadline is
before the clock and every live one after it, so "earliest deadline first" takes all of (b)
before any of (c) without reading the clock; inside a session its blocks are LRU. A pinned
block is still taken when nothing else is free (admission never fails because of a pin); the
pool's eviction hook sends it to the lower tier like any other evicted block.

Costs: add / remove O(1) (plus O(log S) when a session's list becomes non-empty or its
deadline moves: a heap of (deadline, seq, session) with lazily dropped stale entries);
peeking k blocks costs O(k + s log S) for the s sessions it reaches. S: sessions (heap
entries are compacted when stale ones outnumber live ones).

A session's record is created or refreshed by `set_deadline` (a request of it arrived or
released blocks) and dropped once it has no free block and its deadline passed, or by `end`.
Ended sessions are remembered (the last `max_ended`) so a late release of one of their
requests lands in (a); a new `set_deadline(reopen=True)` (a new turn) reopens it.
"""
from __future__ import annotations

import heapq
import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field


@dataclass(eq=False)
class _Session:
    deadline: float
    free: OrderedDict[int, None] = field(default_factory=OrderedDict)
    heap_seq: int | None = None  # seq of this session's valid heap entry, None: not in heap


class FreeLists:
    """Free block ids of one pool, by class (see the module docstring).

    clock: seconds, monotonic (injected by tests to control TTL expiry).
    """

    def __init__(self, num_blocks: int, clock: Callable[[], float] = time.monotonic,
                 max_ended: int = 4096) -> None:
        self.anon: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.sessions: dict[str, _Session] = {}
        self.ended: OrderedDict[str, None] = OrderedDict()
        self.clock, self.max_ended = clock, max_ended
        self._heap: list[tuple[float, int, str]] = []
        self._seq = itertools.count()
        self.num_session_free = 0
        self.pinned_evictions = 0  # blocks taken from sessions inside their deadline
        self.demoted: OrderedDict[str, None] = OrderedDict()  # sessions that lost pinned blocks

    def __len__(self) -> int:
        return len(self.anon) + self.num_session_free

    # ---- sessions ------------------------------------------------------------------------
    def set_deadline(self, session_id: str, ttl_s: float, reopen: bool = False) -> None:
        """Deadline of `session_id` := now + ttl_s (its free blocks move with it). An ended
        session stays ended unless `reopen` (a new turn of it arrived)."""
        if session_id in self.ended:
            if not reopen:
                return
            del self.ended[session_id]
        s = self.sessions.get(session_id)
        deadline = self.clock() + ttl_s
        if s is None:
            s = self.sessions[session_id] = _Session(deadline)
        elif s.deadline == deadline and s.heap_seq is not None:
            return
        s.deadline = deadline
        s.heap_seq = None
        self._push(session_id, s)

    def end(self, session_id: str) -> list[int]:
        """End a session: its free blocks go to the head of (a), first to evict (their hashes
        stay: a duplicate late turn still hits). Returns the ids moved (their owner is now
        class (a))."""
        self.ended[session_id] = None
        self.ended.move_to_end(session_id)
        while len(self.ended) > self.max_ended:
            self.ended.popitem(last=False)
        self.demoted.pop(session_id, None)
        s = self.sessions.pop(session_id, None)
        if s is None:
            return []
        for block_id in reversed(s.free):
            self.anon[block_id] = None
            self.anon.move_to_end(block_id, last=False)
        self.num_session_free -= len(s.free)
        return list(s.free)

    def is_pinned(self, session_id: str) -> bool:
        """True while the session is known, not ended and inside its deadline."""
        s = self.sessions.get(session_id)
        return s is not None and s.deadline > self.clock()

    # ---- blocks --------------------------------------------------------------------------
    def add(self, block_id: int, session_id: str | None, cached: bool) -> str | None:
        """Queue a released block at the MRU end of its class; returns the session list it
        joined (None: class (a)). Uncached blocks go to the head of (a)."""
        s = self.sessions.get(session_id) if session_id is not None and cached else None
        if s is None:
            self.anon[block_id] = None
            if not cached:
                self.anon.move_to_end(block_id, last=False)
            return None
        s.free[block_id] = None
        self.num_session_free += 1
        if s.heap_seq is None:
            self._push(session_id, s)
        return session_id

    def remove(self, block_id: int, owner: str | None, evicting: bool = False) -> None:
        """Take a free block out of its list (a prefix hit, or `evicting` it: a pinned one is
        counted in `pinned_evictions`)."""
        if owner is None:
            del self.anon[block_id]
            return
        s = self.sessions[owner]
        del s.free[block_id]
        self.num_session_free -= 1
        if not evicting and s.free:
            return  # a prefix hit: no clock read
        now = self.clock()
        if evicting and s.deadline > now:
            self.pinned_evictions += 1
            self.demoted[owner] = None
            if len(self.demoted) > self.max_ended:
                self.demoted.popitem(last=False)
        if not s.free and s.deadline <= now:
            del self.sessions[owner]  # nothing left to order; a later release recreates it

    def peek(self, n: int) -> list[tuple[int, str | None]]:
        """The next `n` (block id, owner) in eviction order, unchanged: (a) from its head,
        then sessions by deadline (heap entries popped meanwhile are pushed back)."""
        out: list[tuple[int, str | None]] = [(i, None) for i in itertools.islice(self.anon, n)]
        popped: list[tuple[float, int, str]] = []
        while len(out) < n and self._heap:
            entry = heapq.heappop(self._heap)
            s = self.sessions.get(entry[2])
            if s is None or s.heap_seq != entry[1]:
                continue  # stale
            if not s.free:
                s.heap_seq = None
                continue
            popped.append(entry)
            out += ((i, entry[2]) for i in itertools.islice(s.free, n - len(out)))
        for entry in popped:
            heapq.heappush(self._heap, entry)
        if len(out) < n:
            raise RuntimeError(f"asked for {n} blocks, {len(self)} free")
        return out

    def __iter__(self) -> Iterator[int]:
        """Every free block id (any order)."""
        yield from self.anon
        for s in self.sessions.values():
            yield from s.free

    def drop_sessions(self) -> None:
        """Move every session's free blocks to (a) and forget the sessions (pool reset)."""
        for s in self.sessions.values():
            for block_id in s.free:
                self.anon[block_id] = None
        self.sessions.clear()
        self._heap.clear()
        self.num_session_free = 0

    def _push(self, session_id: str, s: _Session) -> None:
        if len(self._heap) > 2 * len(self.sessions) + 64:
            self._compact()
        if s.heap_seq is None and s.free:
            s.heap_seq = next(self._seq)
            heapq.heappush(self._heap, (s.deadline, s.heap_seq, session_id))

    def _compact(self) -> None:
        """Rebuild the heap from the live sessions (drops stale entries): O(S)."""
        self._heap = []
        for sid, s in self.sessions.items():
            s.heap_seq = next(self._seq) if s.free else None
            if s.heap_seq is None:
                continue
            self._heap.append((s.deadline, s.heap_seq, sid))
        heapq.heapify(self._heap)
