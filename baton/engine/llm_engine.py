"""One engine = one model, one paged KV cache, one scheduler, stepped by its owner.

A request's life inside `LLMEngine`:
1. `add_request`: validate (non-empty, ids in vocab, prompt + max_tokens within the context),
   resolve `max_tokens`, give a seeded request its own generator, queue it.
2. `step`: the scheduler picks decodes and prefill chunks under the token budget (prefix-cache
   hits skip computed blocks); the ModelRunner runs one forward over all of them and samples
   for the rows that completed their known tokens.
3. For each sampled token: append, register newly full blocks in the prefix cache, detokenize
   incrementally, check eos / stop ids / stop strings / max_tokens / context limit.
4. Finished or aborted requests release their blocks (to the prefix cache) at once.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from baton.config import EngineConfig
from baton.engine.detokenizer import IncrementalDetokenizer
from baton.engine.kv_cache import KVCacheManager
from baton.engine.model_runner import ModelRunner, ScheduledRequest
from baton.models.decoder import DecoderModel
from baton.models.registry import resolve_model
from baton.outputs import StepOutput, TokenLogprob
from baton.engine.request import Request, RequestStatus
from baton.engine.sampler import SamplerOutput, make_generator
from baton.sampling_params import SamplingParams
from baton.engine.scheduler import AdmissionError, Scheduler

logger = logging.getLogger(__name__)


@dataclass
class _Tracked:
    request: Request
    detok: IncrementalDetokenizer
    hold_blocks: bool = False


@dataclass(frozen=True)
class RemotePrefillPlan:
    """Decode side of a remote prefill: the prompt's blocks are allocated, the decode worker
    already holds KV for `num_cached_tokens` (block aligned), and the prefill worker must
    write the prompt's blocks from `num_cached_tokens // block_size` on into `dst_block_ids`.
    """

    request_id: str
    num_cached_tokens: int
    dst_block_ids: list[int]


class LLMEngine:
    """Synchronous engine; not thread-safe (one owner thread calls add/abort/step)."""

    def __init__(self, config: EngineConfig) -> None:
        from transformers import AutoTokenizer

        self.config = config
        self.model_path = resolve_model(config.model)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.model = DecoderModel(self.model_path, config.torch_dtype)
        cache = config.cache
        per_block = ModelRunner.bytes_per_block(self.model, cache.block_size)
        num_blocks = cache.num_blocks or max(2, cache.kv_cache_memory_bytes // per_block)
        self.max_model_len = self._max_model_len(num_blocks * cache.block_size)
        self.kv = KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv)
        self.runner = ModelRunner(self.model, num_blocks, cache.block_size)
        self.eos_token_ids = self._eos_ids()
        self.requests: dict[str, _Tracked] = {}
        self.held: dict[str, Request] = {}  # finished prefill-role requests holding blocks
        torch.manual_seed(config.seed)

    def _max_model_len(self, cache_tokens: int) -> int:
        cfg = self.model.config
        limit = self.config.max_model_len or self.model.shape.max_position_embeddings
        window = getattr(cfg, "sliding_window", None)
        if window and (getattr(cfg, "use_sliding_window", True) is not False):
            limit = min(limit, window)  # full attention equals sliding attention up to here
        if cache_tokens < limit:
            logger.warning("KV cache holds %d tokens; capping max_model_len %d", cache_tokens,
                           limit)
        return min(limit, cache_tokens, self.model.shape.max_position_embeddings)

    def _eos_ids(self) -> frozenset[int]:
        ids = set()
        eos = getattr(self.model.config, "eos_token_id", None)
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        gen = self.model_path / "generation_config.json"
        if gen.is_file():
            import json
            g = json.loads(gen.read_text()).get("eos_token_id")
            ids.update(g if isinstance(g, list) else [g] if g is not None else [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(ids)

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, hold_blocks: bool = False) -> Request:
        """Queue a request. Raises ValueError for a bad prompt or limits.

        hold_blocks (prefill role): when the request finishes normally its blocks stay
        referenced until `release_blocks(request_id)`, so they can be sent to a decode worker.
        """
        req = self._new_request(request_id, prompt_token_ids, params, hold_blocks)
        self.scheduler.add(req)
        return req

    def _new_request(self, request_id: str, prompt_token_ids: list[int],
                     params: SamplingParams, hold_blocks: bool = False) -> Request:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} already exists")
        if not prompt_token_ids:
            raise ValueError("prompt is empty: at least one token is required")
        vocab = self.model.shape.vocab_size
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        room = self.max_model_len - len(prompt_token_ids)
        if room < 1:
            raise ValueError(f"prompt has {len(prompt_token_ids)} tokens; the context limit is "
                             f"{self.max_model_len}, leaving no room to generate")
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        if max_tokens > room:
            raise ValueError(f"prompt ({len(prompt_token_ids)} tokens) + max_tokens "
                             f"({max_tokens}) exceeds the context limit {self.max_model_len}")
        req = Request(request_id, list(prompt_token_ids), params, max_tokens,
                      eos_token_ids=frozenset() if params.ignore_eos else self.eos_token_ids)
        if params.seed is not None:
            req.generator = make_generator(params.seed)
        detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, params)
        self.requests[request_id] = _Tracked(req, detok, hold_blocks)
        return req

    # ---- remote prefill (decode role) ----------------------------------------------------
    def add_remote_request(self, request_id: str, prompt_token_ids: list[int],
                           params: SamplingParams,
                           min_remote_tokens: int = 0) -> RemotePrefillPlan | None:
        """Admit a request whose prompt KV may come from a prefill worker.

        Conditional disaggregation: when the uncached suffix is shorter than
        `min_remote_tokens`, or the pool cannot hold the whole prompt now, the request is
        queued for local prefill and None is returned. Otherwise the prompt's blocks are
        allocated, the request waits in WAITING_FOR_REMOTE_KV (never scheduled, never
        preempted) and the plan says which blocks the prefill worker must fill. Follow with
        `finish_remote_prefill` or `fail_remote_prefill`. Raises ValueError like add_request.
        """
        req = self._new_request(request_id, prompt_token_ids, params)
        hits, num_cached = self.kv.get_computed_blocks(request_id, req.prompt_token_ids)
        if req.num_prompt_tokens - num_cached < max(1, min_remote_tokens):
            self.scheduler.add(req)
            return None
        if self.kv.allocate_slots(request_id, req.num_prompt_tokens, hits) is None:
            self.scheduler.add(req)
            return None
        req.status = RequestStatus.WAITING_FOR_REMOTE_KV
        req.num_computed_tokens = req.num_cached_tokens = num_cached
        table = self.kv.block_table(request_id)
        return RemotePrefillPlan(request_id, num_cached,
                                 table[num_cached // self.kv.block_size:])

    def finish_remote_prefill(self, request_id: str, first_token_id: int,
                              logprob: TokenLogprob | None = None) -> StepOutput:
        """The prompt's KV has fully arrived: join the running batch with the first token.

        Raises KeyError if the request is not waiting for remote KV.
        """
        tracked = self._remote(request_id)
        req = tracked.request
        req.num_computed_tokens = req.num_prompt_tokens
        self.kv.cache_blocks(request_id, req.all_token_ids, req.num_computed_tokens)
        req.status = RequestStatus.RUNNING
        req.scheduled_time = req.scheduled_time or time.monotonic()
        if req.generator is not None and not req.sampling_params.is_greedy:
            # The prefill worker drew the first token from its copy of this seed: skip that
            # draw (one vocab-sized draw per sampled token) so later tokens match colocated.
            torch.empty(self.model.shape.vocab_size).exponential_(generator=req.generator)
        self.scheduler.running.append(req)
        return self._accept_token(tracked, first_token_id, [logprob] if logprob else [])

    def fail_remote_prefill(self, request_id: str, recompute: bool,
                            error: str = "remote prefill failed") -> StepOutput | None:
        """The remote prefill failed or timed out. With `recompute`, prefill locally from the
        decode worker's own cached prefix (the transferred blocks' contents are never used:
        they are overwritten); else finish the request with an error.

        Only call once no transfer can still be writing into the request's blocks.
        Raises KeyError if the request is not waiting for remote KV.
        """
        tracked = self._remote(request_id)
        req = tracked.request
        if recompute:
            req.num_computed_tokens = req.num_cached_tokens
            req.status = RequestStatus.RUNNING
            req.scheduled_time = req.scheduled_time or time.monotonic()
            self.scheduler.running.append(req)
            return None
        return self._fail_request(req, error)

    def _remote(self, request_id: str) -> _Tracked:
        tracked = self.requests[request_id]
        if tracked.request.status != RequestStatus.WAITING_FOR_REMOTE_KV:
            raise KeyError(f"request {request_id!r} is not waiting for remote KV")
        return tracked

    # ---- held blocks (prefill role) -------------------------------------------------------
    def held_block_table(self, request_id: str) -> list[int]:
        """Block ids of a finished request whose blocks are held (KeyError if none)."""
        if request_id not in self.held:
            raise KeyError(f"no held blocks for {request_id!r}")
        return self.kv.block_table(request_id)

    def release_blocks(self, request_id: str) -> bool:
        """End the hold on a finished request's blocks (to the prefix cache). False if none."""
        if self.held.pop(request_id, None) is None:
            return False
        self.kv.free(request_id)
        return True

    def abort_request(self, request_id: str) -> StepOutput | None:
        """Abort in any state; frees its blocks. Returns its final output, None if unknown."""
        tracked = self.requests.pop(request_id, None)
        if tracked is None:
            self.release_blocks(request_id)
            return None
        self.scheduler.finish(tracked.request, RequestStatus.FINISHED_ABORTED)
        return self._output(tracked, [], "", [])

    def fail_running(self, error: str) -> list[StepOutput]:
        """After a failed step: end every running request with an error (blocks freed)."""
        outs = []
        for req in list(self.scheduler.running):
            out = self._fail_request(req, error)
            if out is None:  # untracked (never expected): still drop it and its blocks
                self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
            else:
                outs.append(out)
        return outs

    def _fail_request(self, req: Request, error: str) -> StepOutput | None:
        """End one tracked request with an error wherever it is (blocks freed); None if it
        already ended (its blocks, maybe held for a transfer, are left alone)."""
        tracked = self.requests.pop(req.request_id, None)
        if tracked is None:
            return None
        self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
        out = self._output(tracked, [], "", [])
        out.error = error
        return out

    def has_unfinished_requests(self) -> bool:
        """True while there is work to step (waiting or running; not remote-KV waits)."""
        return self.scheduler.has_unfinished()

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    @property
    def kv_cache(self) -> torch.Tensor:
        """The KV pool tensor the transports read and write (the model runner's)."""
        return self.runner.kv_cache

    @property
    def num_blocks(self) -> int:
        """Blocks in the KV pool."""
        return self.kv.num_blocks

    # ---- step ----------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Run one scheduling + forward step; return the requests that progressed.

        A fault one request alone hits (its admission, its sampled token's processing) ends
        that request with an error; the others go on. Anything else raises (the caller then
        fails the running batch: `fail_running`)."""
        try:
            scheduled, _ = self.scheduler.schedule()
        except AdmissionError as e:
            logger.exception("admitting %s failed", e.request.request_id)
            out = self._fail_request(e.request, f"admission failed: {e}")
            return [out] if out is not None else []
        if not scheduled:
            return []
        rows, sampled = self.runner.execute(scheduled)
        for s in scheduled:
            req = s.request
            req.num_computed_tokens += s.num_new_tokens
            self.kv.cache_blocks(req.request_id, req.all_token_ids, req.num_computed_tokens)
        return self._process_samples(rows, sampled) if sampled is not None else []

    def _process_samples(self, rows: list[ScheduledRequest],
                         sampled: SamplerOutput) -> list[StepOutput]:
        outputs = []
        token_ids = sampled.token_ids.tolist()
        chosen_lp = sampled.logprobs.tolist()
        top = sampled.top_logprobs
        top_ids = top[0].tolist() if top is not None else None
        top_vals = top[1].tolist() if top is not None else None
        ranks = sampled.ranks.tolist() if sampled.ranks is not None else None
        for i, row in enumerate(rows):
            tracked = self.requests[row.request.request_id]
            token = token_ids[i]
            lps = []
            k = tracked.request.sampling_params.logprobs
            if k is not None:
                lps = [TokenLogprob(token, chosen_lp[i],
                                    dict(zip(top_ids[i][:k], top_vals[i][:k])) if k else {},
                                    ranks[i])]
            try:
                outputs.append(self._accept_token(tracked, token, lps))
            except Exception as e:  # noqa: BLE001 - its stop check or text: it alone ends
                logger.exception("processing a token of %s failed", row.request.request_id)
                out = self._fail_request(row.request, repr(e))
                outputs.extend([out] if out is not None else [])
        return outputs

    def _accept_token(self, tracked: _Tracked, token: int,
                      lps: list[TokenLogprob]) -> StepOutput:
        """Append a sampled token, stream its text, finish the request if it stops."""
        req = tracked.request
        req.append_output_token(token)
        status, delta = self._check_stop(tracked, token)
        if status is not None:
            del self.requests[req.request_id]
            hold = tracked.hold_blocks and status <= RequestStatus.FINISHED_LENGTH
            self.scheduler.finish(req, status, free=not hold)
            if hold:
                self.held[req.request_id] = req
        return self._output(tracked, [token], delta, lps)

    def _check_stop(self, tracked: _Tracked, token: int) -> tuple[RequestStatus | None, str]:
        req, params = tracked.request, tracked.request.sampling_params
        n_out = len(req.output_token_ids)
        may_stop = n_out >= params.min_tokens
        if may_stop and token in req.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED, tracked.detok.flush()
        if may_stop and token in params.stop_token_ids:
            req.stop_reason = token
            return RequestStatus.FINISHED_STOPPED, tracked.detok.flush()
        update = tracked.detok.update([token])
        if update.stop_string is not None:
            req.stop_reason = update.stop_string
            return RequestStatus.FINISHED_STOPPED, update.text_delta
        if n_out >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH, update.text_delta + tracked.detok.flush()
        return None, update.text_delta

    def _output(self, tracked: _Tracked, new: list[int], delta: str,
                lps: list[TokenLogprob]) -> StepOutput:
        req = tracked.request
        return StepOutput(
            request_id=req.request_id, new_token_ids=new, text_delta=delta, logprobs=lps,
            finished=req.status.is_finished, finish_reason=req.status.finish_reason,
            stop_reason=req.stop_reason, num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=len(req.output_token_ids),
            num_cached_tokens=max(0, req.num_cached_tokens))
