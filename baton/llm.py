"""Offline entry point in vLLM's shape: `LLM(model=...).generate(prompts, sampling_params)`."""
from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from baton.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from baton.engine.llm_engine import LLMEngine
from baton.outputs import CompletionOutput, RequestOutput
from baton.sampling_params import SamplingParams

Prompt = str | Sequence[int] | Mapping[str, Any]


def _prompt_ids(prompt: Prompt, tokenizer) -> tuple[str | None, list[int]]:
    """(text, token ids) of one prompt: a string, a sequence of token ids, or vLLM's prompt
    dicts, `{"prompt": text}` (TextPrompt) and `{"prompt_token_ids": [...]}` (TokensPrompt).
    Raises ValueError for anything else (a dict with neither key, ids that are not ints)."""
    if isinstance(prompt, Mapping):
        if "prompt_token_ids" in prompt:
            prompt = prompt["prompt_token_ids"]
        elif "prompt" in prompt:
            prompt = prompt["prompt"]
        else:
            raise ValueError("a prompt dict needs 'prompt' (text) or 'prompt_token_ids', got "
                             f"keys {sorted(prompt)}")
    if isinstance(prompt, str):
        return prompt, tokenizer.encode(prompt)
    ids = list(prompt)
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ValueError("prompt token ids must be ints; a prompt is a string, a list of token "
                         "ids, {'prompt': text} or {'prompt_token_ids': ids}")
    return None, ids


class LLM:
    """Runs prompts to completion on one in-process engine.

    Its KV pool, unless num_blocks or kv_cache_memory_bytes says otherwise, holds
    max_num_seqs requests of max_model_len tokens, within kv_memory_fraction of the memory
    free after the model loads (baton/engine/kv_budget.py).

    dtype: "auto" (the default: bfloat16 on CUDA and on CPUs with AVX512_BF16 or AMX, else
    float32; baton/dtypes.py), "float32" (the exactness reference), "bfloat16", "float16".
    device: "cpu" (default), "cuda" or "cuda:N"; enforce_eager: no CUDA graphs on CUDA.
    Keyword arguments not naming an EngineConfig field go to CacheConfig (block_size,
    num_blocks, kv_cache_memory_bytes, kv_memory_fraction, enable_prefix_caching,
    kv_host_tier_bytes, kv_disk_tier_dir, kv_disk_tier_bytes, kv_store_url, ...) or
    SchedulerConfig
    (max_num_batched_tokens, max_num_seqs, long_prefill_token_threshold, max_bypass_s).
    speculative_config: a SpeculativeConfig, or a dict of its fields (vLLM's
    `speculative_config={"method": "suffix", "num_speculative_tokens": 8}`); default off.
    Raises TypeError for an unknown keyword, ValueError for bad values.
    """

    def __init__(self, model: str = "smollm2-135m", dtype: str = "auto",
                 speculative_config: SpeculativeConfig | dict | None = None, **kwargs) -> None:
        cache_keys = CacheConfig.__dataclass_fields__.keys()
        sched_keys = SchedulerConfig.__dataclass_fields__.keys()
        engine_keys = {"max_model_len", "seed", "device", "enforce_eager"}
        unknown = set(kwargs) - set(cache_keys) - set(sched_keys) - engine_keys
        if unknown:
            raise TypeError(f"unknown LLM arguments: {sorted(unknown)}")
        cache = {"kv_pool_for_batch": True,  # a pool for max_num_seqs requests, no more
                 **{k: v for k, v in kwargs.items() if k in cache_keys}}
        if isinstance(speculative_config, dict):
            speculative_config = SpeculativeConfig(**speculative_config)
        config = EngineConfig(
            model=model, dtype=dtype, cache=CacheConfig(**cache),
            scheduler=SchedulerConfig(**{k: v for k, v in kwargs.items() if k in sched_keys}),
            speculative=speculative_config or SpeculativeConfig(),
            **{k: v for k, v in kwargs.items() if k in engine_keys},
        )
        self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text, a list of token ids, or vLLM's `{"prompt": text}` /
        `{"prompt_token_ids": ids}` dicts); outputs in prompt order.

        A single prompt may be passed bare. `sampling_params` is one for all or one per
        prompt (default: SamplingParams()). Raises ValueError on a bad prompt (nothing is
        left queued).
        """
        if isinstance(prompts, (str, Mapping)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        results: list[RequestOutput] = []
        pending: dict[str, tuple[RequestOutput, int]] = {}
        try:
            for prompt, p in zip(prompts, params):
                results.append(self._add(prompt, p, pending))
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    res, idx = pending[out.request_id]
                    comp = res.outputs[idx]
                    comp.token_ids.extend(out.new_token_ids)
                    comp.text += out.text_delta
                    if comp.logprobs is not None:
                        comp.logprobs.extend(out.logprobs)
                    if out.prompt_logprobs is not None and idx == 0:
                        res.prompt_logprobs = [None, *out.prompt_logprobs]
                    if out.finished:
                        comp.finish_reason, comp.stop_reason = out.finish_reason, out.stop_reason
                        if idx == 0:
                            res.num_cached_tokens = out.num_cached_tokens
                            res.cached_spans = out.cached_spans
        finally:  # left early (an error, Ctrl-C): nothing of this call stays in the engine
            for rid in pending:
                self.engine.abort_request(rid)
        return results

    def _add(self, prompt: Prompt, params: SamplingParams, pending) -> RequestOutput:
        text, ids = _prompt_ids(prompt, self.tokenizer)
        base = str(next(self._ids))
        res = RequestOutput(base, text, ids, [], num_cached_tokens=0)
        for i in range(params.n):
            sub = params if params.n == 1 else replace(  # the prompt's logprobs: once
                params, n=1, seed=None if params.seed is None else params.seed + i,
                prompt_logprobs=params.prompt_logprobs if i == 0 else None)
            rid = base if params.n == 1 else f"{base}-{i}"
            self.engine.add_request(rid, ids, sub)
            res.outputs.append(CompletionOutput(
                i, "", [], None, logprobs=[] if params.logprobs is not None else None))
            pending[rid] = (res, i)
        return res
