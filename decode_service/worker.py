"""A Generate request's life on the decode worker (the n completions, the stream, aborts).

    Generate ─▶ DecodeWorker.generate(request)
      1. check it (ValueError → INVALID_ARGUMENT, Rejected → its code), register the Job
      2. choose where to prefill: LOCAL mode or no prefill worker → here; otherwise handshake
         with the prefill worker (cached per address; a layout mismatch is FAILED_PRECONDITION
         naming the field; unreachable → prefill here, or UNAVAILABLE under `fail`)
      3. completion 0: admit (local, or remote when the uncached suffix is long: see
         completion.py); completions 1..n-1 are then admitted locally and hit the prompt
         blocks completion 0 just put in the prefix cache
      4. stream: TokenChunk per new tokens (any completion), then one Finished per completion
         once all are done (usage and timings are the request's)
    Abort(request_id) or the client cancelling the call: every completion stops wherever it
    is (waiting, waiting for remote KV, running); blocks are freed once no transfer can write.

Usage: prompt_tokens = len(prompt); completion_tokens = sum over completions;
cached_tokens = prompt tokens nobody computed for completion 0: the prefill worker's own
prefix hit when it prefilled remotely (it computes whatever it lacks, even blocks this worker
holds; those are simply not transferred), else this worker's prefix hit.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field

import grpc

from baton.engine.remote_kv import RemoteKV
from baton.worker.async_engine import AsyncEngine
from baton.outputs import StepOutput
from baton.worker.process import Rejected
from baton.worker.validate import check_request
from baton.transfer import KVReceiver
from baton.worker.wire import sampling_params_from_proto
from decode_service.completion import Completion
from decode_service.config import DecodeConfig
from decode_service.metrics import DecodeMetrics
from decode_service.peers import PrefillPeer, PrefillPeers
from decode_service.stream import ResponseBuilder
from protos import decode_pb2

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Job:
    request_id: str
    prompt: list[int]
    params: object  # baton.sampling_params.SamplingParams
    arrival: float = field(default_factory=time.monotonic)
    aborted: asyncio.Event = field(default_factory=asyncio.Event)
    completions: list[Completion] = field(default_factory=list)

    @property
    def n(self) -> int:
        return self.params.n

    def abort(self) -> None:
        self.aborted.set()


class DecodeWorker:
    def __init__(self, config: DecodeConfig, engine: AsyncEngine, remote_kv: RemoteKV,
                 receiver: KVReceiver, peers: PrefillPeers, metrics: DecodeMetrics) -> None:
        self.config, self.ae, self.receiver, self.peers = config, engine, receiver, peers
        self.remote_kv = remote_kv
        self.metrics = metrics
        self.jobs: dict[str, Job] = {}
        self.accepting = True
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro: Coroutine) -> asyncio.Task:
        """A background task kept alive until done; its exception is logged, not lost."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.debug("background task ended: %r", task.exception())

    # ---- Generate ------------------------------------------------------------------------
    async def generate(self, req: decode_pb2.GenerateRequest
                       ) -> AsyncIterator[decode_pb2.GenerateResponse]:
        """Stream one request (see the module docstring). Raises ValueError / Rejected
        before the first message only."""
        job = self._job(req)
        self.jobs[job.request_id] = job
        try:
            peer, min_remote = await self._route(req)
            first = Completion(self, job, 0)
            job.completions.append(first)
            await first.admit(peer, min_remote)
            for i in range(1, job.n):
                c = Completion(self, job, i)
                job.completions.append(c)
                if first.error is not None:  # `fail` policy: the request failed as a whole
                    c.fail_now("error", first.error)
                else:
                    await c.admit(None, min_remote)
            builder = ResponseBuilder(job, self.metrics)
            async for index, out in self._merge(job.completions):
                for resp in builder.add(index, out):
                    yield resp
            for resp in builder.finish():
                yield resp
        finally:
            del self.jobs[job.request_id]

    def _job(self, req: decode_pb2.GenerateRequest) -> Job:
        cfg, rid = self.config, req.request_id
        check_request(rid, len(req.prompt_token_ids), cfg.max_prompt_tokens, self.accepting,
                      "decode worker")
        if rid in self.jobs:
            raise Rejected(grpc.StatusCode.ALREADY_EXISTS, f"request {rid!r} is in flight")
        params = sampling_params_from_proto(req.sampling_params)
        if params.n > cfg.max_n:
            raise ValueError(f"n={params.n} is over this worker's limit of {cfg.max_n}")
        return Job(rid, list(req.prompt_token_ids), params)

    async def _route(self, req: decode_pb2.GenerateRequest) -> tuple[PrefillPeer | None, int]:
        """(prefill peer or None for local, min_remote_tokens) for the request's mode."""
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

    async def _merge(self, completions: list[Completion]
                     ) -> AsyncIterator[tuple[int, StepOutput]]:
        """Interleave the completions' outputs as they come; leaving early aborts them."""
        if len(completions) == 1:
            async for out in completions[0].outputs():
                yield 0, out
            return
        shared: asyncio.Queue = asyncio.Queue()

        async def pump(c: Completion) -> None:
            try:
                async for out in c.outputs():
                    shared.put_nowait((c.index, out))
            finally:
                shared.put_nowait((c.index, None))

        tasks = [asyncio.create_task(pump(c)) for c in completions]
        try:
            for _ in range(len(tasks)):
                while (item := await shared.get())[1] is not None:
                    yield item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    # ---- Abort, drain --------------------------------------------------------------------
    async def abort(self, request_id: str) -> bool:
        """Stop a request in any state; returns once its blocks are free (or quarantined)."""
        job = self.jobs.get(request_id)
        if job is None:
            return False
        job.abort()
        for c in list(job.completions):
            if c.in_engine:
                await self.ae.abort(c.engine_id)
        limit = time.monotonic() + self.config.abort_timeout_seconds + 1.0
        while any(not c.in_engine for c in job.completions) and time.monotonic() < limit:
            await asyncio.sleep(0.005)  # a remote phase is confirming its transfer stopped
        return True

    async def drain(self, timeout_s: float) -> None:
        """Refuse new requests, give running ones `timeout_s`, then abort the rest."""
        self.accepting = False
        limit = time.monotonic() + timeout_s
        while self.jobs and time.monotonic() < limit:
            await asyncio.sleep(0.05)
        await asyncio.gather(*(self.abort(rid) for rid in list(self.jobs)))
        for t in list(self._tasks):
            t.cancel()
