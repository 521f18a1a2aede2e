"""One sequence (one of a request's n completions) on the decode worker, through every state.

                admit()        add: local prefill (no peer, short uncached suffix, no room)
       NEW ───────────▶ ADMITTING ──────────────────────────────────────────────▶ LOCAL
        │                  │    │ add: a plan (blocks allocated)                    ▲  │
        │                  │    ▼                                                   │  │ first
        │                  │  REMOTE_KV ─── failed, `recompute`: prefill here ──────┘  │ token
        │                  │    │    │                                                 ▼
        │                  │    │    └─── OK: the KV is all here, first token ─────▶ RUNNING
        │                  │    │                                                      │
        │ end_unadmitted() │ add raised  failed (`fail`), aborted, rejected            │ last output,
        ▼                  ▼ / cancelled ▼                                             ▼ abort, left
        └────────────────▶ FINISHED ◀───┴─────────────────────────────────────────────┘
                                        (LOCAL → FINISHED too: ended before its first token)

A sequence asking for prompt logprobs is always prefilled here: they need every prompt
position's logits, which a transfer of KV does not carry.

`settled` is set on entering LOCAL, RUNNING or FINISHED: from then on no transfer can write
into a block this sequence uses, so the engine alone decides about them (an abort frees
them at once). Only the remote task leaves REMOTE_KV, and only once RemotePrefill has said
whether a write may still land: nothing here frees a block a transfer may use.

A quarantine is not a sequence state: it belongs to blocks. When a late write may land
(NIXL, prefill worker silent), RemoteKV.fail(writes_may_land=True) moves the destination
blocks into a *hold* (referenced, in no block table) and the sequence goes on (LOCAL: it is
recomputed into fresh blocks under the same seq_id and the same output stream) or ends
(FINISHED); a background task (quarantine.py) releases the hold once a re-sent Abort is
answered, at the latest after the prefill deadline + grace.

Cancellation: the remote phase runs in a task of its own, so a client that goes away while
KV is on its way only sets the abort event; the task still confirms that no transfer can
write into the blocks before they are freed.
"""
from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import AsyncIterator

from baton.engine.remote_kv import RemoteKV, RemotePrefillPlan
from baton.engine.request import Request
from baton.outputs import StepOutput
from baton.sampling_params import SamplingParams
from baton.session_hints import SessionHint
from baton.worker.async_engine import AsyncEngine
from baton.worker.wire import logprob_from_proto, sampling_params_to_proto
from decode_service.context import DecodeContext
from decode_service.peers import PrefillPeer
from decode_service.quarantine import Quarantine
from decode_service.remote_prefill import RemoteOutcome, RemotePrefill, RemoteResult
from decode_service.usage import PromptUsage, prompt_usage
from protos import prefill_pb2

log = logging.getLogger(__name__)


class SeqState(enum.Enum):
    NEW = enum.auto()        # created, not yet offered to the engine
    ADMITTING = enum.auto()  # the add is on its way to the engine
    LOCAL = enum.auto()      # in the engine, its prompt (being) prefilled here
    REMOTE_KV = enum.auto()  # blocks allocated, a prefill worker writes into them
    RUNNING = enum.auto()    # in the engine, decoding (the engine may preempt it: its affair)
    FINISHED = enum.auto()   # ended in the engine (or never reached it); nothing left to free


S = SeqState
_NEXT: dict[SeqState, frozenset[SeqState]] = {
    S.NEW: frozenset({S.ADMITTING, S.FINISHED}),
    S.ADMITTING: frozenset({S.LOCAL, S.REMOTE_KV, S.FINISHED}),
    S.REMOTE_KV: frozenset({S.RUNNING, S.LOCAL, S.FINISHED}),
    S.LOCAL: frozenset({S.RUNNING, S.FINISHED}),
    S.RUNNING: frozenset({S.FINISHED}),
    S.FINISHED: frozenset(),
}
_SETTLED = frozenset({S.LOCAL, S.RUNNING, S.FINISHED})
_IN_ENGINE = frozenset({S.LOCAL, S.RUNNING})


class IllegalTransition(RuntimeError):
    pass


class DecodeSequence:
    """seq_id: the sequence's id in the engine (the request id when n = 1, else
    "request_id/index"); params: its own (n = 1, its own seed); aborted: its request's event.
    """

    def __init__(self, index: int, seq_id: str, prompt: list[int], params: SamplingParams,
                 aborted: asyncio.Event, engine: AsyncEngine, remote_kv: RemoteKV,
                 ctx: DecodeContext, session: SessionHint | None = None) -> None:
        self.index, self.seq_id, self.prompt, self.params = index, seq_id, prompt, params
        self.session = session  # its request's session hint (engine eviction order)
        self.aborted, self.engine, self.remote_kv, self.ctx = aborted, engine, remote_kv, ctx
        self.state = SeqState.NEW
        self.settled = asyncio.Event()
        self.q: asyncio.Queue[StepOutput] | None = None
        self.engine_request: Request | None = None  # the engine's, for timings (read only)
        self.remote: RemoteResult | None = None
        self.error: str | None = None  # set when it ended with an error before any token

    def _to(self, state: SeqState) -> None:
        """The one place the state changes."""
        if state not in _NEXT[self.state]:
            raise IllegalTransition(f"sequence {self.seq_id!r}: {self.state.name} → "
                                    f"{state.name}")
        self.state = state
        if state in _SETTLED:
            self.settled.set()

    # ---- admission -----------------------------------------------------------------------
    async def admit(self, peer: PrefillPeer | None, min_remote_tokens: int | None) -> None:
        """Queue the sequence, prefilled here or by `peer` (as the P/D decider says, or the
        fixed `min_remote_tokens` threshold when given); returns once it is in the engine or
        finished. ValueError: a bad request (or the prefill worker rejected it)."""
        try:
            self.q = self.engine.open_stream(self.seq_id)  # ValueError: its id is in use
        except ValueError:
            self._to(S.FINISHED)
            raise
        self._to(S.ADMITTING)
        try:
            plan = await self._add(peer, min_remote_tokens)
        except BaseException as exc:
            self.engine.close_stream(self.seq_id)
            if isinstance(exc, asyncio.CancelledError):  # the add may still land: undo it
                self.ctx.spawn(self.engine.abort(self.seq_id), self.seq_id)
            self._to(S.FINISHED)
            raise
        if plan is None:
            self._to(S.LOCAL)
            if peer is not None:
                self.ctx.metrics.remote_prefills.labels("local").inc()
        else:
            self._to(S.REMOTE_KV)
            task = self.ctx.spawn(self._remote_phase(peer, plan), self.seq_id)
            try:
                await asyncio.shield(task)
            except asyncio.CancelledError:
                self.aborted.set()  # the client left: the task cleans up on its own
                raise
        if self.aborted.is_set():
            await self._abort_in_engine()

    async def _add(self, peer: PrefillPeer | None,
                   min_remote_tokens: int | None) -> RemotePrefillPlan | None:
        rid, prompt, params, rkv = self.seq_id, self.prompt, self.params, self.remote_kv
        if peer is None or params.prompt_logprobs is not None:  # those: every position here
            self.engine_request = await self.engine.call(
                lambda e: e.add_request(rid, prompt, params, self.session))
            return None
        pd = self.ctx.pd.request(peer, min_remote_tokens)
        plan, self.engine_request, decision = await self.engine.call(
            lambda e: rkv.add(rid, prompt, params, pd=pd, session=self.session))
        self.ctx.pd.record(pd, decision, plan is not None, rid)
        if plan is not None:  # counted in the peer's queue until answered (_remote_phase)
            self.ctx.pd.sent(peer.address, rid, len(prompt) - plan.num_cached_tokens)
        return plan

    def end_unadmitted(self, reason: str, error: str | None) -> None:
        """End a sequence that never reached the engine (its request failed first)."""
        self.q = asyncio.Queue()
        self.q.put_nowait(StepOutput(self.seq_id, [], "", [], True, reason, None,
                                     len(self.prompt), 0, 0, error))
        self.error = error
        self._to(S.FINISHED)

    # ---- the remote phase (a task of its own) --------------------------------------------
    async def _remote_phase(self, peer: PrefillPeer, plan: RemotePrefillPlan) -> None:
        ctx = self.ctx
        ctx.metrics.remote_inflight.inc()
        try:
            result = await RemotePrefill(ctx.config, ctx.receiver, ctx.peers, peer, plan,
                                         self.prompt, sampling_params_to_proto(self.params),
                                         self.aborted, self.session).run()
        except Exception as e:  # a bug: assume a transfer may still be writing
            log.exception("remote prefill crashed", extra={"request_id": self.seq_id})
            result = RemoteResult(RemoteOutcome.FAILED_WRITES_MAY_LAND, repr(e),
                                  deadline=time.monotonic() + ctx.config.prefill_max_seconds)
        finally:
            ctx.metrics.remote_inflight.dec()
            ctx.pd.done(peer.address, self.seq_id)
        self.remote = result
        peer = result.peer or peer  # the process it ended on (a restarted one, maybe)
        if result.response is not None and \
                result.response.status == prefill_pb2.PREFILL_STATUS_OK:
            ctx.spawn(ctx.peers.release(peer, self.seq_id), self.seq_id)  # lease ends
        await self._apply(peer, result)

    async def _apply(self, peer: PrefillPeer, result: RemoteResult) -> None:
        """Leave REMOTE_KV as the outcome and the `fail` / `recompute` policy say."""
        label = self.ctx.metrics.remote_prefills.labels
        outcome = result.outcome
        if outcome is RemoteOutcome.OK:
            await self._finish_remote(peer, result)
        elif outcome is RemoteOutcome.REJECTED:  # the request is bad: fail it, don't retry
            label("rejected").inc()
            await self._fail_remote(peer, result, recompute=False)
            self.engine.close_stream(self.seq_id)
            raise ValueError(f"prefill worker rejected the request: {result.error}")
        elif outcome.aborted:
            label("aborted").inc()
            await self._fail_remote(peer, result, recompute=False)
        elif self.ctx.config.recompute:
            label("recompute").inc()
            await self._fail_remote(peer, result, recompute=True)
        else:
            label("failed").inc()
            await self._fail_remote(peer, result, recompute=False)

    async def _finish_remote(self, peer: PrefillPeer, result: RemoteResult) -> None:
        rid, rkv, resp = self.seq_id, self.remote_kv, result.response
        lp = logprob_from_proto(resp.first_token_logprobs) \
            if resp.HasField("first_token_logprobs") else None
        await self.engine.call(lambda e: rkv.finish(rid, resp.first_token_id, lp),
                               deliver=True)
        self._to(S.RUNNING)
        self.ctx.pd.observe_remote(peer, resp, result.arrival_seconds)
        m = self.ctx.metrics
        m.remote_prefills.labels("ok").inc()
        m.received_blocks.inc(resp.num_transferred_blocks)
        m.received_bytes.inc(resp.transferred_bytes)
        m.transfer_seconds.observe(resp.transfer_seconds + result.arrival_seconds)

    async def _fail_remote(self, peer: PrefillPeer, result: RemoteResult, *,
                           recompute: bool) -> None:
        """Recompute here (→ LOCAL) or end with an error or abort (→ FINISHED); blocks a
        late write may reach go into a hold first."""
        rid, rkv, outcome = self.seq_id, self.remote_kv, result.outcome
        failure = await self.engine.call(lambda e: rkv.fail(
            rid, recompute=recompute, writes_may_land=outcome.writes_may_land,
            aborted=outcome.aborted, error=result.error))
        if failure.hold_id is not None:
            self._quarantine(peer, failure.hold_id, result.deadline)
        if failure.output is None:
            self._to(S.LOCAL)
            return
        if not outcome.aborted:
            self.error = result.error
        self.q.put_nowait(failure.output)  # it ended: no later output can overtake this one
        self._to(S.FINISHED)

    def _quarantine(self, peer: PrefillPeer, hold_id: int, deadline: float) -> None:
        """Hold the blocks until the prefill worker confirms that nothing writes into them,
        at the latest until `deadline` (its Prefill timeout) + a grace for writes under way."""
        q = Quarantine(hold_id, self.seq_id, peer,
                       deadline + self.ctx.config.quarantine_grace_seconds)
        log.warning("quarantining blocks until the prefill worker confirms its transfer "
                    "stopped", extra={"request_id": self.seq_id, "peer": q.peer.address,
                                      "seconds": round(q.until - time.monotonic(), 3)})
        self.ctx.metrics.quarantines.inc()
        self.ctx.spawn(q.run(self.engine, self.remote_kv, self.ctx), self.seq_id)

    # ---- streaming and stopping ----------------------------------------------------------
    async def outputs(self) -> AsyncIterator[StepOutput]:
        """The sequence's outputs until it finishes; leaving early aborts it."""
        try:
            async with contextlib.aclosing(self.engine.stream(self.seq_id, self.q)) as stream:
                async for out in stream:
                    if out.finished and self.state is not S.FINISHED:
                        self._to(S.FINISHED)
                    elif out.new_token_ids and self.state is S.LOCAL:
                        self._to(S.RUNNING)
                        self.ctx.pd.observe_local(self.engine_request)
                    yield out
        finally:
            self.engine.close_stream(self.seq_id)
            if self.state in _IN_ENGINE:  # left early: stream() aborted it
                self._to(S.FINISHED)

    async def stop(self, timeout_s: float) -> None:
        """After the abort event is set: wait (at most `timeout_s`) until no transfer can
        write into its blocks, then abort it in the engine (its blocks are freed)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.settled.wait(), timeout_s)
        await self._abort_in_engine()

    async def _abort_in_engine(self) -> None:
        """Abort it if the engine has it (blocks freed; the ABORT output goes to its stream)."""
        if self.state in _IN_ENGINE and await self.engine.abort(self.seq_id) and \
                self.state in _IN_ENGINE:
            self._to(S.FINISHED)

    @property
    def decode_cached_tokens(self) -> int:
        """Prompt tokens found in this worker's own prefix cache."""
        req = self.engine_request
        return max(0, req.num_cached_tokens) if req is not None else 0

    @property
    def usage(self) -> PromptUsage:
        """Prompt tokens nobody computed for this sequence (the prefill worker's prefix hit
        when it prefilled remotely, else this worker's own hit), by source, and those
        computed although this worker held them (decode_service/usage.py)."""
        req = self.engine_request
        spans = req.cached_spans if req is not None else ()
        remote = self.remote.response if self.remote is not None and self.remote.ok else None
        return prompt_usage(spans, remote)

