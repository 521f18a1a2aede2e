"""Continuous batching with chunked prefill, preemption and speculative decode rows.

There is no prefill phase or decode phase: every step each request asks for the tokens it
still lacks KV for (`num_tokens - num_computed_tokens`: 1 for a decode, plus its drafted
tokens with speculative decoding; a chunk for a prompt), under a per-step token budget.
Design after vLLM v1's scheduler and nano-vllm's; one pass per step (`schedule`) as
mini-sglang's prefill adder: decode rows first, then one loop over the prefill candidates
in one order, nothing planned taken back.

Every status change of a request happens here (`RequestStatus` in request.py):

    add ─▶ WAITING ──admit──▶ RUNNING ──finish──▶ FINISHED_*
    wait_for_remote_kv ─▶ WAITING_FOR_REMOTE_KV ──remote_kv_ready──▶ RUNNING
    RUNNING ──_preempt──▶ PREEMPTED (front of the waiting queue) ──admit──▶ RUNNING

A request waiting for remote KV holds its blocks but is never scheduled nor preempted (the
prefill worker may be writing into them); vLLM's scheduler likewise moves
WAITING_FOR_REMOTE_KVS back itself once its connector reports the KV received.

Admission order (`SchedulerConfig.policy`): "fcfs" takes the waiting queue as it stands
(preempted first); "shortest_first" sorts it first (`shortest_first`), so a continuing turn
is not queued behind a cold 20 s prompt (schedule_policy.py); under a prefill target the
running partial prefills are merged into that order. The admission rules then run
unchanged over it: whole-prompt fit, passing for at most max_bypass_s, in-flight prefix
deferral, chunk cap.
"""
from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from baton.config import SchedulerConfig
from baton.engine.kv_cache import Block, KVCacheManager
from baton.engine.inflight_prefix import InflightPrefixes
from baton.engine.kv_source import take
from baton.engine.sched_output import ScheduledRequest, SchedulerOutput
from baton.engine.request import Request, RequestStatus
from baton.engine.prefill_target import PrefillStep
from baton.engine.schedule_policy import WaitingOrder
from baton.engine.stats import Totals
from baton.engine.time_slice import victims_for_waiting


class AdmissionError(Exception):
    """Admitting `request` raised (a fault only it hit); the waiting queue is left intact
    without it, so the engine can end it alone."""

    def __init__(self, request: Request, cause: Exception) -> None:
        super().__init__(repr(cause))
        self.request = request


@dataclass
class _Plan:
    """One step's decisions as `schedule()` makes them (never taken back): rows, requests
    preempted, the token budget left, and the blocks running prompts still need (`reserved`,
    summed at the first admission attempt, then kept current)."""

    budget: int
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    reserved: int | None = None

    def add(self, row: ScheduledRequest) -> None:
        self.scheduled.append(row)
        self.budget -= row.num_new_tokens


class Scheduler:
    """Owns the waiting queue and the running list; asks the KVCacheManager for blocks."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.remote_waits: dict[str, Request] = {}  # WAITING_FOR_REMOTE_KV, blocks held
        self._inflight = InflightPrefixes(kv)  # block hashes this step computes
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
        """Pick this step's work in one pass; no planned row is ever taken back.

        Invariant: each planned request's block table covers num_computed_tokens +
        num_new_tokens tokens; the new tokens (drafted ones included) sum to at most
        max_num_batched_tokens; at most max_num_seqs requests run.
        1. Time slice (with a KV tier): the first waiting request (policy order) blocked for
           time_slice_s preempts long-running decodes now (`_slice`); they sit this step out.
        2. Decode rows (one token left, plus its drafts: spec/), in admission order. One that
           finds no block drops its drafts, then preempts the most recently admitted request.
        3. One loop over the prefill candidates, running partial prefills and waiting
           requests, in policy order (`_prefill_order`), under `PrefillStep`'s rules
           (prefill_target.py); a waiting one is admitted only if its whole prompt fits beside
           what the running ones still need (`_fits_whole_prompt`), and only in a step that
           preempted nothing. Rows come out in running order (admitted ones last).
        """
        now = time.monotonic()
        plan = _Plan(self.config.max_num_batched_tokens)
        self._inflight.reset(plan.scheduled)
        merge = bool(self.config.prefill_target_tokens)
        key = self._order.sort(self.waiting, now, keep_estimates=merge)
        sliced = self._slice(now)
        try:
            self._plan_decodes(plan)
            self._plan_prefills(plan, PrefillStep(self.config, now),
                                self._prefill_order(key if merge else None))
        finally:
            self.waiting.extendleft(reversed(sliced))
        where = {id(r): i for i, r in enumerate(self.running)}
        plan.scheduled.sort(key=lambda row: where[id(row.request)])
        return SchedulerOutput(plan.scheduled, plan.preempted)

    def _plan_decodes(self, plan: _Plan) -> None:
        """Step 2 of `schedule`: the decode rows, each with what fits of its drafts. Drafts
        take only spare budget (one token is kept for every decode row after) and spare
        blocks (`_draft_room`): they never make anyone wait or be preempted."""
        i = 0
        left = sum(r.num_tokens - r.num_computed_tokens == 1 for r in self.running)
        keep = sum(map(self._blocks_to_finish, self.running)) if left else 0
        while i < len(self.running) and plan.budget > 0:
            req = self.running[i]
            i += 1
            if req.num_tokens - req.num_computed_tokens != 1:
                continue  # a partial prefill: step 3
            own = self._blocks_to_finish(req)
            keep -= own
            room = min(plan.budget - left, self._draft_room(req, own, keep))
            spec = tuple(req.spec_token_ids[:max(0, room)])
            left -= 1
            if spec:
                self.kv.allocate_slots(req.request_id, req.num_computed_tokens + 1 + len(spec))
            elif not self._allocate_or_preempt(req, 1, plan.preempted):
                break  # req itself was preempted; it was the last running request
            plan.add(self._scheduled(req, 1 + len(spec), spec))

    def _draft_room(self, req: Request, own: int, keep: int) -> int:
        """Drafted tokens decode row `req` may carry: the free slots of its blocks after its
        own token, plus whole free blocks beyond its `own` next one and the `keep` blocks the
        other running requests still need for their next tokens and prompts."""
        spare = max(0, self.kv.num_free_blocks - own - keep)
        held = self.kv.num_request_blocks(req.request_id) + own
        return (held + spare) * self.kv.block_size - req.num_computed_tokens - 1

    def _prefill_order(self, key: Callable[[Request], tuple] | None) -> list[Request]:
        """Running partial prefills, then the waiting queue (in policy order already); with
        `key` (shortest_first under a prefill target) merged by it, running first on equal
        keys: a partial prefill yields its step to a request with fewer tokens left."""
        partial = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        if key is None:
            return partial + list(self.waiting)
        partial.sort(key=key)
        return list(heapq.merge(partial, self.waiting, key=key))

    def _plan_prefills(self, plan: _Plan, step: PrefillStep, order: list[Request]) -> None:
        """Step 3 of `schedule`. A waiting request that cannot start keeps its place; one
        that stops admission (`_admit` False) lets nothing waiting behind it start, while
        running partial prefills behind it still run."""
        admit, admitted = True, []
        try:
            for req in order:
                if plan.budget <= 0:
                    break
                if step.sits_out(req):
                    continue
                if req.status is RequestStatus.RUNNING:
                    self._plan_partial(plan, step, req)
                elif admit and not plan.preempted and len(self.running) < self.config.max_num_seqs:
                    admit = self._admit(plan, step, req)
                    if req.status is RequestStatus.RUNNING:
                        admitted.append(req)
        except AdmissionError as e:
            admitted.append(e.request)  # the engine ends it alone
            raise
        finally:
            if admitted:
                gone = {id(r) for r in admitted}
                kept = [r for r in self.waiting if id(r) not in gone]
                self.waiting.clear()
                self.waiting.extend(kept)

    def _plan_partial(self, plan: _Plan, step: PrefillStep, req: Request) -> None:
        """A running partial prefill's next chunk, if the step's rules and the pool allow.
        Short of blocks it sits the step out, preempting no one: its prompt's blocks were
        counted at admission, so only decode growth or this step's drafts (released after
        it) can have taken them, and decode rows preempt from the back when they run out."""
        start = req.num_computed_tokens
        n = step.cap(req, start, self._num_new_tokens(req, start, plan.budget))
        if step.defers(req, start, n):
            return
        new = self.kv.allocate_slots(req.request_id, start + n)
        if new is None:
            return
        if plan.reserved is not None:
            plan.reserved -= len(new)
        step.add(req, start, n)
        plan.add(self._scheduled(req, n))

    def _admit(self, plan: _Plan, step: PrefillStep, req: Request) -> bool:
        """Try to start waiting `req`; False stops admission behind it. One that cannot get
        blocks is passed by for at most `max_bypass_s` (then admission stops behind it); one
        whose next uncached block another request computes this step waits for it
        (inflight_prefix.py); a prompt that would not complete beside a row that
        does stops admission (`PrefillStep.defers`: behind it, longer ones). One asking for
        prompt logprobs reads no cached prefix (vLLM's rule: they need every position's
        logits)."""
        if plan.reserved is None:
            plan.reserved = sum(self._blocks_to_finish(r) for r in self.running)
        try:
            reads_cache = req.prompt_logprobs is None  # else its logits at every position
            hits, num_computed = self.kv.get_computed_blocks(
                req.request_id, req.all_token_ids, plan.reserved) if reads_cache else ([], 0)
            if reads_cache and self._inflight.defers(req, num_computed):
                return True
            n = step.cap(req, num_computed, self._num_new_tokens(req, num_computed, plan.budget))
            if step.defers(req, num_computed, n):
                return False
            blocks = None
            if self._fits_whole_prompt(req, hits, plan.reserved):
                blocks = self.kv.allocate_slots(req.request_id, num_computed + n, hits)
            if blocks is not None:
                self._inflight.add(req, num_computed, n)
        except Exception as e:  # noqa: BLE001 - the engine ends this request alone
            raise AdmissionError(req, e) from e
        if blocks is None:
            if req.blocked_since is None:
                req.blocked_since = step.now
            return step.now - req.blocked_since < self.config.max_bypass_s
        req.blocked_since = None
        step.add(req, num_computed, n)
        self._start_running(req, num_computed, n, plan)
        plan.reserved += self._blocks_to_finish(req)
        return True

    def _allocate_or_preempt(self, req: Request, n: int, preempted: list[Request]) -> bool:
        """Grow req's blocks for n new tokens, preempting from the back until it fits."""
        while self.kv.allocate_slots(req.request_id, req.num_computed_tokens + n) is None:
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim)
            if victim is req:
                return False
        return True

    def _slice(self, now: float) -> list[Request]:
        """With a KV tier, preempt running decodes for the first waiting request blocked for
        pool space at least time_slice_s (time_slice.py), before anything is planned; returns
        them, out of the queue (they rejoin its front after this step)."""
        if self.kv.tier is None:
            return []
        victims = victims_for_waiting(self.waiting, self.running, now, self.config.time_slice_s,
                                      self.kv, lambda: sum(map(self._blocks_to_finish,
                                                               self.running)))
        for v in victims:
            self.running.remove(v)
            self._preempt(v)
            self.waiting.remove(v)
            self.totals.num_time_slices += 1
        return victims

    def _start_running(self, req: Request, num_computed: int, n: int, plan: _Plan) -> None:
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
        plan.add(self._scheduled(req, n))

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

    def _scheduled(self, req: Request, n: int, spec: tuple[int, ...] = ()) -> ScheduledRequest:
        return ScheduledRequest(req, n, self.kv.block_table(req.request_id), spec)

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

