"""The two promises a prefill worker makes for a limited time: leases and tombstones.

Lease: after a Prefill replies OK its blocks stay held (BlockHolds) for the decode worker's
ReleaseBlocks, which lets the session's next turn find them here and lets a slow decode worker
finish its read. A decode worker that dies or forgets never sends it, so each hold has a
deadline; the reaper ends the holds past it and their blocks go to the prefix cache.

    Prefill OK ─▶ hold(seq, lease_seconds)   deadline = now + min(requested, --lease-seconds)
    ReleaseBlocks / Abort / a new turn ─▶ end(seq)
    reaper, every min(1 s, lease/4): expire(seq) for each deadline passed, then sweep()

Tombstone: an Abort may overtake its own Prefill (the decode worker gave up and reused the
destination blocks it had named). Had the worker never seen that id, the late Prefill would
still compute and write into blocks that now belong to another request. So every Abort
leaves the id refused for --tombstone-seconds, whether or not it was found:

    Abort(rid) ─▶ bury(rid)      Prefill(rid) ─▶ buried(rid)? → PREFILL_STATUS_ABORTED
    the reaper drops tombstones whose time has passed (the map stays bounded)

Time comes from `clock` (time.monotonic), so tests can drive both without sleeping.
"""
from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class Leases(Generic[K]):
    """Deadlines of held requests (keyed by whatever the caller holds: one key per hold)
    and of aborted request ids. Event-loop thread only."""

    def __init__(self, lease_seconds: float, tombstone_seconds: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.lease_seconds, self.tombstone_seconds = lease_seconds, tombstone_seconds
        self.clock = clock
        self._deadlines: dict[K, float] = {}
        self._tombstones: dict[str, float] = {}
        self._reaper: asyncio.Task | None = None

    # ---- leases --------------------------------------------------------------------------
    def hold(self, key: K, requested_seconds: float = 0.0) -> float:
        """Start (or restart) a lease; the request may shorten the worker's lease, never
        lengthen it (0 = the worker's). Returns the deadline."""
        seconds = min(requested_seconds or math.inf, self.lease_seconds)
        self._deadlines.pop(key, None)  # a restarted lease counts from now, in order too
        deadline = self._deadlines[key] = self.clock() + seconds
        return deadline

    def end(self, key: K) -> None:
        """The hold ended some other way (released, aborted); idempotent."""
        self._deadlines.pop(key, None)

    def expired(self, now: float | None = None) -> list[K]:
        """Keys whose deadline has passed, in the order their leases began."""
        now = self.clock() if now is None else now
        return [k for k, t in self._deadlines.items() if t < now]

    def __contains__(self, key: K) -> bool:
        return key in self._deadlines

    def __len__(self) -> int:
        return len(self._deadlines)

    # ---- tombstones ----------------------------------------------------------------------
    def bury(self, request_id: str) -> None:
        """Refuse `request_id` for tombstone_seconds from now (an Abort came)."""
        self._tombstones[request_id] = self.clock() + self.tombstone_seconds

    def buried(self, request_id: str) -> bool:
        """Whether a Prefill under this id must answer ABORTED."""
        return self._tombstones.get(request_id, 0.0) > self.clock()

    def sweep(self, now: float | None = None) -> None:
        """Forget tombstones whose time has passed."""
        now = self.clock() if now is None else now
        self._tombstones = {k: t for k, t in self._tombstones.items() if t > now}

    # ---- the reaper ----------------------------------------------------------------------
    async def reap(self, expire: Callable[[K], Awaitable[object]]) -> None:
        """One pass: `expire` each key past its deadline (it is expected to end() it), then
        sweep the tombstones as of the pass's start."""
        now = self.clock()
        for key in self.expired(now):
            await expire(key)
        self.sweep(now)

    def start(self, expire: Callable[[K], Awaitable[object]]) -> None:
        """Run reap(expire) every min(1 s, lease_seconds / 4) until stop()."""
        self._reaper = asyncio.create_task(self._reap_forever(expire))

    def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()

    async def _reap_forever(self, expire: Callable[[K], Awaitable[object]]) -> None:
        pause = min(1.0, self.lease_seconds / 4)
        while True:
            await asyncio.sleep(pause)
            await self.reap(expire)
