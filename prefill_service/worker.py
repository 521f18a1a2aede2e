"""One prefill request's life on the prefill worker: check, compute, send, reply, release.

    Prefill RPC ─▶ PrefillWorker.prefill(request) ─▶ a PrefillSequence in `entries`
      1. check it (ValueError → INVALID_ARGUMENT); an id aborted earlier (a tombstone,
         lease.py) answers ABORTED, an endpoint with another layout hash answers LAYOUT_MISMATCH
      2. PREFILLING: holds.add(max_tokens=1): BlockHolds keeps its blocks when it finishes: the
         engine's scheduler batches and chunks it with other prompts and reuses its prefix
         cache; the first token is sampled with the request's SamplingParams. What the
         decode worker holds (src_block_ids) beyond this engine's own hit is first read from
         the decode worker's kv_cache into the request's blocks (kv_pull.py), never
         recomputed; a pull that fails is computed instead
      3. SENDING_KV: held blocks [num_cached_on_decode / block_size, ...) go into the decode
         worker's dst_block_ids over the transport; wait for DONE (bounded by the deadline).
         With per-chunk sends (kv_stream.py; NIXL, gRPC, in-process) the transfer began in 2: each
         step's full blocks were pushed as it ended, and only the remainder is left here
      4. HELD: reply OK; the blocks stay referenced until ReleaseBlocks or the lease expires
         (Leases, lease.py), then go to the prefix cache (the session's next turn hits them)

        held block table  [ 7 ][ 8 ][ 9 ][ 3 ]        num_cached_on_decode = 2 blocks
                                    └──┴── sent ──▶ dst_block_ids [ 40 ][ 12 ]

    Abort (or the RPC being cancelled): PREFILLING → the engine drops it and frees its blocks
    (blocks already pushed stay pinned until the cancelled stream is final, `_end_stream`);
    SENDING_KV → the transfer is waited out (blocks are never freed, nor the Abort answered,
    while bytes may still be moving into the decode worker), then released; HELD → released.
    The id is then refused for a while (a tombstone, lease.py), so a Prefill overtaken by its
    Abort never writes into blocks the decode worker has reused.
    Every state change goes through PrefillSequence.move (sequence.py); drain() ends them all.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import NamedTuple

import grpc

from baton.engine.block_holds import BlockHolds, PrefixPull
from baton.engine.request import Request
from baton.outputs import StepOutput
from baton.session_hints import hint_from_proto
from baton.worker.async_engine import AsyncEngine
from baton.worker.process import Rejected
from baton.worker.validate import check_request
from baton.transfer import KVLayoutError, KVSender, TransferState
from baton.worker.wire import cached_spans_to_proto, logprob_to_proto, sampling_params_from_proto
from prefill_service.config import PrefillConfig
from prefill_service.kv_pull import pull_prefix
from prefill_service.kv_stream import KVStream, KVStreams
from prefill_service.lease import Leases
from prefill_service.metrics import PrefillMetrics
from prefill_service.sequence import PrefillEnded, PrefillSequence, PrefillState
from protos import common_pb2, prefill_pb2

log = logging.getLogger(__name__)
S = prefill_pb2


class _FirstToken(NamedTuple):
    out: StepOutput          # the first token's output
    request: Request         # the engine's request (for its scheduled_time)
    time: float              # when the token came


class PrefillWorker:
    """Owns the in-flight and held requests of one prefill engine."""

    def __init__(self, config: PrefillConfig, engine: AsyncEngine, holds: BlockHolds,
                 sender: KVSender, metrics: PrefillMetrics,
                 streams: KVStreams | None = None) -> None:
        """streams: per-chunk sends (its after_step installed on the engine), or None."""
        self.config, self.ae, self.sender, self.metrics = config, engine, sender, metrics
        self.holds, self.streams = holds, streams
        self.block_size = config.engine.cache.block_size
        self.entries: dict[str, PrefillSequence] = {}
        self.leases: Leases[PrefillSequence] = Leases(config.lease_seconds,
                                                      config.tombstone_seconds)
        self.accepting = True
        self._unpins: set[asyncio.Future] = set()  # pin drops in flight (`_unpin_later`)

    def start(self) -> None:
        self.leases.start(self._expire)

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
        if self.leases.buried(rid):
            return self._reply(req, S.PREFILL_STATUS_ABORTED, "request was aborted")
        if req.endpoint.layout_hash != self.sender.layout_hash:
            return self._reply(req, S.PREFILL_STATUS_LAYOUT_MISMATCH,
                               f"endpoint KV layout hash {req.endpoint.layout_hash:016x} != "
                               f"this worker's {self.sender.layout_hash:016x}; handshake first")
        timeout = min(req.timeout_seconds or math.inf, self.config.timeout_seconds)
        seq = self.entries[rid] = PrefillSequence(req, time.monotonic() + timeout)
        seq.task = asyncio.create_task(self._run(seq))
        try:
            return await asyncio.shield(seq.task)
        except asyncio.CancelledError:
            seq.abort("prefill call cancelled by the caller")
            raise

    async def abort(self, rid: str) -> bool:
        """Abort in any state; returns once no transfer of it can still be writing."""
        self.leases.bury(rid)
        seq = self.entries.get(rid)
        if seq is None:
            return False
        seq.abort("Abort call")
        if seq.task is not None:
            await asyncio.wait([seq.task])  # never raises; the task reports its own outcome
        await self._release(seq)
        return True

    async def release(self, rid: str) -> bool:
        seq = self.entries.get(rid)
        if seq is None or seq.state != PrefillState.HELD:
            return False
        return await self._release(seq)

    async def drain(self, timeout_s: float) -> None:
        """Stop taking requests, let in-flight ones finish (then abort the rest), release all."""
        self.accepting = False
        tasks = [s.task for s in self.entries.values() if s.task and not s.task.done()]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)
        await asyncio.gather(*(self.abort(rid) for rid in list(self.entries)))
        self.leases.stop()

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
        if req.src_block_ids and len(req.src_block_ids) != cached // bs:
            raise ValueError(f"{len(req.src_block_ids)} src_block_ids for "
                             f"{cached // bs} blocks held by the decode worker")
        kind = req.endpoint.WhichOneof("transport")
        if kind != self.sender.transport:
            raise ValueError(f"endpoint transport {kind!r}; this worker sends over "
                             f"{self.sender.transport!r}")
        sampling_params_from_proto(req.sampling_params)  # ValueError for bad values
        hint_from_proto(req)  # ValueError for a bad session TTL

    async def _run(self, seq: PrefillSequence) -> prefill_pb2.PrefillResponse:
        req, rid = seq.request, seq.request_id
        try:
            first = await self._compute(seq)
            seq.move(PrefillState.SENDING_KV)
            sent, seconds = await self._send(seq)
        except BaseException as exc:  # forget the sequence; its blocks must be freed too
            if not isinstance(exc, PrefillEnded):  # a bug or a cancel: blocks may be held
                await asyncio.shield(self.ae.call(lambda eng: self.holds.abort(rid)))
            await asyncio.shield(self._end_stream(seq))
            if seq.state != PrefillState.RELEASED:
                seq.move(PrefillState.RELEASED)
            if self.entries.get(rid) is seq:
                del self.entries[rid]
            if not isinstance(exc, PrefillEnded):
                raise
            self.metrics.requests.labels(S.PrefillStatus.Name(exc.status)).inc()
            log.info("prefill ended: %s", exc.error, extra={"request_id": rid})
            return self._reply(req, exc.status, exc.error)
        seq.move(PrefillState.HELD)
        self.leases.hold(seq, req.lease_seconds)
        return self._ok(seq, first, sent, seconds)

    async def _compute(self, seq: PrefillSequence) -> _FirstToken:
        """PREFILLING: the first token; the blocks stay held. ValueError when the engine
        refuses the prompt."""
        req, rid = seq.request, seq.request_id
        # min_tokens only matters for this first token here (eos banned when it is >= 1)
        params = sampling_params_from_proto(req.sampling_params, n=1, max_tokens=1,
                                            min_tokens=min(req.sampling_params.min_tokens, 1))
        q = self.ae.open_stream(rid)
        try:
            engine_req, pull = await self.ae.call(lambda eng: self._add(seq, params))
            if pull is not None:
                ok = await pull_prefix(self.sender, seq, pull)
                await self.ae.call(lambda eng: self.holds.pulled(rid, pull, ok))
            out = await seq.until(q.get())
        except PrefillEnded:
            await self.ae.call(lambda eng: self.holds.abort(rid))  # held blocks included
            raise
        finally:
            self.ae.close_stream(rid)
        if out.finish_reason not in ("stop", "length") or not out.new_token_ids:
            await self.ae.call(lambda eng: self.holds.abort(rid))
            raise PrefillEnded(S.PREFILL_STATUS_ERROR,
                               out.error or f"prefill ended {out.finish_reason}")
        return _FirstToken(out, engine_req, time.monotonic())

    def _add(self, seq: PrefillSequence, params) -> tuple[Request, PrefixPull | None]:
        """Engine thread: begin the streamed transfer (when per-chunk sends are on and the
        sender takes it), then queue the prompt (or have it wait for a pull of what the
        decode worker holds). ValueError like `BlockHolds.add`."""
        req, rid = seq.request, seq.request_id
        if self.streams is not None:
            stream = KVStream(rid, req.transfer_id, req.num_cached_on_decode // self.block_size,
                              list(req.dst_block_ids))
            budget = max(0.001, seq.deadline - time.monotonic())
            seq.stream = stream if self.streams.open(stream, req.endpoint, budget) else None
        try:
            if not req.src_block_ids:
                return self.holds.add(rid, list(req.prompt_token_ids), params,
                                      hint_from_proto(req)), None
            return self.holds.add_pulling(rid, list(req.prompt_token_ids), params,
                                          hint_from_proto(req), req.num_cached_on_decode)
        except BaseException:
            if seq.stream is not None:
                self.streams.stop(seq.stream)  # _run's failure path waits it out
            raise

    async def _end_stream(self, seq: PrefillSequence) -> None:
        """Failure path: stop a streamed transfer, wait until no byte moves, drop its pins."""
        stream, seq.stream = seq.stream, None
        if stream is None:
            return
        try:
            await self.ae.call(lambda eng: self.streams.stop(stream))
            budget = max(0.001, seq.deadline - time.monotonic())
            await self.sender.wait_async(stream.transfer_id, budget + 2.0)
        finally:  # even after a bug here: like the held blocks, the pins must not leak
            self.sender.forget(stream.transfer_id)
            await self.ae.call(lambda eng: self.streams.unpin(stream))

    async def _send(self, seq: PrefillSequence) -> tuple[int, float]:
        """SENDING_KV: (blocks sent, seconds from the last push to DONE). Never returns or
        raises while bytes may move."""
        req, rid = seq.request, seq.request_id
        t0, tid = time.monotonic(), req.transfer_id
        budget = max(0.001, seq.deadline - t0)
        stream = seq.stream
        if stream is not None:  # the rest of a streamed transfer (after_step sent it)
            if not stream.ended:
                await self.ae.call(lambda eng: self.streams.finish(stream))
            sent = stream.num_blocks
        else:
            table = await self.ae.call(lambda eng: self.holds.block_table(rid))
            src = table[req.num_cached_on_decode // self.block_size:]
            try:
                self.sender.send(req.endpoint, tid, src, list(req.dst_block_ids),
                                 request_id=rid, timeout_s=budget)
            except (KVLayoutError, ValueError, RuntimeError) as err:
                await self._release(seq)
                status = S.PREFILL_STATUS_LAYOUT_MISMATCH if isinstance(err, KVLayoutError) \
                    else S.PREFILL_STATUS_TRANSFER_FAILED
                raise PrefillEnded(status, f"KV transfer refused: {err}") from None
            sent = len(src)
        state = await self.sender.wait_async(tid, budget + 2.0)
        self.sender.forget(tid)  # fails it if somehow still in flight (NIXL cancels it)
        if stream is not None:  # final: the pins go at the next step boundary, unawaited
            seq.stream = None
            self._unpin_later(stream)
        seconds = time.monotonic() - t0
        if state != TransferState.DONE or seq.aborted.is_set():
            await self._release(seq)
            if seq.aborted.is_set():
                raise PrefillEnded(S.PREFILL_STATUS_ABORTED, seq.abort_reason)
            raise PrefillEnded(S.PREFILL_STATUS_TRANSFER_FAILED, f"KV transfer ended {state.name}")
        self.metrics.transfer_seconds.observe(seconds)
        return sent, seconds

    def _unpin_later(self, stream: KVStream) -> None:
        """Drop a final transfer's pins on the engine thread without holding the reply for
        it (awaiting the call would wait for the step in flight to end). Blocks stay pinned
        until then: extra references only, the request's own hold is separate."""
        task = asyncio.ensure_future(self.ae.call(lambda eng: self.streams.unpin(stream)))
        self._unpins.add(task)
        task.add_done_callback(self._unpin_done)

    def _unpin_done(self, task: asyncio.Future) -> None:
        self._unpins.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("unpinning sent KV blocks failed: %r", task.exception())

    async def _release(self, seq: PrefillSequence) -> bool:
        """End the hold on a sequence's blocks (to the prefix cache); idempotent."""
        rid = seq.request_id
        if self.entries.get(rid) is seq and seq.state != PrefillState.SENDING_KV:
            del self.entries[rid]
        if seq.state == PrefillState.RELEASED:
            return False
        seq.move(PrefillState.RELEASED)
        self.leases.end(seq)
        return await self.ae.call(lambda eng: self.holds.release(rid))

    async def _expire(self, seq: PrefillSequence) -> None:
        """The reaper found the lease past its deadline (lease.py)."""
        if await self._release(seq):
            self.metrics.leases_expired.inc()
            log.info("lease expired", extra={"request_id": seq.request_id})

    # ---- replies -------------------------------------------------------------------------
    @staticmethod
    def _reply(req, status: int, error: str, **fields) -> prefill_pb2.PrefillResponse:
        return prefill_pb2.PrefillResponse(request_id=req.request_id, status=status,
                                           error=error, **fields)

    def _ok(self, seq: PrefillSequence, first: _FirstToken, sent: int,
            seconds: float) -> prefill_pb2.PrefillResponse:
        """The OK reply of a held sequence, counted in the metrics."""
        out = first.out
        resp = self._reply(seq.request, S.PREFILL_STATUS_OK, "",
                           first_token_id=out.new_token_ids[0],
                           num_cached_tokens=out.num_cached_tokens,
                           cached_spans=cached_spans_to_proto(
                               out.cached_spans, common_pb2.KV_SOURCE_PREFILL_POOL),
                           num_computed_tokens=out.num_prompt_tokens - out.num_cached_tokens,
                           num_pulled_tokens=seq.pulled_tokens,
                           pulled_bytes=seq.pulled_blocks * self.sender.block_bytes,
                           num_transferred_blocks=sent,
                           transferred_bytes=sent * self.sender.block_bytes,
                           transfer_seconds=seconds)
        if out.logprobs:
            resp.first_token_logprobs.CopyFrom(logprob_to_proto(out.logprobs[0]))
        scheduled = first.request.scheduled_time or seq.arrival
        resp.queue_seconds, resp.compute_seconds = scheduled - seq.arrival, first.time - scheduled
        self._count(resp)
        return resp

    def _count(self, resp: prefill_pb2.PrefillResponse) -> None:
        m = self.metrics
        m.requests.labels(S.PrefillStatus.Name(resp.status)).inc()
        m.computed_tokens.inc(resp.num_computed_tokens)
        m.cache_hit_tokens.inc(resp.num_cached_tokens)
        m.transferred_blocks.inc(resp.num_transferred_blocks)
        m.transferred_bytes.inc(resp.transferred_bytes)
        m.pulled_tokens.inc(resp.num_pulled_tokens)
        m.compute_seconds.observe(resp.queue_seconds + resp.compute_seconds)
