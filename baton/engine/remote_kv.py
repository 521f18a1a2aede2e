"""Decode role: requests whose prompt KV is written into their blocks by a prefill worker.

    rkv = RemoteKV(engine)
    plan, req, decision = rkv.add(rid, prompt, params, min_remote_tokens)   (or pd=PDRequest)
        plan None: short uncached suffix, or the P/D cost model (baton/pd_cost.py) said
                   local (or no room now) → queued for local prefill
        plan:      blocks allocated, WAITING_FOR_REMOTE_KV; the prefill worker fills
                   plan.dst_block_ids (from plan.num_cached_tokens on)
    rkv.finish(rid, first_token)        the KV has all arrived → RUNNING, first token out
    rkv.fail(rid, recompute=..., writes_may_land=...)
                                        recompute: RUNNING from the decode side's own prefix
                                        else: finished (error or abort)
        writes_may_land: the destination blocks are set aside in a *hold* (still referenced,
        in no block table) until `release_hold`, so no late write of a transfer that cannot
        be refused lands in a block another request uses; the request goes on without them.
        Its prefix blocks (src_block_ids, which the prefill worker may still be reading) get
        one more reference in the same hold, so they stay unchanged until then too.

    block table of a remote request, num_cached_tokens = 2 blocks:
        [ 7 ][ 8 ][ 40 ][ 12 ]      7, 8: the decode side's own prefix-cache hits
                   └─────┴── dst_block_ids: written by the prefill worker
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, NamedTuple

from baton.engine.kv_cache import Block
from baton.engine.request import Request, RequestStatus
from baton.engine.sampler import skip_draw
from baton.outputs import StepOutput, TokenLogprob
from baton.pd_cost import PDDecision, PDPolicy, PDRates, PDState, decide
from baton.sampling_params import SamplingParams
from baton.session_hints import SessionHint

if TYPE_CHECKING:
    from baton.engine.llm_engine import LLMEngine


@dataclass(frozen=True)
class RemotePrefillPlan:
    """Decode side of a remote prefill: the prompt's blocks are allocated, the decode worker
    already holds KV for `num_cached_tokens` (block aligned) in `src_block_ids` (the prefill
    worker reads those it lacks: they stay unchanged until the Prefill call is answered),
    and the prefill worker must write the prompt's blocks from `num_cached_tokens //
    block_size` on into `dst_block_ids`.
    """

    request_id: str
    num_cached_tokens: int
    dst_block_ids: list[int]
    src_block_ids: list[int] = ()


@dataclass(frozen=True)
class PDRequest:
    """What the decode worker's event loop knows, when a request arrives, of the path a
    remote prefill would take (the rest, decode's own prefix hit and queue, is read on the
    engine thread): the prefill worker's queued tokens (aged), the learned rates, the policy,
    one KV block's bytes."""

    prefill_waiting_tokens: int
    rates: PDRates
    policy: PDPolicy
    block_bytes: int


class RemoteAdd(NamedTuple):
    """`RemoteKV.add`'s answer: the plan (None: local prefill), the engine's request, and
    the cost model's decision (None when a fixed threshold decided)."""

    plan: RemotePrefillPlan | None
    request: Request
    decision: PDDecision | None


@dataclass(frozen=True)
class RemoteFailure:
    """What `RemoteKV.fail` did: `output` is the request's final output when it ended (None
    when it goes on, recomputing); `hold_id` names the set-aside destination blocks (None
    when none were set aside)."""

    output: StepOutput | None
    hold_id: int | None


class RemoteKV:
    """Remote-KV waits and block holds of one engine (engine thread only)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._holds: dict[int, list[Block]] = {}
        self._next_hold = 0

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
            min_remote_tokens: int = 0, *, pd: PDRequest | None = None,
            session: SessionHint | None = None) -> RemoteAdd:
        """Admit a request whose prompt KV may come from a prefill worker.

        Conditional disaggregation: when the uncached suffix is shorter than
        `min_remote_tokens` (or, given `pd`, when the cost model decides local: decided here
        because only here, on the engine thread, are the prefix hit and the local queue
        known), or the pool cannot hold the whole prompt now, the request is queued for
        local prefill and the plan is None. Otherwise it waits for remote KV (never
        scheduled, never preempted) until `finish` or `fail`. `session`: as for
        `LLMEngine.add_request`. Raises ValueError like `LLMEngine.add_request`.
        """
        e, kv = self.engine, self.engine.kv
        req = e.new_request(request_id, prompt_token_ids, params, session)
        hits, num_cached = kv.get_computed_blocks(request_id, req.prompt_token_ids)
        decision = None
        if pd is None:
            remote = req.num_prompt_tokens - num_cached >= max(1, min_remote_tokens)
        else:
            stats = e.stats()
            rates = pd.rates if stats.prefill_tokens_per_s <= 0 else \
                replace(pd.rates, local_tokens_per_s=stats.prefill_tokens_per_s)
            decision = decide(PDState(req.num_prompt_tokens, num_cached,
                                      stats.counts.num_running, stats.num_waiting_tokens,
                                      pd.prefill_waiting_tokens, kv.block_size,
                                      pd.block_bytes), rates, pd.policy)
            remote = decision.remote
        if not remote or \
                kv.allocate_slots(request_id, req.num_prompt_tokens, hits) is None:
            e.scheduler.add(req)
            return RemoteAdd(None, req, decision)
        e.scheduler.wait_for_remote_kv(req, num_cached)
        table, held = kv.block_table(request_id), num_cached // kv.block_size
        return RemoteAdd(RemotePrefillPlan(request_id, num_cached, table[held:], table[:held]),
                         req, decision)

    def finish(self, request_id: str, first_token_id: int,
               logprob: TokenLogprob | None = None) -> StepOutput:
        """The prompt's KV has fully arrived: join the running batch with the first token.
        Raises KeyError if the request is not waiting for remote KV."""
        e = self.engine
        req = self._waiting(request_id)
        e.scheduler.remote_kv_ready(req, req.num_prompt_tokens)
        e.kv.cache_blocks(request_id, req.all_token_ids, req.num_computed_tokens)
        if req.generator is not None and not req.sampling_params.is_greedy:
            skip_draw(req.generator, e.vocab_size)  # the prefill worker drew the first token
        return e.accept_token(request_id, first_token_id, [logprob] if logprob else [])

    def fail(self, request_id: str, *, recompute: bool, writes_may_land: bool = False,
             aborted: bool = False, error: str = "remote prefill failed") -> RemoteFailure:
        """The remote prefill failed, timed out or was aborted. With `recompute`, prefill
        locally from the decode side's own cached prefix (transferred blocks' contents are
        never used: they are overwritten, or set aside); else finish the request (ABORTED
        when `aborted`, else ERROR with `error`). Raises KeyError if the request is not
        waiting for remote KV."""
        e = self.engine
        req = self._waiting(request_id)
        hold_id = None
        if writes_may_land:
            held = req.num_cached_tokens // e.kv.block_size
            prefix = list(e.kv.requests[request_id].blocks[:held])
            e.kv.pool.touch(prefix)  # a READ may still copy them: keep them unchanged
            hold_id = self._hold(e.kv.detach(request_id, held) + prefix)
        if recompute:
            e.scheduler.remote_kv_ready(req, req.num_cached_tokens)
            return RemoteFailure(None, hold_id)
        if aborted:
            return RemoteFailure(e.abort_request(request_id), hold_id)
        return RemoteFailure(e.end_request(request_id, RequestStatus.FINISHED_ERROR, error),
                             hold_id)

    def release_hold(self, hold_id: int) -> bool:
        """Free set-aside blocks once no write can land in them. False if unknown."""
        blocks = self._holds.pop(hold_id, None)
        if blocks is None:
            return False
        self.engine.kv.release_detached(blocks)
        return True

    @property
    def num_held_blocks(self) -> int:
        return sum(len(b) for b in self._holds.values())

    def _hold(self, blocks: list[Block]) -> int:
        self._next_hold += 1
        self._holds[self._next_hold] = blocks
        return self._next_hold

    def _waiting(self, request_id: str) -> Request:
        req = self.engine.requests.get(request_id)
        req = req.request if req is not None else None
        if req is None or req.status != RequestStatus.WAITING_FOR_REMOTE_KV:
            raise KeyError(f"request {request_id!r} is not waiting for remote KV")
        return req
