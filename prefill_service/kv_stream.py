"""KV sent while the prompt is still being prefilled: each step's newly full blocks go out at
once, so the next chunk's compute overlaps their transfer (SGLang likewise sends a prefill's
pages as its chunks finish). TTFT ≈ prefill time + the last chunk's transfer.

    block_size 4, chunk cap 8, num_cached_on_decode 0, prompt of 19 tokens, 5 dst blocks
    open:    sender.begin(endpoint, tid, dst_block_ids)          (before the request is added)
    step 1:  tokens 0-7 computed   → blocks 0,1 full → push(tid, [b0, b1])   pinned
    step 2:  tokens 8-15 computed  → push(tid, [b2, b3]) while step 3 computes
    step 3:  tokens 16-18 + first token: the request finishes, held (block_holds.py)
    finish:  push(tid, [b4])       the remainder: the last chunk's blocks and the partial one
                                   (in the same after_step, as soon as the request is held)
    the worker waits for DONE as before, then unpins; the decode side sees one transfer

Every method runs on the engine thread (`after_step` is AsyncEngine's hook; the worker calls
the others through `AsyncEngine.call`), so a push never races a preemption or an abort:
pushed blocks are pinned (an extra reference, `BlockHolds.pin`) until `unpin`, which the worker
calls only once the transfer is final, i.e. once no byte of those blocks can still be read.
A push that raises cancels the transfer (the reply then says TRANSFER_FAILED; the decode
worker recomputes). Every transport streams (NIXL: one WRITE per push, nixl_sender.py); one
without `KVSender.streams` would get no KVStreams: the worker then sends once, after the prefill.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from baton.engine.block_holds import BlockHolds
from baton.engine.kv_cache import Block
from baton.engine.llm_engine import LLMEngine
from baton.transfer import KVLayoutError, KVSender
from protos import transfer_pb2

log = logging.getLogger(__name__)


@dataclass(eq=False)
class KVStream:
    """One request's streamed transfer. Block k of the transfer is block first_block + k of
    the prefill block table (first_block = num_cached_on_decode // block_size)."""

    request_id: str
    transfer_id: str
    first_block: int
    dst_block_ids: list[int]        # on the decode worker, in transfer order
    sent: int = 0                   # dst blocks pushed so far
    pushes: list[int] = field(default_factory=list)  # blocks per push, early ones first
    pinned: list[Block] = field(default_factory=list)
    failed: str = ""                # why a push raised (the transfer was cancelled)
    ended: bool = False             # finish() ran: every block pushed, nothing more comes

    @property
    def num_blocks(self) -> int:
        return len(self.dst_block_ids)


class KVStreams:
    """The streamed transfers of one prefill engine (engine thread only)."""

    def __init__(self, holds: BlockHolds, sender: KVSender, block_size: int) -> None:
        if not sender.streams:
            raise ValueError(f"{type(sender).__name__} cannot stream a transfer")
        self.holds, self.sender, self.block_size = holds, sender, block_size
        self.live: dict[str, KVStream] = {}

    def open(self, stream: KVStream, endpoint: transfer_pb2.TransferEndpoint,
             timeout_s: float) -> bool:
        """Begin the transfer; False (nothing begun) when the sender refuses it: the
        worker then sends once at the end, which reports the refusal."""
        try:
            self.sender.begin(endpoint, stream.transfer_id, stream.dst_block_ids,
                              request_id=stream.request_id, timeout_s=timeout_s)
        except (KVLayoutError, ValueError, RuntimeError) as err:
            log.info("streaming refused (%s); sending once at the end", err,
                     extra={"request_id": stream.request_id})
            return False
        self.live[stream.request_id] = stream
        return True

    def after_step(self, engine: LLMEngine) -> None:
        """Push every live stream's blocks that the step just completed; a prompt the step
        finished (held) gets the rest of its blocks now (`finish`), before its first token
        reaches the worker: waiting for the worker to ask would cost a whole engine step
        (its call runs between steps), seconds behind a long prompt's chunk on a CPU."""
        for s in list(self.live.values()):
            try:
                req = engine.get_request(s.request_id)
            except KeyError:
                if s.request_id in self.holds:
                    self.finish(s)
                continue  # or ended without a hold (stop() comes)
            full = min(req.num_computed_tokens // self.block_size - s.first_block, s.num_blocks)
            if full > s.sent:
                self._push(s, full)

    def finish(self, stream: KVStream) -> None:
        """The prompt is done and held: push the rest of its blocks (ends the stream).
        Idempotent: `stream.ended` tells the worker it already ran."""
        if self.live.pop(stream.request_id, None) is stream:
            self._push(stream, stream.num_blocks)
        stream.ended = True

    def stop(self, stream: KVStream) -> None:
        """No more pushes; the transfer is cancelled unless it is final already."""
        if self.live.get(stream.request_id) is stream:
            del self.live[stream.request_id]
        self.sender.cancel(stream.transfer_id)

    def unpin(self, stream: KVStream) -> None:
        """Drop the pins (call once the transfer is final)."""
        pins, stream.pinned = stream.pinned, []
        self.holds.unpin(pins)

    def _push(self, s: KVStream, upto: int) -> None:
        """Pin and push transfer blocks [s.sent, upto); a failure cancels the transfer."""
        try:
            ids, pins = self.holds.pin(s.request_id, s.first_block + s.sent,
                                       s.first_block + upto)
            s.pinned.extend(pins)
            self.sender.push(s.transfer_id, ids)
        except (KeyError, ValueError, RuntimeError) as err:
            log.warning("pushing KV blocks failed: %r", err, extra={"request_id": s.request_id})
            s.failed = repr(err)
            self.stop(s)
            return
        s.pushes.append(len(ids))
        s.sent = upto

