"""A quarantine: decode blocks a late write may reach, held until it is known that none can.

    RemoteKV.fail(writes_may_land=True) ─▶ hold_id      blocks referenced, in no block table
    Quarantine(hold_id, request_id, peer, until).run():
      after 0.5 s, 1 s, 2 s, 4 s, 5 s, 5 s … : Abort(request_id) ─▶ the prefill worker
        STOPPED        the process that took the Prefill answered ─▶ release_hold now
        UNANSWERED     busy in a long step, paused, unreachable   ─▶ ask again
        OTHER_PROCESS  it restarted on that address               ─▶ stop asking
      at `until` (the prefill deadline + grace) ─▶ release_hold, whatever was heard

Why an answered Abort proves that no write of the request can still land (prefill_service/
worker.py): the prefill worker buries the id first (lease.py: a Prefill of it arriving
later, e.g. still in the network, answers ABORTED without any work; each re-sent Abort buries
it again), then, when it knows the request, sets its abort and waits for its task: a
transfer under way is waited out (_send never returns while bytes may move), so the answer
comes only after it ended. When it does not know the request, the request never arrived
(the tombstone now refuses it) or already left `entries`, which it does only once its
transfer ended (DONE before HELD; waited out and forgotten on failure).

Why only that process: kv_epoch is random per process, the Prefill carried the handshake's
and any other process refuses it (STALE_HANDSHAKE), so only the handshake's process ever
writes these blocks, and only its answer (same kv_epoch) counts. A process that restarted on
the address proves nothing of the old one: a dead process writes no more (its UCX endpoints
die with it), but a silent one need not be dead: a SIGSTOPped or cut-off process still has
its posted writes and resumes. So without its answer the hold lasts until `until`, by which
its own Prefill timeout has stopped it (and the grace covers writes already under way).
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from baton.engine.remote_kv import RemoteKV
from baton.worker.async_engine import AsyncEngine
from decode_service.context import DecodeContext
from decode_service.peers import AbortAnswer, PrefillPeer

log = logging.getLogger(__name__)

RETRY_FIRST_S = 0.5  # the first re-sent Abort; then doubling up to RETRY_MAX_S
RETRY_MAX_S = 5.0    # so the blocks come back ≤ 5 s after the prefill worker can answer


@dataclass(frozen=True)
class Quarantine:
    """`until`: time.monotonic() by which no write can land, answer or not."""

    hold_id: int
    request_id: str
    peer: PrefillPeer
    until: float

    async def run(self, engine: AsyncEngine, remote_kv: RemoteKV, ctx: DecodeContext) -> None:
        """Release the hold once the prefill worker confirmed, at the latest at `until`."""
        ctx.metrics.quarantined.inc()
        t0 = time.monotonic()
        try:
            confirmed = await self._confirmed(ctx)
            if not confirmed:
                await asyncio.sleep(max(0.0, self.until - time.monotonic()))
            await engine.call(lambda e: remote_kv.release_hold(self.hold_id))
        finally:
            ctx.metrics.quarantined.dec()
        if confirmed:
            ctx.metrics.quarantines_confirmed.inc()
        log.info("quarantine ended", extra={
            "request_id": self.request_id, "peer": self.peer.address,
            "seconds": round(time.monotonic() - t0, 3), "confirmed": confirmed})

    async def _confirmed(self, ctx: DecodeContext) -> bool:
        """Re-send Abort with backoff until `until`; True once the peer's process answered."""
        try:
            return await asyncio.wait_for(self._ask(ctx), self.until - time.monotonic())
        except TimeoutError:
            return False

    async def _ask(self, ctx: DecodeContext) -> bool:
        pause = RETRY_FIRST_S
        while True:
            await asyncio.sleep(pause)
            answer = await ctx.peers.abort(self.peer, self.request_id, again=True)
            if answer is not AbortAnswer.UNANSWERED:
                return answer is AbortAnswer.STOPPED
            pause = min(pause * 2, RETRY_MAX_S)
