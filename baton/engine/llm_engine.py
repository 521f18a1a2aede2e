"""One engine = one model, one paged KV cache, one scheduler, stepped by its owner.

A request's life inside `LLMEngine`:
1. `add_request`: validate, resolve `max_tokens`, give a seeded request its generator and a
   structured one its grammar matcher (grammar.py; ValueError if it does not compile), queue.
2. `step`: with speculative decoding, every decode row first gets drafted tokens
   (spec/speculation.py); the scheduler picks decodes and prefill chunks under the token
   budget (prefix-cache hits skip computed blocks); the ModelRunner runs one forward and
   samples the rows that completed their known tokens (a decode row with drafts: each of its
   positions, verified: spec/verify.py).
3. Per sampled token: advance its grammar, append, cache newly full blocks, detokenize, check
   the stop conditions (detokenizer.check_stop); a verified row's tokens one by one, its
   rejected drafts' blocks released (`_accept_verified`).
4. Finished or aborted requests release their blocks at once unless the `finish_hook` keeps
   them. The roles' states (`remote_kv.RemoteKV`, `block_holds.BlockHolds`) use the methods
   marked "for role components"; status changes happen in the scheduler only.
"""
from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from baton.config import EngineConfig
from baton.engine.detokenizer import IncrementalDetokenizer, check_stop
from baton.engine.grammar import GrammarCompiler
from baton.engine.kv_budget import auto_num_blocks, free_for_pool
from baton.engine.kv_cache import KVCacheManager
from baton.engine.model_limits import eos_token_ids, max_model_len
from baton.engine.model_runner import ModelRunner
from baton.engine.prefill_rate import PrefillRate
from baton.engine.request import Request, RequestStatus, resolve_max_tokens
from baton.engine.sampler import SamplerOutput, logprob_lists, make_generator
from baton.engine.sched_output import ScheduledRequest
from baton.engine.scheduler import AdmissionError, Scheduler
from baton.engine.spec.speculation import Speculation
from baton.engine.stats import EngineCounts, EngineStats, counts_of, snapshot
from baton.engine.tier_stack import tiers_for
from baton.models.decoder import DecoderModel
from baton.models.registry import resolve_model
from baton.outputs import StepOutput, TokenLogprob, merge_outputs
from baton.sampling_params import SamplingParams
from baton.session_hints import SessionHint

logger = logging.getLogger(__name__)


@dataclass
class _Tracked:
    request: Request
    detok: IncrementalDetokenizer


class LLMEngine:
    """Synchronous engine; not thread-safe (one owner thread calls add/abort/step).

    finish_hook(request, status) -> bool: asked when a request ends with the finished `status`;
    True keeps its blocks referenced (its owner frees them with `kv.free(request_id)`).
    """

    def __init__(self, config: EngineConfig) -> None:
        from transformers import AutoTokenizer

        self.config = config
        self.model_path = resolve_model(config.model)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.model = DecoderModel(self.model_path, config.torch_dtype, config.torch_device)
        cache, shape = config.cache, self.model.shape
        per_block = ModelRunner.bytes_per_block(self.model, cache.block_size)
        num_blocks = self._pool_blocks(per_block)
        self.max_model_len = max_model_len(self.model.config, shape.max_position_embeddings,
                                           config.max_model_len, num_blocks * cache.block_size)
        self.runner = ModelRunner(
            self.model, num_blocks, cache.block_size, config.scheduler.max_num_seqs,
            self.max_model_len, cuda_graphs=self.model.device.type == "cuda"
            and not config.enforce_eager)
        self.kv = KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching,
                                 tier=tiers_for(self.runner.kv_cache, cache, config.model))
        self.scheduler = Scheduler(config.scheduler, self.kv)
        self.prefill_rate = PrefillRate()
        self.eos_token_ids = eos_token_ids(self.model.config, self.model_path, self.tokenizer)
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.requests: dict[str, _Tracked] = {}
        self.finish_hook: Callable[[Request, RequestStatus], bool] | None = None
        self.spec = Speculation(config.speculative, self.max_model_len, config.seed) \
            if config.speculative.enabled else None  # drafts and counts; None: off
        if self.spec is not None:
            self.runner.verifier = self.spec.verifier
        torch.manual_seed(config.seed)

    def _pool_blocks(self, per_block: int) -> int:
        """The pool's size: the configured blocks or bytes, else from the memory free now
        that the model is loaded (kv_budget.py; KVBudgetError when one request won't fit)."""
        config, cache = self.config, self.config.cache
        if cache.num_blocks:
            return cache.num_blocks
        if cache.kv_cache_memory_bytes is not None:
            return max(2, cache.kv_cache_memory_bytes // per_block)
        limit = max_model_len(self.model.config, self.model.shape.max_position_embeddings,
                              config.max_model_len, sys.maxsize)
        free, source = free_for_pool(self.model.device, cache.kv_host_tier_bytes)
        seqs = config.scheduler.max_num_seqs if cache.kv_pool_for_batch else None
        blocks = auto_num_blocks(free, per_block, limit, cache.block_size,
                                 cache.kv_memory_fraction, seqs, source)
        logger.info("KV pool: %d blocks (%.0f MiB) of %s MiB free", blocks,
                    blocks * per_block / 2**20, "?" if free is None else f"{free / 2**20:.0f}")
        return blocks

    # ---- what a worker may read ----------------------------------------------------------
    @property
    def kv_cache(self) -> torch.Tensor:
        """The paged KV tensor [num_blocks, num_layers, 2, block_size, kv_heads, head_size]
        (the KV transports register it)."""
        return self.runner.kv_cache

    @property
    def num_blocks(self) -> int:
        return self.kv.num_blocks

    @property
    def vocab_size(self) -> int:
        return self.model.shape.vocab_size

    def counts(self) -> EngineCounts:
        """Queue and pool sizes; safe to call from any thread (see EngineCounts)."""
        s = self.scheduler
        return counts_of(s.running, s.waiting, s.remote_waits, self.kv, s.totals)

    def stats(self, include_block_hashes: bool = False) -> EngineStats:
        """A consistent snapshot; call on the engine thread."""
        s = self.scheduler
        return snapshot(s.waiting, s.running, self.kv, s.config.max_num_seqs, self.counts(),
                        include_block_hashes, self.prefill_rate.tokens_per_s)

    def get_request(self, request_id: str) -> Request:
        """The live request (read it, don't change it). Raises KeyError once it ended."""
        return self.requests[request_id].request

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, session: SessionHint | None = None) -> Request:
        """Queue a request; its prefix blocks in the KV tier start coming up into the pool
        now (`KVCacheManager.prefetch`). `session`: its session hint (eviction order of its
        blocks: free_lists.py). Raises ValueError for a bad prompt or limits."""
        req = self.new_request(request_id, prompt_token_ids, params, session)
        self.scheduler.add(req)
        self.kv.prefetch(request_id, req.all_token_ids)
        return req

    def new_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, session: SessionHint | None = None) -> Request:
        """Validate and track a request without queueing it (for role components: the
        caller hands it to the scheduler). Raises ValueError for a bad prompt or limits."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} already exists")
        max_tokens = resolve_max_tokens(prompt_token_ids, params.max_tokens, self.vocab_size,
                                        self.max_model_len)
        if params.logit_bias and max(params.logit_bias) >= self.vocab_size:
            raise ValueError(f"logit_bias token ids must be in [0, {self.vocab_size})")
        req = Request(request_id, list(prompt_token_ids), params, max_tokens,
                      eos_token_ids=frozenset() if params.ignore_eos else self.eos_token_ids)
        if params.seed is not None:
            req.generator = make_generator(params.seed, self.model.device)
        if params.structured_output is not None:
            req.grammar = self.grammars.matcher(params.structured_output)
        detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, params)
        self.requests[request_id] = _Tracked(req, detok)
        self.kv.bind_session(request_id, session)
        if self.spec is not None:
            self.spec.add(request_id, session)
        return req

    def end_session(self, session_id: str) -> int:
        """End a session's retention (its free blocks first to evict) and its drafting
        index. Returns how many blocks."""
        if self.spec is not None:
            self.spec.end_session(session_id)
        return self.kv.end_session(session_id)

    def restore_sessions(self) -> int:
        """Idle work: reload from the KV tier what pinned sessions lost to eviction
        (KVCacheManager.restore_sessions). Returns blocks loaded."""
        return self.kv.restore_sessions()

    def abort_request(self, request_id: str) -> StepOutput | None:
        """Abort in any state; frees its blocks. Returns its final output, None if unknown."""
        return self.end_request(request_id, RequestStatus.FINISHED_ABORTED)

    def end_request(self, request_id: str, status: RequestStatus,
                    error: str | None = None) -> StepOutput | None:
        """End a live request with a finished `status` wherever it is (its blocks released,
        unless the finish hook keeps them). Returns its final output (with `error`), None if
        the engine does not know it."""
        tracked = self.requests.pop(request_id, None)
        if tracked is None:
            return None
        self._finish(tracked.request, status)
        out = self._output(tracked, [], "", [])
        out.error = error
        return out

    def fail_running(self, error: str) -> list[StepOutput]:
        """After a failed step: end every running request with an error (blocks freed)."""
        outs = []
        for req in list(self.scheduler.running):
            out = self.end_request(req.request_id, RequestStatus.FINISHED_ERROR, error)
            if out is None:  # untracked (never expected): still drop it and its blocks
                self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
            else:
                outs.append(out)
        return outs

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if req.status is RequestStatus.RUNNING and self.kv.num_request_blocks(req.request_id):
            # a verified row may end it mid-row: its accepted tokens' full blocks stay cached
            self.kv.cache_blocks(req.request_id, req.all_token_ids, req.num_computed_tokens)
        if self.spec is not None:
            self.spec.finish(req)
        keep = self.finish_hook is not None and self.finish_hook(req, status)
        self.scheduler.finish(req, status, free=not keep)

    def has_unfinished_requests(self) -> bool:
        """True while there is work to step (waiting or running; not remote-KV waits)."""
        return self.scheduler.has_unfinished()

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ---- step ----------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Run one scheduling + forward step; return the requests that progressed.

        A fault one request alone hits (its admission, its sampled token's processing) ends
        that request with an error; the others go on. Anything else raises (the caller then
        fails the running batch: `fail_running`)."""
        started = time.perf_counter()
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)
        try:
            scheduled, _ = self.scheduler.schedule()
        except AdmissionError as e:
            logger.exception("admitting %s failed", e.request.request_id)
            out = self.end_request(e.request.request_id, RequestStatus.FINISHED_ERROR,
                                   f"admission failed: {e}")
            return [out] if out is not None else []
        if not scheduled:
            return []
        rows, sampled = self.runner.execute(scheduled)
        prompt_tokens = decode_rows = drafted = 0
        for s in scheduled:
            req = s.request
            if req.num_tokens - req.num_computed_tokens > 1:  # a prefill row (a preempted
                prompt_tokens += s.num_new_tokens             # one's recompute included)
            else:
                decode_rows += 1
                drafted += len(s.spec_token_ids)
            if s.spec_token_ids:
                continue  # a verified row: advanced by its accepted tokens (_accept_verified)
            req.num_computed_tokens += s.num_new_tokens
            self.kv.cache_blocks(req.request_id, req.all_token_ids, req.num_computed_tokens)
        outputs = self._process_samples(rows, sampled) if sampled is not None else []
        seconds = time.perf_counter() - started
        self.prefill_rate.observe(prompt_tokens, seconds)
        if self.spec is not None:
            self.spec.observe_step(decode_rows, drafted, prompt_tokens, seconds)
        return outputs

    def _process_samples(self, rows: list[ScheduledRequest],
                         sampled: SamplerOutput) -> list[StepOutput]:
        outputs = []
        token_ids = sampled.token_ids.tolist()
        lengths = sampled.row_lengths or (1,) * len(rows)
        lps = logprob_lists(sampled, [r.request.sampling_params.logprobs for r in rows], lengths)
        at = 0
        for row, n in zip(rows, lengths):
            rid = row.request.request_id
            try:
                if row.spec_token_ids:
                    outputs.append(self._accept_verified(row, token_ids[at:at + n],
                                                         lps[at:at + n]))
                else:
                    outputs.append(self.accept_token(rid, token_ids[at], lps[at]))
            except Exception as e:  # noqa: BLE001 - its stop check or text: it alone ends
                logger.exception("processing a token of %s failed", rid)
                out = self.end_request(rid, RequestStatus.FINISHED_ERROR, repr(e))
                outputs.extend([out] if out is not None else [])
            at += n
        return outputs

    def _accept_verified(self, row: ScheduledRequest, tokens: list[int],
                         lps: list[list[TokenLogprob]]) -> StepOutput:
        """A speculative row's output tokens (1 + its accepted drafts: spec/verify.py): each
        accepted draft's KV was computed in this step, so num_computed_tokens stays one
        behind the token list as in a plain step; blocks past the accepted tokens (rejected
        drafts' slots) are released uncached (`KVCacheManager.trim`)."""
        req = row.request
        rid = req.request_id
        self.spec.observe(rid, len(row.spec_token_ids), len(tokens) - 1,
                          self.scheduler.totals)
        req.num_computed_tokens += 1  # the row's known token
        outs = []
        for j, token in enumerate(tokens):
            req.num_computed_tokens += j > 0  # the draft just accepted as token j - 1
            outs.append(self.accept_token(rid, token, lps[j]))
            if outs[-1].finished:
                return merge_outputs(outs)
        self.kv.cache_blocks(rid, req.all_token_ids, req.num_computed_tokens)
        self.kv.trim(rid, req.num_tokens)
        return merge_outputs(outs)

    def accept_token(self, request_id: str, token: int,
                     lps: list[TokenLogprob]) -> StepOutput:
        """Append a sampled token, stream its text, finish the request if it stops (also
        for role components: the first token of a remote prefill). KeyError: not live."""
        tracked = self.requests[request_id]
        req = tracked.request
        try:
            complete = req.grammar is not None and req.grammar.advance(token)
        except ValueError as e:  # a token its grammar forbids: a peer's first token
            return self.end_request(request_id, RequestStatus.FINISHED_ERROR, str(e))
        req.append_output_token(token)
        self.scheduler.totals.count_output_token(req)
        status, delta = check_stop(req, tracked.detok, token, self.max_model_len, complete)
        if status is not None:
            del self.requests[request_id]
            self._finish(req, status)
        out = self._output(tracked, [token], delta, lps)
        if len(req.output_token_ids) == 1:  # its first token: the prompt's logprobs with it
            out.prompt_logprobs = req.prompt_logprobs
        return out

    def _output(self, tracked: _Tracked, new: list[int], delta: str,
                lps: list[TokenLogprob]) -> StepOutput:
        req = tracked.request
        return StepOutput(
            request_id=req.request_id, new_token_ids=new, text_delta=delta, logprobs=lps,
            finished=req.status.is_finished, finish_reason=req.status.finish_reason,
            stop_reason=req.stop_reason, num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=len(req.output_token_ids),
            num_cached_tokens=max(0, req.num_cached_tokens), cached_spans=req.cached_spans)

