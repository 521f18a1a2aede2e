"""One prefill request on this worker: its ordered state and the one place it changes.

    PREFILLING ──▶ SENDING_KV ──▶ HELD ──▶ RELEASED     ReleaseBlocks, Abort, lease expiry
         │              │                     ▲
         └──────────────┴─────────────────────┘        Abort, timeout or failure on the way

With per-chunk sends (kv_stream.py) the transfer starts in PREFILLING: blocks move while
the prompt is computed, and SENDING_KV sends only the remainder.

A PrefillSequence is made when a Prefill call passes its checks and lives until its blocks
are released, which is after the call's reply when it ends HELD (worker.py runs it, lease.py
times the hold). `until` bounds each wait by the call's deadline and by an abort; both end
the prefill with a PrefillEnded, which the worker turns into the reply's PrefillStatus.
"""
from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field

from prefill_service.kv_stream import KVStream
from protos import prefill_pb2

S = prefill_pb2


class PrefillState(enum.IntEnum):
    """Ordered: PREFILLING → SENDING_KV → HELD → RELEASED (or straight to RELEASED)."""

    PREFILLING = 0
    SENDING_KV = 1
    HELD = 2
    RELEASED = 3


class PrefillEnded(Exception):
    """Ends a prefill early with a PrefillStatus (the reply, not an RPC error)."""

    def __init__(self, status: int, error: str) -> None:
        super().__init__(error)
        self.status, self.error = status, error


@dataclass(eq=False)
class PrefillSequence:
    """One Prefill call's prompt on this worker, from arrival until its blocks are released
    (the call replies at HELD; the sequence lives on until ReleaseBlocks, Abort or its lease).
    Compared and hashed by identity: a later turn under the same id is another sequence."""

    request: prefill_pb2.PrefillRequest
    deadline: float  # of the call: queue, compute and transfer
    arrival: float = field(default_factory=time.monotonic)
    state: PrefillState = PrefillState.PREFILLING
    abort_reason: str = ""
    aborted: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[prefill_pb2.PrefillResponse] | None = None
    stream: KVStream | None = None  # its transfer, while streamed per chunk (kv_stream.py)
    pulled_tokens: int = 0  # prompt tokens read from the decode worker (kv_pull.py)
    pulled_blocks: int = 0

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def move(self, to: PrefillState) -> None:
        """The one place the state changes: one step forward, or to RELEASED from any other."""
        legal = to == self.state + 1 or (to == PrefillState.RELEASED != self.state)
        assert legal, f"{self.request_id}: {self.state.name} → {to.name}"
        self.state = to

    def abort(self, reason: str) -> None:
        self.abort_reason = self.abort_reason or reason
        self.aborted.set()

    async def until(self, aw):
        """Await `aw` unless this is aborted or its deadline passes first (PrefillEnded)."""
        work, stop = asyncio.ensure_future(aw), asyncio.ensure_future(self.aborted.wait())
        try:
            done, _ = await asyncio.wait({work, stop}, timeout=self.deadline - time.monotonic(),
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            work.cancel()
            stop.cancel()
        if work in done:
            return work.result()
        if stop in done:
            raise PrefillEnded(S.PREFILL_STATUS_ABORTED, self.abort_reason)
        raise PrefillEnded(S.PREFILL_STATUS_TIMEOUT,
                           "timeout_seconds passed before the first token")
