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
from dataclasses import dataclass

import torch

from baton.config import EngineConfig
from baton.detokenizer import IncrementalDetokenizer
from baton.kv_cache import KVCacheManager
from baton.model_runner import ModelRunner, ScheduledRequest
from baton.models.decoder import DecoderModel
from baton.models.registry import resolve_model
from baton.outputs import StepOutput, TokenLogprob
from baton.request import Request, RequestStatus
from baton.sampler import SamplerOutput, make_generator
from baton.sampling_params import SamplingParams
from baton.scheduler import Scheduler

logger = logging.getLogger(__name__)


@dataclass
class _Tracked:
    request: Request
    detok: IncrementalDetokenizer


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
                    params: SamplingParams) -> Request:
        """Queue a request. Raises ValueError for a bad prompt or limits, KeyError-free."""
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
        self.requests[request_id] = _Tracked(req, detok)
        self.scheduler.add(req)
        return req

    def abort_request(self, request_id: str) -> StepOutput | None:
        """Abort in any state; frees its blocks. Returns its final output, None if unknown."""
        tracked = self.requests.pop(request_id, None)
        if tracked is None:
            return None
        self.scheduler.finish(tracked.request, RequestStatus.FINISHED_ABORTED)
        return self._output(tracked, [], "", [])

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ---- step ----------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Run one scheduling + forward step; return the requests that progressed."""
        scheduled, _ = self.scheduler.schedule()
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
        for i, row in enumerate(rows):
            tracked = self.requests[row.request.request_id]
            req, token = tracked.request, token_ids[i]
            req.append_output_token(token)
            lps = []
            if req.sampling_params.logprobs is not None:
                k = req.sampling_params.logprobs
                lps = [TokenLogprob(token, chosen_lp[i],
                                    dict(zip(top_ids[i][:k], top_vals[i][:k])) if k else {})]
            status, delta = self._check_stop(tracked, token)
            if status is not None:
                self.scheduler.finish(req, status)
                del self.requests[req.request_id]
            outputs.append(self._output(tracked, [token], delta, lps))
        return outputs

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
