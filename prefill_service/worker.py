"""One prefill request's life on the prefill worker, its block lease, aborts and draining.

    Prefill RPC ─▶ PrefillWorker.prefill(request)
      1. check it (ValueError → INVALID_ARGUMENT); an id aborted earlier answers ABORTED, an
         endpoint with another layout hash answers LAYOUT_MISMATCH
      2. PREFILLING: holds.add(max_tokens=1): BlockHolds keeps its blocks when it finishes: the engine's scheduler
         batches and chunks it with other prompts and reuses its prefix cache; the first token
         is sampled with the request's SamplingParams
      3. SENDING_KV: held blocks [num_cached_on_decode / block_size, ...) go into the decode
         worker's dst_block_ids over the transport; wait for DONE (bounded by the deadline)
      4. HELD: reply OK; the blocks stay referenced until ReleaseBlocks or the lease expires,
         then go to the prefix cache (the session's next turn hits them)

        held block table  [ 7 ][ 8 ][ 9 ][ 3 ]        num_cached_on_decode = 2 blocks
                                    └──┴── sent ──▶ dst_block_ids [ 40 ][ 12 ]

    Abort (or the RPC being cancelled): PREFILLING → the engine drops it and frees its blocks;
    SENDING_KV → the transfer is waited out (blocks are never freed, nor the Abort answered,
    while bytes may still be moving into the decode worker), then released; HELD → released.
    The id is then refused for a while (a tombstone), so a Prefill overtaken by its Abort
    never writes into blocks the decode worker has reused.
"""
from __future__ import annotations

import asyncio
import enum
import logging
import math
import time
from dataclasses import dataclass, field

import grpc

from baton.engine.block_holds import BlockHolds
from baton.worker.async_engine import AsyncEngine
from baton.worker.process import Rejected
from baton.worker.validate import check_request
from baton.transfer import KVLayoutError, KVSender, TransferState
from baton.worker.wire import logprob_to_proto, sampling_params_from_proto
from prefill_service.config import PrefillConfig
from prefill_service.metrics import PrefillMetrics
from protos import prefill_pb2

log = logging.getLogger(__name__)
S = prefill_pb2


class PrefillState(enum.IntEnum):
    """Ordered: PREFILLING → SENDING_KV → HELD → RELEASED (or straight to RELEASED)."""

    PREFILLING = 0
    SENDING_KV = 1
    HELD = 2
    RELEASED = 3


class _Stop(Exception):
    def __init__(self, status: int, error: str) -> None:
        super().__init__(error)
        self.status, self.error = status, error


@dataclass(eq=False)
class _Entry:
    request: prefill_pb2.PrefillRequest
    deadline: float
    arrival: float = field(default_factory=time.monotonic)
    state: PrefillState = PrefillState.PREFILLING
    abort_reason: str = ""
    aborted: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task | None = None
    lease_deadline: float = math.inf

    def abort(self, reason: str) -> None:
        self.abort_reason = self.abort_reason or reason
        self.aborted.set()


class PrefillWorker:
    """Owns the in-flight and held requests of one prefill engine."""

    def __init__(self, config: PrefillConfig, engine: AsyncEngine, holds: BlockHolds,
                 sender: KVSender, metrics: PrefillMetrics) -> None:
        self.config, self.ae, self.sender, self.metrics = config, engine, sender, metrics
        self.holds = holds
        self.block_size = config.engine.cache.block_size
        self.entries: dict[str, _Entry] = {}
        self.tombstones: dict[str, float] = {}
        self.accepting = True
        self._reaper: asyncio.Task | None = None

    def start(self) -> None:
        self._reaper = asyncio.create_task(self._reap_leases())

    # ---- RPCs ----------------------------------------------------------------------------
    async def prefill(self, req: prefill_pb2.PrefillRequest) -> prefill_pb2.PrefillResponse:
        """Run one remote prefill (see the module docstring). Raises ValueError / Rejected."""
        rid = req.request_id
        self._check(req)
        old = self.entries.get(rid)
        if old is not None and old.state != PrefillState.HELD:
            raise Rejected(grpc.StatusCode.ALREADY_EXISTS, f"request {rid!r} is in flight")
        if old is not None:  # a finished turn under the same id whose release never came
            await self._release(old)
        if self.tombstones.get(rid, 0.0) > time.monotonic():
            return self._reply(req, S.PREFILL_STATUS_ABORTED, "request was aborted")
        if req.endpoint.layout_hash != self.sender.layout_hash:
            return self._reply(req, S.PREFILL_STATUS_LAYOUT_MISMATCH,
                               f"endpoint KV layout hash {req.endpoint.layout_hash:016x} != "
                               f"this worker's {self.sender.layout_hash:016x}; handshake first")
        timeout = min(req.timeout_seconds or math.inf, self.config.timeout_seconds)
        e = self.entries[rid] = _Entry(req, time.monotonic() + timeout)
        e.task = asyncio.create_task(self._run(e))
        try:
            return await asyncio.shield(e.task)
        except asyncio.CancelledError:
            e.abort("prefill call cancelled by the caller")
            raise

    async def abort(self, rid: str) -> bool:
        """Abort in any state; returns once no transfer of it can still be writing."""
        self.tombstones[rid] = time.monotonic() + self.config.tombstone_seconds
        e = self.entries.get(rid)
        if e is None:
            return False
        e.abort("Abort call")
        if e.task is not None:
            await asyncio.wait([e.task])  # never raises; the task reports its own outcome
        await self._release(e)
        return True

    async def release(self, rid: str) -> bool:
        e = self.entries.get(rid)
        if e is None or e.state != PrefillState.HELD:
            return False
        return await self._release(e)

    async def drain(self, timeout_s: float) -> None:
        """Stop taking requests, let in-flight ones finish (then abort the rest), release all."""
        self.accepting = False
        tasks = [e.task for e in self.entries.values() if e.task and not e.task.done()]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)
        await asyncio.gather(*(self.abort(rid) for rid in list(self.entries)))
        if self._reaper is not None:
            self._reaper.cancel()

    # ---- one request ---------------------------------------------------------------------
    def _check(self, req: prefill_pb2.PrefillRequest) -> None:
        n, bs = len(req.prompt_token_ids), self.block_size
        check_request(req.request_id, n, self.config.max_prompt_tokens, self.accepting,
                      "prefill worker")
        if not req.transfer_id:
            raise ValueError("transfer_id is required")
        cached = req.num_cached_on_decode
        if cached % bs or cached >= n:
            raise ValueError(f"num_cached_on_decode={cached} must be a multiple of block_size "
                             f"{bs} below the prompt length {n}")
        want = -(-n // bs) - cached // bs
        if len(req.dst_block_ids) != want:
            raise ValueError(f"{len(req.dst_block_ids)} dst_block_ids for {want} blocks")
        kind = req.endpoint.WhichOneof("transport")
        if kind != self.sender.transport:
            raise ValueError(f"endpoint transport {kind!r}; this worker sends over "
                             f"{self.sender.transport!r}")
        sampling_params_from_proto(req.sampling_params)  # ValueError for bad values

    async def _run(self, e: _Entry) -> prefill_pb2.PrefillResponse:
        req, rid = e.request, e.request.request_id
        try:
            first, engine_req, t_first = await self._compute(e)
            e.state = PrefillState.SENDING_KV
            sent, seconds = await self._send(e)
        except BaseException as exc:  # blocks are freed by now: forget the entry
            e.state = PrefillState.RELEASED
            if self.entries.get(rid) is e:
                del self.entries[rid]
            if not isinstance(exc, _Stop):
                raise
            self.metrics.requests.labels(S.PrefillStatus.Name(exc.status)).inc()
            log.info("prefill ended: %s", exc.error, extra={"request_id": rid})
            return self._reply(req, exc.status, exc.error)
        lease = min(req.lease_seconds or math.inf, self.config.lease_seconds)
        e.state, e.lease_deadline = PrefillState.HELD, time.monotonic() + lease
        resp = self._reply(req, S.PREFILL_STATUS_OK, "", first_token_id=first.new_token_ids[0],
                           num_cached_tokens=first.num_cached_tokens,
                           num_computed_tokens=first.num_prompt_tokens - first.num_cached_tokens,
                           num_transferred_blocks=sent,
                           transferred_bytes=sent * self.sender.block_bytes,
                           transfer_seconds=seconds)
        if first.logprobs:
            resp.first_token_logprobs.CopyFrom(logprob_to_proto(first.logprobs[0]))
        scheduled = engine_req.scheduled_time or e.arrival
        resp.queue_seconds, resp.compute_seconds = scheduled - e.arrival, t_first - scheduled
        self._count(resp)
        return resp

    async def _compute(self, e: _Entry):
        """PREFILLING: (first token's StepOutput, the engine's Request, time of the token);
        the blocks stay held. ValueError when the engine refuses the prompt."""
        req, rid = e.request, e.request.request_id
        params = sampling_params_from_proto(req.sampling_params, n=1, max_tokens=1, min_tokens=0)
        q = self.ae.open_stream(rid)
        try:
            engine_req = await self.ae.call(
                lambda eng: self.holds.add(rid, list(req.prompt_token_ids), params))
            out = await self._until(e, q.get())
        except _Stop:
            await self.ae.call(lambda eng: self.holds.abort(rid))  # held blocks included
            raise
        finally:
            self.ae.close_stream(rid)
        if out.finish_reason not in ("stop", "length") or not out.new_token_ids:
            await self.ae.call(lambda eng: self.holds.abort(rid))
            raise _Stop(S.PREFILL_STATUS_ERROR, out.error or f"prefill ended {out.finish_reason}")
        return out, engine_req, time.monotonic()

    async def _until(self, e: _Entry, aw):
        """Await `aw` unless the entry is aborted or its deadline passes first (_Stop)."""
        work, stop = asyncio.ensure_future(aw), asyncio.ensure_future(e.aborted.wait())
        try:
            done, _ = await asyncio.wait({work, stop}, timeout=e.deadline - time.monotonic(),
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            work.cancel()
            stop.cancel()
        if work in done:
            return work.result()
        if stop in done:
            raise _Stop(S.PREFILL_STATUS_ABORTED, e.abort_reason)
        raise _Stop(S.PREFILL_STATUS_TIMEOUT, "timeout_seconds passed before the first token")

    async def _send(self, e: _Entry) -> tuple[int, float]:
        """SENDING_KV: (blocks sent, seconds). Never returns or raises while bytes may move."""
        req, rid = e.request, e.request.request_id
        table = await self.ae.call(lambda eng: self.holds.block_table(rid))
        src = table[req.num_cached_on_decode // self.block_size:]
        t0, tid = time.monotonic(), req.transfer_id
        budget = max(0.001, e.deadline - t0)
        try:
            self.sender.send(req.endpoint, tid, src, list(req.dst_block_ids), request_id=rid,
                             timeout_s=budget)
        except (KVLayoutError, ValueError, RuntimeError) as err:
            await self._release(e)
            status = S.PREFILL_STATUS_LAYOUT_MISMATCH if isinstance(err, KVLayoutError) \
                else S.PREFILL_STATUS_TRANSFER_FAILED
            raise _Stop(status, f"KV transfer refused: {err}") from None
        state = await self.sender.wait_async(tid, budget + 2.0)
        self.sender.forget(tid)  # fails it if somehow still in flight (NIXL cancels it)
        seconds = time.monotonic() - t0
        if state != TransferState.DONE or e.aborted.is_set():
            await self._release(e)
            if e.aborted.is_set():
                raise _Stop(S.PREFILL_STATUS_ABORTED, e.abort_reason)
            raise _Stop(S.PREFILL_STATUS_TRANSFER_FAILED, f"KV transfer ended {state.name}")
        self.metrics.transfer_seconds.observe(seconds)
        return len(src), seconds

    async def _release(self, e: _Entry) -> bool:
        """End the hold on an entry's blocks (to the prefix cache); idempotent."""
        rid = e.request.request_id
        if self.entries.get(rid) is e and e.state != PrefillState.SENDING_KV:
            del self.entries[rid]
        if e.state == PrefillState.RELEASED:
            return False
        e.state = PrefillState.RELEASED
        return await self.ae.call(lambda eng: self.holds.release(rid))

    async def _reap_leases(self) -> None:
        pause = min(1.0, self.config.lease_seconds / 4)
        while True:
            await asyncio.sleep(pause)
            now = time.monotonic()
            for e in [e for e in self.entries.values()
                      if e.state == PrefillState.HELD and e.lease_deadline < now]:
                if await self._release(e):
                    self.metrics.leases_expired.inc()
                    log.info("lease expired", extra={"request_id": e.request.request_id})
            self.tombstones = {k: t for k, t in self.tombstones.items() if t > now}

    # ---- replies -------------------------------------------------------------------------
    @staticmethod
    def _reply(req, status: int, error: str, **fields) -> prefill_pb2.PrefillResponse:
        return prefill_pb2.PrefillResponse(request_id=req.request_id, status=status,
                                           error=error, **fields)

    def _count(self, resp: prefill_pb2.PrefillResponse) -> None:
        m = self.metrics
        m.requests.labels(S.PrefillStatus.Name(resp.status)).inc()
        m.computed_tokens.inc(resp.num_computed_tokens)
        m.cache_hit_tokens.inc(resp.num_cached_tokens)
        m.transferred_blocks.inc(resp.num_transferred_blocks)
        m.transferred_bytes.inc(resp.transferred_bytes)
        m.compute_seconds.observe(resp.queue_seconds + resp.compute_seconds)
