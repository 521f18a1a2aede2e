"""One completion (one of a request's n sequences) on the decode worker, through every state.

    admit(peer):
      peer None ──────────────▶ add_request (local prefill, chunked into this batch) ─┐
      peer    ──▶ add_remote_request(min_remote_tokens)                               │
                   None (short uncached suffix, or no room) → local ──────────────────┤
                   plan → WAITING_FOR_REMOTE_KV: RemotePrefill.run() in its own task   │
                          ok          → finish_remote_prefill(first token); ReleaseBlocks
                          failed+safe → fail_remote_prefill(recompute | error)         │
                          failed+unsafe (NIXL, prefill silent) → quarantine the blocks │
                                        until the prefill deadline + grace; recompute  │
                                        under a fresh engine id (or finish with error) │
                          aborted     → abort (or quarantine) and finish ABORT         │
    outputs(): the engine's StepOutputs for the sequence until it finishes ◀──────────┘
               (leaving early aborts it: blocks freed at once)

Cancellation: the remote phase runs in a task of its own, so a client that goes away while
KV is on its way only sets the abort event; the task still confirms that no transfer can
write into the blocks before they are freed. Nothing here frees a block a transfer may use.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import TYPE_CHECKING

from baton.engine.remote_kv import RemotePrefillPlan
from baton.outputs import StepOutput
from baton.worker.wire import logprob_from_proto, sampling_params_to_proto, seed_for_index
from decode_service.peers import PrefillPeer
from decode_service.remote_prefill import RemotePrefill, RemoteResult
from protos import prefill_pb2

if TYPE_CHECKING:
    from decode_service.worker import DecodeWorker, Job

log = logging.getLogger(__name__)
_OK = prefill_pb2.PREFILL_STATUS_OK


class Completion:
    def __init__(self, worker: DecodeWorker, job: Job, index: int) -> None:
        self.worker, self.job, self.index = worker, job, index
        self.engine_id = job.request_id if job.n == 1 else f"{job.request_id}/{index}"
        self.params = replace(job.params, n=1, seed=seed_for_index(job.params.seed, index))
        self.q: asyncio.Queue[StepOutput] | None = None
        self.engine_request = None  # baton.engine.request.Request, for timings
        self.in_engine = False  # its blocks belong to the engine alone (abort frees them)
        self.remote: RemoteResult | None = None
        self.error: str | None = None  # set when it ended with an error before any token

    # ---- admission -----------------------------------------------------------------------
    async def admit(self, peer: PrefillPeer | None, min_remote_tokens: int) -> None:
        """Queue the sequence, prefilled here or remotely. ValueError: bad request."""
        ae, rid, prompt = self.worker.ae, self.engine_id, self.job.prompt
        self.q = ae.open_stream(rid)
        try:
            if peer is None:
                self.engine_request = await ae.call(
                    lambda e: e.add_request(rid, prompt, self.params))
                plan = None
            else:
                rkv = self.worker.remote_kv
                plan, self.engine_request = await ae.call(
                    lambda e: rkv.add(rid, prompt, self.params, min_remote_tokens))
        except BaseException as exc:
            ae.close_stream(rid)
            if isinstance(exc, asyncio.CancelledError):  # the add may still land: undo it
                self.worker.spawn(ae.abort(rid))
            raise
        if plan is None:
            self.in_engine = True
            if peer is not None:
                self.worker.metrics.remote_prefills.labels("local").inc()
        else:
            task = self.worker.spawn(self._remote_phase(peer, plan))
            try:
                await asyncio.shield(task)
            except asyncio.CancelledError:
                self.job.abort()  # the client left: the task cleans up on its own
                raise
        if self.job.aborted.is_set():
            await ae.abort(self.engine_id)

    async def _remote_phase(self, peer: PrefillPeer, plan: RemotePrefillPlan) -> None:
        w, rid = self.worker, self.engine_id
        w.metrics.remote_inflight.inc()
        try:
            params = sampling_params_to_proto(self.params)
            result = await RemotePrefill(w.config, w.receiver, w.peers, peer, plan,
                                         self.job.prompt, params, self.job.aborted).run()
        except Exception as e:  # a bug: assume a transfer may still be writing
            log.exception("remote prefill crashed", extra={"request_id": rid})
            result = RemoteResult(False, False, repr(e), deadline=time.monotonic()
                                  + w.config.prefill_max_seconds)
        finally:
            w.metrics.remote_inflight.dec()
        self.remote = result
        if result.response is not None and result.response.status == _OK:
            w.spawn(w.peers.release(peer, rid))  # fire and forget: the prefill lease ends
        if result.ok:
            await self._finish_remote(result)
        elif result.aborted:
            w.metrics.remote_prefills.labels("aborted").inc()
            await self._end(result, "abort")
        elif result.rejected:
            w.metrics.remote_prefills.labels("rejected").inc()
            await w.ae.call(lambda e: w.remote_kv.fail(rid, recompute=False, error=result.error))
            w.ae.close_stream(rid)
            self.in_engine = True
            raise ValueError(f"prefill worker rejected the request: {result.error}")
        elif w.config.recompute:
            w.metrics.remote_prefills.labels("recompute").inc()
            await self._recompute(result)
        else:
            w.metrics.remote_prefills.labels("failed").inc()
            await self._end(result, "error")

    async def _finish_remote(self, result: RemoteResult) -> None:
        w, rid, resp = self.worker, self.engine_id, result.response
        lp = logprob_from_proto(resp.first_token_logprobs) \
            if resp.HasField("first_token_logprobs") else None
        await w.ae.call(lambda e: w.remote_kv.finish(rid, resp.first_token_id, lp),
                        deliver=True)
        self.in_engine = True
        m = w.metrics
        m.remote_prefills.labels("ok").inc()
        m.received_blocks.inc(resp.num_transferred_blocks)
        m.received_bytes.inc(resp.transferred_bytes)
        m.transfer_seconds.observe(resp.transfer_seconds + result.arrival_seconds)

    async def _recompute(self, result: RemoteResult) -> None:
        w, rid = self.worker, self.engine_id
        if result.safe:
            await w.ae.call(lambda e: w.remote_kv.fail(rid, recompute=True, error=result.error))
            self.in_engine = True
            return
        self._quarantine(result)
        self.engine_id = rid = f"{rid}~retry"
        self.q = w.ae.open_stream(rid)
        try:
            self.engine_request = await w.ae.call(
                lambda e: e.add_request(rid, self.job.prompt, self.params))
        except BaseException:
            w.ae.close_stream(rid)
            raise
        self.in_engine = True

    async def _end(self, result: RemoteResult, reason: str) -> None:
        """Finish the sequence without output (abort or error), freeing or quarantining."""
        w, rid = self.worker, self.engine_id
        if result.safe:
            out = await w.ae.call(lambda e: e.abort_request(rid) if reason == "abort"
                                  else w.remote_kv.fail(rid, recompute=False,
                                                        error=result.error).output)
        else:
            self._quarantine(result)
            out = None
        if out is None:  # quarantined: its output comes from here, under a name the engine
            rid = self.engine_id = f"{rid}~ended"  # does not know (so no abort can free it)
            out = StepOutput(rid, [], "", [], True, reason, None, len(self.job.prompt), 0, 0)
        out.error = self.error = result.error if reason == "error" else None
        self.q.put_nowait(out)
        self.in_engine = True  # nothing left to free here (done above or by the quarantine)

    def _quarantine(self, result: RemoteResult) -> None:
        """Keep the blocks referenced until no late write can land, then free them."""
        w, rid = self.worker, self.engine_id
        w.ae.close_stream(rid)
        until = result.deadline + w.config.quarantine_grace_seconds
        log.warning("quarantining blocks until the prefill deadline has passed",
                    extra={"request_id": rid, "seconds": round(until - time.monotonic(), 3)})

        w.metrics.quarantines.inc()

        async def release_later() -> None:
            w.metrics.quarantined.inc()
            try:
                await asyncio.sleep(max(0.0, until - time.monotonic()))
                await w.ae.call(lambda e: e.abort_request(rid))
            finally:
                w.metrics.quarantined.dec()

        w.spawn(release_later())

    # ---- streaming -----------------------------------------------------------------------
    async def outputs(self) -> AsyncIterator[StepOutput]:
        """The sequence's outputs until it finishes; leaving early aborts it."""
        ae = self.worker.ae
        try:
            async with contextlib.aclosing(ae.stream(self.engine_id, self.q)) as stream:
                async for out in stream:
                    yield out
        finally:
            ae.close_stream(self.engine_id)

    @property
    def decode_cached_tokens(self) -> int:
        """Prompt tokens found in this worker's own prefix cache."""
        req = self.engine_request
        return max(0, req.num_cached_tokens) if req is not None else 0

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens nobody computed for this sequence: the prefill worker's prefix hit
        when it prefilled remotely, else this worker's own hit."""
        if self.remote is not None and self.remote.ok:
            return self.remote.response.num_cached_tokens
        return self.decode_cached_tokens

    def fail_now(self, reason: str, error: str | None) -> None:
        """End a sequence that was never admitted (its request failed or was aborted)."""
        self.q, self.in_engine = asyncio.Queue(), True
        self.engine_id = f"{self.engine_id}~ended"
        self.q.put_nowait(StepOutput(self.engine_id, [], "", [], True, reason, None,
                                     len(self.job.prompt), 0, 0, error))
        self.error = error
