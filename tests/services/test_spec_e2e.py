"""Speculative decoding on the disaggregated path: a decode worker that drafts (its prefill
worker does not) gives the same outputs as one that does not, for remote and local prefills,
seeded sampling with n > 1, stop strings, penalties, grammars and a session's second turn;
every pool is whole after, and the drafting worker reports vLLM's spec_decode counters."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from baton.config import SpeculativeConfig
from baton.sampling_params import SamplingParams, StructuredOutput, StructuredOutputKind
from tests.reference import hf_greedy
from tests.services.helpers import FORCE_REMOTE, engine_config, pools_whole

pytestmark = pytest.mark.asyncio

CODE = list(range(50, 90))
REMOTE = [5, 6] + CODE + [7] + CODE[:5]  # 48 tokens: above decode's --min-remote-tokens 16
LOCAL = [5, 6] + CODE[:6] + [7] + CODE[:3]  # 12 tokens: prefilled on the decode worker
SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Lima"]},
                                           "n": {"type": "integer", "minimum": 0,
                                                 "maximum": 99}},
          "required": ["city", "n"], "additionalProperties": False}


async def _servers(cluster, model):
    prefill = await cluster.prefill(model, "grpc")
    plain = await cluster.decode(model, "grpc", prefill.address, **FORCE_REMOTE)
    spec = await cluster.decode(model, "grpc", prefill.address, engine=replace(
        engine_config(model), speculative=SpeculativeConfig(method="suffix",
                                                            num_speculative_tokens=5)),
        **FORCE_REMOTE)
    return prefill, plain, spec, cluster.client(plain, prefill), cluster.client(spec, prefill)


async def _same(a, b, prompt, params, **kw):
    ra, rb = await a.generate(prompt, params, **kw), await b.generate(prompt, params, **kw)
    assert rb.tokens == ra.tokens and rb.text == ra.text
    assert [f.finish_reason for f in rb.finished.values()] == \
        [f.finish_reason for f in ra.finished.values()]
    return rb


async def test_drafting_decode_worker_gives_the_same_outputs(cluster, model):
    prefill, plain, spec, a, b = await _servers(cluster, model)
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for prompt in (REMOTE, LOCAL):
        res = await _same(a, b, prompt, greedy)
        assert res.output == hf_greedy(model, prompt, 20)
        assert res.fin.timings.remote_prefill is (prompt is REMOTE)
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=11, n=2, max_tokens=16,
                            ignore_eos=True)
    assert len((await _same(a, b, REMOTE, seeded)).tokens) == 2
    text = (await b.generate(REMOTE, greedy)).text[0]
    await _same(a, b, REMOTE, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                             stop=[text[len(text) // 2:][:2]],
                                             repetition_penalty=1.2, presence_penalty=0.2))
    grammar = SamplingParams(temperature=0, max_tokens=60, structured_output=StructuredOutput(
        StructuredOutputKind.JSON_SCHEMA, json.dumps(SCHEMA)))
    await _same(a, b, REMOTE, grammar)
    turn1 = await _same(a, b, REMOTE, greedy, session_id="s1")
    turn2 = REMOTE + turn1.output + [7, 8] + CODE[:4]
    await _same(a, b, turn2, greedy, session_id="s1")
    await pools_whole(prefill, plain, spec)
    reg = spec.metrics.registry
    drafts = reg.get_sample_value("vllm:spec_decode_num_drafts_total",
                                  {"model_name": spec.config.served_model_name or
                                   str(model).rstrip("/").rsplit("/", 1)[-1], "engine": "0"})
    counts = spec.engine.counts()
    assert counts.spec_drafts > 0 and counts.spec_accepted_tokens > 0
    assert drafts == counts.spec_drafts
    assert plain.engine.counts().spec_drafts == 0 and prefill.engine.counts().spec_drafts == 0
