"""Continuous batching with chunked prefill and preemption by recompute.

There is no prefill phase or decode phase: every step each request asks for the tokens it
still lacks KV for (`num_tokens - num_computed_tokens`: 1 for a decode, a chunk for a prompt),
under a per-step token budget. Design after vLLM v1's scheduler and nano-vllm's.

Every status change of a request happens here (`RequestStatus` in request.py):

    add ─▶ WAITING ──admit──▶ RUNNING ──finish──▶ FINISHED_*
    wait_for_remote_kv ─▶ WAITING_FOR_REMOTE_KV ──remote_kv_ready──▶ RUNNING
    RUNNING ──_preempt──▶ PREEMPTED (front of the waiting queue) ──admit──▶ RUNNING

A request waiting for remote KV holds its blocks but is never scheduled nor preempted (the
prefill worker may be writing into them); vLLM's scheduler likewise moves
WAITING_FOR_REMOTE_KVS back itself once its connector reports the KV received.

Admission order (`SchedulerConfig.policy`): "fcfs" takes the waiting queue as it stands
(preempted first); "shortest_first" sorts it first (`shortest_first`), so a continuing turn
is not queued behind a cold 20 s prompt (schedule_policy.py). The admission rules then run unchanged over that
order: whole-prompt fit, passing for at most max_bypass_s, in-flight prefix deferral, chunk cap.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence

from baton.config import SchedulerConfig
from baton.engine.kv_cache import Block, KVCacheManager
from baton.engine.kv_source import take
from baton.engine.sched_output import ScheduledRequest, SchedulerOutput
from baton.engine.request import Request, RequestStatus
from baton.engine.prefill_target import StepPrefill
from baton.engine.schedule_policy import WaitingOrder
from baton.engine.stats import Totals
from baton.engine.time_slice import slice_victims


class AdmissionError(Exception):
    """Admitting `request` raised (a fault only it hit); the waiting queue is left intact
    without it, so the engine can end it alone."""

    def __init__(self, request: Request, cause: Exception) -> None:
        super().__init__(repr(cause))
        self.request = request


class Scheduler:
    """Owns the waiting queue and the running list; asks the KVCacheManager for blocks."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.remote_waits: dict[str, Request] = {}  # WAITING_FOR_REMOTE_KV, blocks held
        self._pending: set[int] | None = None  # block hashes this step computes (lazy)
        self._order = WaitingOrder(config, kv)  # the policy's order, hit estimates kept
        self.totals = Totals()  # preemptions and prefix-cache queries counted here

    def add(self, request: Request) -> None:
        """Queue a request for (local) prefill: WAITING."""
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def wait_for_remote_kv(self, request: Request, num_cached_tokens: int) -> None:
        """The request's blocks are allocated and another worker fills them from
        `num_cached_tokens` on: WAITING_FOR_REMOTE_KV until `remote_kv_ready`."""
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        request.num_computed_tokens = request.num_cached_tokens = num_cached_tokens
        request.cached_spans = self.kv.cached_spans(request.request_id)
        self._count_prefix_query(request, num_cached_tokens)
        self.remote_waits[request.request_id] = request

    def remote_kv_ready(self, request: Request, num_computed_tokens: int) -> None:
        """End a remote-KV wait: RUNNING with `num_computed_tokens` of KV in its blocks (the
        whole prompt when it arrived; the decode side's own prefix to recompute the rest).
        Raises KeyError if the request is not waiting for remote KV."""
        if self.remote_waits.pop(request.request_id, None) is not request:
            raise KeyError(f"request {request.request_id!r} is not waiting for remote KV")
        request.num_computed_tokens = num_computed_tokens
        request.status = RequestStatus.RUNNING
        request.scheduled_time = request.scheduled_time or time.monotonic()
        request.admitted_time = time.monotonic()
        self.running.append(request)

    def has_unfinished(self) -> bool:
        """True while there is work to step (waiting or running; not remote-KV waits)."""
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's work.

        Invariant: each scheduled request's block table covers
        num_computed_tokens + num_new_tokens tokens; the new tokens sum to at most
        max_num_batched_tokens; at most max_num_seqs requests run. Running requests go
        first (in admission order); if blocks run out the most recently admitted running
        request is preempted (its blocks freed, its tokens recomputed later). Waiting requests
        are admitted only in steps without preemption, in policy order (`WaitingOrder`),
        and only when their whole prompt fits beside what the running ones still need
        (`_fits_whole_prompt`). With prefill_target_tokens, prefill rows stop at the target
        and a running partial prefill may sit the step out for a shorter waiting request
        or for a row that completes its prefill (`StepPrefill`); paused ones resume when the
        step's prefill stays under the target.
        """
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        self._pending = None
        now = time.monotonic()
        step = StepPrefill(self.config, now, self._order.sort(
            self.waiting, now, head_key=bool(self.config.prefill_target_tokens and self.running)),
            self.running)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            i += 1
            if step.pause(req):
                continue  # before i: never a preemption victim below
            n = step.cap(req, req.num_computed_tokens,
                         self._num_new_tokens(req, req.num_computed_tokens, budget))
            if step.defers(req, req.num_computed_tokens, n):
                step.paused.append(req)
                continue
            if not self._allocate_or_preempt(req, n, preempted):
                break  # req itself was preempted; it was the last running request
            step.add(req, req.num_computed_tokens, n)
            scheduled.append(self._scheduled(req, n))
            budget -= n
        if not preempted:
            budget = self._admit_waiting(budget, scheduled, step)
        for req in step.paused:  # resumed while under the target; nothing preempted for them
            n = step.cap(req, req.num_computed_tokens,
                         self._num_new_tokens(req, req.num_computed_tokens, budget))
            if step.may_resume(req) and n > 0 and not step.defers(
                    req, req.num_computed_tokens, n) and self.kv.allocate_slots(
                    req.request_id, req.num_computed_tokens + n) is not None:
                step.add(req, req.num_computed_tokens, n)
                scheduled.append(self._scheduled(req, n))
                budget -= n
        return SchedulerOutput(scheduled, preempted)

    def _allocate_or_preempt(self, req: Request, n: int, preempted: list[Request]) -> bool:
        """Grow req's blocks for n new tokens, preempting from the back until it fits."""
        while self.kv.allocate_slots(req.request_id, req.num_computed_tokens + n) is None:
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim)
            if victim is req:
                return False
        return True

    def _pending_hashes(self, scheduled: list[ScheduledRequest]) -> set[int]:
        """Hashes of the full blocks this step's prefill rows compute (not yet cached)."""
        if self._pending is None:
            self._pending = set()
            for s in scheduled:
                if s.num_new_tokens > 1:
                    self._pending.update(self._completed_hashes(
                        s.request, s.request.num_computed_tokens, s.num_new_tokens))
        return self._pending

    def _completed_hashes(self, req: Request, start: int, n: int) -> list[int]:
        """Hashes of req's full blocks that computing tokens [start, start + n) completes."""
        bs = self.kv.block_size
        return self.kv.block_hashes(req.request_id, req.all_token_ids)[start // bs:(start + n) // bs]

    def _defer_for_inflight_prefix(self, req: Request, num_computed: int,
                                   scheduled: list[ScheduledRequest]) -> bool:
        """True when the block right after req's cache hit is being computed this step by
        another request (requests of one agent's fan-out arriving together): req waits one
        step and takes it as a cache hit, instead of computing the same prefix again."""
        if not self.kv.enable_prefix_caching:
            return False
        hashes = self.kv.block_hashes(req.request_id, req.all_token_ids)
        nxt = num_computed // self.kv.block_size
        return nxt < len(hashes) and hashes[nxt] in self._pending_hashes(scheduled)

    def _admit_waiting(self, budget: int, scheduled: list[ScheduledRequest],
                       step: StepPrefill) -> int:
        """Admit waiting requests in order; one that cannot get blocks now is skipped (kept in
        place) so smaller requests behind it still run, for at most `max_bypass_s`: once a
        skipped request has waited that long for blocks, admission stops behind it. One
        whose next uncached block another request computes this step waits for it
        (`_defer_for_inflight_prefix`). Admission stops once the step's prefill rows reach
        the target (`StepPrefill.verdict`; the queue is already in policy order), or at a
        prompt that would not complete beside one that does (`StepPrefill.defers`)."""
        if not self.waiting:
            return budget  # the usual decode step: nothing to admit, no reserve to sum
        skipped: list[Request] = []
        sliced: list[Request] = []  # preempted for a waiting request (time_slice.py)
        now = step.now
        reserved = sum(self._blocks_to_finish(r) for r in self.running)
        try:
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                verdict = step.verdict(self.waiting[0])
                if verdict == StepPrefill.STOP:
                    break
                req = self.waiting.popleft()
                if verdict == StepPrefill.SKIP:
                    skipped.append(req)
                    continue
                try:
                    hits, num_computed = self.kv.get_computed_blocks(
                        req.request_id, req.all_token_ids, reserved)
                    if self._defer_for_inflight_prefix(req, num_computed, scheduled):
                        skipped.append(req)
                        continue
                    n = step.cap(req, num_computed, self._num_new_tokens(req, num_computed, budget))
                    if step.defers(req, num_computed, n):
                        skipped.append(req)  # keeps its place; behind it, longer ones
                        break
                    blocks = None
                    if self._fits_whole_prompt(req, hits, reserved):
                        blocks = self.kv.allocate_slots(req.request_id, num_computed + n, hits)
                    if blocks is not None and self.kv.enable_prefix_caching:
                        self._pending_hashes(scheduled).update(
                            self._completed_hashes(req, num_computed, n))
                except Exception as e:  # noqa: BLE001 - the engine ends this request alone
                    raise AdmissionError(req, e) from e
                if blocks is None and self._slice(req, now, scheduled, reserved, sliced):
                    budget = self.config.max_num_batched_tokens - sum(
                        s.num_new_tokens for s in scheduled)
                    self.waiting.appendleft(req)  # looked up again, with the room made
                    continue
                if blocks is None:
                    skipped.append(req)
                    if req.blocked_since is None:
                        req.blocked_since = now
                    if now - req.blocked_since >= self.config.max_bypass_s:
                        break  # passed by long enough: nothing behind it goes first
                    continue
                req.blocked_since = None
                step.add(req, num_computed, n)
                self._start_running(req, num_computed, n, scheduled)
                budget -= n
                reserved += self._blocks_to_finish(req)
        finally:
            self.waiting.extendleft(reversed(skipped))
            self.waiting.extendleft(reversed(sliced))
        return budget

    def _slice(self, req: Request, now: float, scheduled: list[ScheduledRequest],
               reserved: int, sliced: list[Request]) -> bool:
        """With a KV tier, preempt running decodes for `req`, which found no blocks; their
        rows leave this step, they rejoin the queue after it (time_slice.py). True when any
        was preempted; at most one slice a step."""
        if self.kv.tier is None or sliced:
            return False
        for v in slice_victims(req, self.running, now, self.config.time_slice_s, self.kv,
                               reserved):
            self.running.remove(v)
            scheduled[:] = [row for row in scheduled if row.request is not v]
            self._preempt(v)
            self.waiting.remove(v)
            sliced.append(v)
            self.totals.num_time_slices += 1
        return bool(sliced)

    def _start_running(self, req: Request, num_computed: int, n: int,
                       scheduled: list[ScheduledRequest]) -> None:
        """Admitted: RUNNING with num_computed tokens of KV (its cache hit), n new this step."""
        req.num_computed_tokens = num_computed
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_computed
            req.cached_spans = self.kv.cached_spans(req.request_id)
            self._count_prefix_query(req, num_computed)
        elif num_computed < req.num_cached_tokens:  # back from preemption, a shorter hit:
            req.num_cached_tokens = num_computed    # only tokens never computed count
            req.cached_spans = take(req.cached_spans, num_computed)
        if req.scheduled_time is None:
            req.scheduled_time = time.monotonic()
        req.admitted_time = time.monotonic()
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        scheduled.append(self._scheduled(req, n))

    def _blocks_to_finish(self, req: Request) -> int:
        """Blocks a running request still lacks for the tokens it has (its prompt's rest)."""
        return max(0, self.kv.blocks_needed(req.num_tokens)
                   - self.kv.num_request_blocks(req.request_id))

    def _fits_whole_prompt(self, req: Request, hits: Sequence[Block], reserved: int) -> bool:
        """True when the pool can hold all of req's tokens (not just this step's chunk) beside
        the `reserved` blocks the running requests still need to finish their prompts.

        Admitting by chunk alone lets two long prompts that fit only one at a time both start;
        when the first grows into the free blocks the second is preempted, its freshly computed
        blocks are evicted first (freed tail first) and it recomputes them: on an agent worker
        with two long contexts this repeats for as long as both live. Counted in blocks: free
        ones (evictable cached included) minus req's own hits that are free (taking them
        removes them from the free queue); blocks loaded from a KV tier are such hits, and
        are loaded only when this holds. Decode growth is not reserved (a block per
        `block_size` tokens; preemption still covers it). vLLM v0's admission likewise checks
        the whole prompt (`BlockSpaceManager.can_allocate`) rather than a chunk.
        """
        return self.kv.fits(req.num_tokens, hits, reserved)

    def _num_new_tokens(self, req: Request, num_computed: int, budget: int) -> int:
        n = req.num_tokens - num_computed
        cap = self.config.long_prefill_token_threshold
        if cap:
            n = min(n, cap)
        return min(n, budget)

    def _scheduled(self, req: Request, n: int) -> ScheduledRequest:
        return ScheduledRequest(req, n, self.kv.block_table(req.request_id))

    def _preempt(self, req: Request) -> None:
        self.kv.free(req.request_id, final=False)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.totals.num_preemptions += 1
        self.waiting.appendleft(req)

    def _count_prefix_query(self, req: Request, num_hit_tokens: int) -> None:
        if not self.kv.enable_prefix_caching:
            return  # no lookup happened (vLLM records no prefix-cache stats then either)
        self.totals.prefix_cache_queries += req.num_tokens
        self.totals.prefix_cache_hits += num_hit_tokens
        self.totals.count_cached_spans(req.cached_spans)

    def finish(self, req: Request, status: RequestStatus, free: bool = True) -> None:
        """End a request in any state: drop it from the queues and (if `free`) release its
        blocks; free=False keeps them referenced for a KV transfer (prefill role)."""
        assert status.is_finished, status
        req.status = status
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        elif self.remote_waits.get(req.request_id) is req:
            del self.remote_waits[req.request_id]
        if free:
            self.kv.free(req.request_id)

