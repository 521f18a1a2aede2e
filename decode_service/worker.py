"""A Generate request's life on the decode worker (its n sequences, the stream, aborts).

    Generate ─▶ DecodeWorker.generate(request)
      1. check it (ValueError → INVALID_ARGUMENT, Rejected → its code), register the Job
         (job.py)
      2. choose where to prefill: LOCAL mode or no prefill worker → here; otherwise handshake
         with the prefill worker (cached per address; a layout mismatch is FAILED_PRECONDITION
         naming the field; unreachable → prefill here, or UNAVAILABLE under `fail`)
      3. sequence 0: admit (local or remote, as the cost model says: baton/pd_cost.py;
         REMOTE mode or --min-remote-tokens: a fixed threshold; see sequence.py);
         sequences 1..n-1 are then admitted locally and hit the prompt blocks sequence 0
         just put in the prefix cache (or end at once with its error)
      4. stream (stream.py): TokenChunk per new tokens (any sequence), then one Finished per
         sequence once all are done (usage and timings are the request's)
    Abort(request_id) or the client cancelling the call: every sequence stops wherever it
    is (admitting, waiting for remote KV, in the engine); blocks are freed once no transfer
    can write into them (DecodeSequence.settled).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc

from baton.engine.remote_kv import RemoteKV
from baton.session_hints import hint_from_proto
from baton.transfer import KVReceiver
from baton.worker.async_engine import AsyncEngine
from baton.worker.process import Rejected
from baton.worker.validate import check_request
from baton.worker.wire import sampling_params_from_proto
from decode_service.config import DecodeConfig
from decode_service.context import BackgroundTasks, DecodeContext
from decode_service.job import Job
from decode_service.metrics import DecodeMetrics
from decode_service.pd_choice import PDChooser
from decode_service.peers import PrefillPeer, PrefillPeers
from decode_service.stream import ResponseBuilder, merge_outputs
from protos import decode_pb2

log = logging.getLogger(__name__)


class DecodeWorker:
    def __init__(self, config: DecodeConfig, engine: AsyncEngine, remote_kv: RemoteKV,
                 receiver: KVReceiver, peers: PrefillPeers, metrics: DecodeMetrics) -> None:
        self.config, self.ae, self.remote_kv, self.peers = config, engine, remote_kv, peers
        self.metrics = metrics
        self.tasks = BackgroundTasks()
        share = engine.cpu_share  # cores shared with the prefill worker (baton up --pin share)
        pd = PDChooser(peers, metrics, config.local_prefill_itl_budget_ms / 1e3,
                       config.abort_timeout_seconds, config.local_prefill_idle_budget_ms / 1e3,
                       remote_stall_fraction=share.shared_fraction() if share else 0.0)
        self.ctx = DecodeContext(config, receiver, peers, metrics, self.tasks.spawn, pd)
        self.jobs: dict[str, Job] = {}
        self.accepting = True

    # ---- Generate ------------------------------------------------------------------------
    async def generate(self, req: decode_pb2.GenerateRequest
                       ) -> AsyncIterator[decode_pb2.GenerateResponse]:
        """Stream one request (see the module docstring). Raises ValueError / Rejected
        before the first message only."""
        job = self._job(req)
        self.jobs[job.request_id] = job
        try:
            await self._admit(job, *await self._route(req))
            builder = ResponseBuilder(job, self.metrics)
            async for index, out in merge_outputs(job.sequences):
                for resp in builder.add(index, out):
                    yield resp
            for resp in builder.finish():
                yield resp
        except BaseException:
            # The call ended early (the client left, a deadline, an error): stop every
            # choice admitted so far. merge_outputs aborts only once it runs, so a call
            # cancelled while choice k of n was being admitted left choices 0..k-1
            # generating to max_tokens, unreachable by Abort once the job is gone.
            job.abort()
            self.ctx.spawn(self._stop(job), job.request_id)
            raise
        finally:
            del self.jobs[job.request_id]

    async def _stop(self, job: Job) -> None:
        """Stop every sequence of an aborted job (each frees its blocks once no transfer can
        write into them)."""
        timeout = self.config.abort_timeout_seconds + 1.0
        await asyncio.gather(*(seq.stop(timeout) for seq in list(job.sequences)))

    async def _admit(self, job: Job, peer: PrefillPeer | None,
                     min_remote: int | None) -> None:
        first = job.new_sequence(self.ae, self.remote_kv, self.ctx)
        await first.admit(peer, min_remote)
        for _ in range(1, job.n):
            seq = job.new_sequence(self.ae, self.remote_kv, self.ctx)
            if first.error is not None:  # `fail` policy: the request failed as a whole
                seq.end_unadmitted("error", first.error)
            else:
                await seq.admit(None, min_remote)

    def _job(self, req: decode_pb2.GenerateRequest) -> Job:
        cfg, rid = self.config, req.request_id
        check_request(rid, len(req.prompt_token_ids), cfg.max_prompt_tokens, self.accepting,
                      "decode worker")
        if rid in self.jobs:
            raise Rejected(grpc.StatusCode.ALREADY_EXISTS, f"request {rid!r} is in flight")
        params = sampling_params_from_proto(req.sampling_params)
        if params.n > cfg.max_n:
            raise ValueError(f"n={params.n} is over this worker's limit of {cfg.max_n}")
        return Job(rid, list(req.prompt_token_ids), params, session=hint_from_proto(req))

    async def _route(self, req: decode_pb2.GenerateRequest
                     ) -> tuple[PrefillPeer | None, int | None]:
        """(prefill peer or None for local, min_remote_tokens) for the request's mode;
        min_remote_tokens None: the cost-based decider chooses (AUTO without the flag)."""
        mode = req.prefill_mode or decode_pb2.PREFILL_MODE_AUTO
        address = req.prefill_address if req.HasField("prefill_address") \
            else self.config.prefill_address
        if mode == decode_pb2.PREFILL_MODE_LOCAL:
            return None, 0
        if not address:
            if mode == decode_pb2.PREFILL_MODE_REMOTE:
                raise ValueError("prefill_mode REMOTE needs a prefill_address (this worker "
                                 "has no --prefill-address)")
            return None, 0
        min_remote = 1 if mode == decode_pb2.PREFILL_MODE_REMOTE \
            else self.config.min_remote_tokens
        try:
            return await self.peers.get(address), min_remote
        except Rejected as e:
            if e.code != grpc.StatusCode.UNAVAILABLE or not self.config.recompute:
                raise
            log.warning("prefilling locally: %s", e.details,
                        extra={"request_id": req.request_id})
            self.metrics.remote_prefills.labels("unreachable").inc()
            return None, 0

    async def end_session(self, session_id: str) -> int:
        """End a session's retention in this worker's pool (free blocks moved first to
        evict); returns how many."""
        return await self.ae.call(lambda e: e.end_session(session_id))

    # ---- Abort, drain --------------------------------------------------------------------
    async def abort(self, request_id: str) -> bool:
        """Stop a request in any state; returns once its blocks are free (or held), or once
        a remote phase took longer than the abort timeout to confirm its transfer stopped."""
        job = self.jobs.get(request_id)
        if job is None:
            return False
        job.abort()
        await self._stop(job)
        return True

    async def drain(self, timeout_s: float) -> None:
        """Refuse new requests, give running ones `timeout_s`, then abort the rest."""
        self.accepting = False
        limit = time.monotonic() + timeout_s
        while self.jobs and time.monotonic() < limit:
            await asyncio.sleep(0.05)
        await asyncio.gather(*(self.abort(rid) for rid in list(self.jobs)))
        self.tasks.cancel_all()
