"""Speculative decoding through the engine (tiny random models): outputs with speculation on
equal those with it off (greedy: token for token; seeded: the same tokens; unseeded: the
same distribution), with penalties, logit bias, stop strings, max_tokens, logprobs, n > 1 and
grammars; the KV pool is whole after and the prefix cache holds exactly the same blocks."""
from __future__ import annotations

import json

import jsonschema
import pytest

from baton import LLM, SamplingParams
from baton.sampling_params import StructuredOutput, StructuredOutputKind
from tests.reference import hf_greedy

SUFFIX = {"method": "suffix", "num_speculative_tokens": 6}
NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
CODE = list(range(50, 90))
# repetition to draft from (a span of the prompt restarted at its end), and none
PROMPTS = [[5, 6] + CODE + [7] + CODE[:5], list(range(3, 60)), [9] * 30, [300, 301, 302]]


def _llm(folder, spec=None, **kw) -> LLM:
    # fp32 named: these compare token for token with transformers' fp32 model and with spec
    # off (auto is bf16 on CPUs with AVX512_BF16, where neither comparison is exact)
    return LLM(str(folder), num_blocks=kw.pop("num_blocks", 160), block_size=4,
               speculative_config=spec, dtype=kw.pop("dtype", "float32"), **kw)


def _both(folder, prompts, params, spec=SUFFIX, **kw):
    """(outputs off, outputs on, the engine that speculated)."""
    off = _llm(folder, **kw).generate(prompts, params)
    on_llm = _llm(folder, spec, **kw)
    on = on_llm.generate(prompts, params)
    engine = on_llm.engine
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert engine.spec.drafter.num_tracked == 0
    return off, on, engine


def _accepted(engine) -> int:
    t = engine.scheduler.totals
    assert t.spec_drafts > 0 and t.spec_draft_tokens >= t.spec_accepted_tokens
    return t.spec_accepted_tokens


@pytest.mark.parametrize("spec", [SUFFIX, NGRAM], ids=["suffix", "ngram"])
def test_greedy_outputs_identical_and_equal_transformers(tiny_llama, spec):
    p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    off, on, engine = _both(tiny_llama, PROMPTS, p, spec)
    assert [o.output_token_ids for o in on] == [o.output_token_ids for o in off]
    assert [o.text for o in on] == [o.text for o in off]
    assert _accepted(engine) > 0
    t = engine.scheduler.totals
    assert t.spec_accepted_tokens < t.spec_draft_tokens  # some drafts were rejected too
    for prompt, out in zip(PROMPTS[:2], on[:2]):
        assert out.output_token_ids == hf_greedy(tiny_llama, prompt, 24)


def test_seeded_sampling_gives_the_same_tokens(tiny_qwen2):
    """One generator draw per output position whatever was drafted: the same tokens."""
    params = [SamplingParams(temperature=t, top_p=tp, top_k=tk, seed=s, max_tokens=20,
                             ignore_eos=True)
              for t, tp, tk, s in [(0.7, 1.0, -1, 1), (1.0, 0.9, -1, 2), (0.5, 1.0, 20, 3),
                                   (0.3, 0.8, 5, 4)]]
    off, on, engine = _both(tiny_qwen2, PROMPTS, params)
    assert [o.output_token_ids for o in on] == [o.output_token_ids for o in off]
    assert _accepted(engine) > 0


def test_penalties_logit_bias_and_logprobs_behave_as_without(tiny_llama):
    params = [
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, repetition_penalty=1.3,
                       logprobs=3),
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, frequency_penalty=0.5,
                       presence_penalty=0.3, logprobs=0),
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                       logit_bias={CODE[6]: 5.0, CODE[7]: -2.0}),
        SamplingParams(temperature=0.8, seed=9, max_tokens=20, ignore_eos=True,
                       repetition_penalty=1.1, logprobs=2),
    ]
    off, on, engine = _both(tiny_llama, PROMPTS, params)
    assert [o.output_token_ids for o in on] == [o.output_token_ids for o in off]
    for a, b in zip(off, on):
        for x, y in zip(a.outputs[0].logprobs or [], b.outputs[0].logprobs or []):
            assert (x.token_id, x.rank, list(x.top)) == (y.token_id, y.rank, list(y.top))
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
        assert len(a.outputs[0].logprobs or []) == len(b.outputs[0].logprobs or [])
    assert len(on[0].outputs[0].logprobs) == 20 and len(on[0].outputs[0].logprobs[0].top) == 3
    assert _accepted(engine) > 0


def test_stop_strings_max_tokens_and_n_behave_as_without(tiny_llama):
    greedy = _llm(tiny_llama).generate(PROMPTS[:1], SamplingParams(
        temperature=0, max_tokens=24, ignore_eos=True))[0]
    stop = greedy.text[len(greedy.text) // 2:][:3]  # ends the output mid-row, most likely
    params = [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]),
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                       stop_token_ids=[greedy.output_token_ids[9]]),
        SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=16, ignore_eos=True),
    ]
    off, on, engine = _both(tiny_llama, PROMPTS[:1] * 4, params)
    for a, b in zip(off, on):
        assert [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in a.outputs] == \
            [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in b.outputs]
    assert on[0].finish_reason == "stop" and on[0].outputs[0].stop_reason == stop
    assert len(on[1].output_token_ids) == 7 and on[2].finish_reason == "stop"
    assert len(on[3].outputs) == 3
    assert _accepted(engine) > 0


SCHEMA = {"type": "object",
          "properties": {"city": {"enum": ["Paris", "Tokyo", "Lima"]},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["city", "n"], "additionalProperties": False}
SPEC = StructuredOutput(StructuredOutputKind.JSON_SCHEMA, json.dumps(SCHEMA))


def test_structured_outputs_behave_as_without(tiny_llama):
    """The prompt holds valid JSON to draft from; drafts are cut to what the grammar accepts
    and verified under its masks: the same (valid) outputs."""
    tok = LLM(str(tiny_llama), num_blocks=8, block_size=4).tokenizer
    sample = tok.encode('{"city": "Lima", "n": 12}{"city": "Lima", "n": 12}')
    prompt = list(range(5, 20)) + sample
    params = [SamplingParams(temperature=0, max_tokens=60, structured_output=SPEC),
              SamplingParams(temperature=1.0, seed=4, max_tokens=60, structured_output=SPEC)]
    off, on, engine = _both(tiny_llama, [prompt, prompt], params)
    assert [o.output_token_ids for o in on] == [o.output_token_ids for o in off]
    for o in on:
        jsonschema.validate(json.loads(o.text), SCHEMA)
        assert o.finish_reason == "stop"
    assert engine.scheduler.totals.spec_draft_tokens > 0


def test_prefix_cache_holds_the_same_blocks_after_rejections(tiny_llama):
    """Rejected drafts' slots are never hashed: after the same two-turn session with
    speculation off and on, the prefix caches hold exactly the same block hashes, the second
    turn hits the same number of tokens, and every block is free."""
    p = SamplingParams(temperature=0, max_tokens=21, ignore_eos=True)
    caches, hits = [], []
    for spec in (None, SUFFIX):
        llm = _llm(tiny_llama, spec, num_blocks=200)
        first = llm.generate([PROMPTS[0]], p)[0]
        turn2 = PROMPTS[0] + first.output_token_ids + [7, 8, 9] + CODE[:4]
        hits.append(llm.generate([turn2], p)[0].num_cached_tokens)
        caches.append(set(llm.engine.kv.cached_block_hashes()))
        kv = llm.engine.kv
        assert kv.num_free_blocks == kv.num_blocks
        if spec:
            t = llm.engine.scheduler.totals
            assert 0 < t.spec_accepted_tokens < t.spec_draft_tokens
    assert caches[0] == caches[1] and hits[0] == hits[1] > 0


def test_a_small_budget_and_pool_only_drop_drafts(tiny_llama):
    """max_num_batched_tokens 3 leaves each decode row at most 2 drafts; a pool just big
    enough for the requests never preempts anyone for drafts: the same outputs."""
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = PROMPTS[:2]
    kw = dict(max_num_batched_tokens=80, num_blocks=40)
    off, on, engine = _both(tiny_llama, prompts, p, **kw)
    assert [o.output_token_ids for o in on] == [o.output_token_ids for o in off]
    assert engine.scheduler.totals.num_preemptions == 0
    one = _llm(tiny_llama, SUFFIX, max_num_batched_tokens=3, long_prefill_token_threshold=3)
    out = one.generate(prompts, p)
    assert [o.output_token_ids for o in out] == [o.output_token_ids for o in off]
    assert len(one.engine.scheduler.totals.spec_accepted_per_pos) <= 2


@pytest.mark.skipif(not __import__("kernels.cpu_verify").cpu_verify.available(),
                    reason="native extension did not build here")
def test_the_fused_cpu_decode_step_takes_speculative_rows(monkeypatch, tiny_llama):
    """The fused native decode step (forced on: AVX-512 machines take it by default) runs
    steps with drafted rows through kernels.cpu_verify: transformers' greedy tokens."""
    from kernels import cpu_verify
    llm = _llm(tiny_llama, SUFFIX)
    llm.engine.model.fused_decode = True
    calls = []
    native = cpu_verify.verify_attention
    monkeypatch.setattr(cpu_verify, "verify_attention",
                        lambda *a, **k: calls.append(1) or native(*a, **k))
    p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(PROMPTS[:3], p)
    for prompt, out in zip(PROMPTS[:3], outs):
        assert out.output_token_ids == hf_greedy(tiny_llama, prompt, 24)
    assert calls and _accepted(llm.engine) > 0


def test_kv_tiers_only_ever_see_accepted_tokens(tiny_llama):
    """Requests preempted into a host tier every step (time slices of 1 ns) while drafting:
    transformers' greedy tokens, and every block the pool and the tier hold hashes tokens of
    some request's final sequence (a rejected draft never reaches a hash)."""
    from baton.block_hash import hash_block_tokens
    prompts = [[5 + k, 6] + CODE + [7] + CODE[:5 + k] for k in range(3)]
    p = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    llm = _llm(tiny_llama, SUFFIX, num_blocks=40, time_slice_s=1e-9,
               kv_host_tier_bytes=1 << 22)
    outs = llm.generate(prompts, p)
    for prompt, out in zip(prompts, outs):
        assert out.output_token_ids == hf_greedy(tiny_llama, prompt, 16)
    kv, totals = llm.engine.kv, llm.engine.scheduler.totals
    assert totals.num_time_slices > 0 and 0 < totals.spec_accepted_tokens < \
        totals.spec_draft_tokens
    valid = set()
    for prompt, out in zip(prompts, outs):
        valid.update(hash_block_tokens(prompt + out.output_token_ids, 4, [], kv.hash_fn))
    tier = set(kv.tier.host.index)
    assert tier and set(kv.pool.cached) | tier <= valid
    assert kv.num_free_blocks == kv.num_blocks


def test_min_tokens_bans_stop_tokens_at_drafted_positions_as_without_drafts(tiny_llama):
    """min_tokens' ban (eos, stop_token_ids) holds at every drafted position before
    min_tokens and at none after: outputs equal speculation off."""
    plain = _llm(tiny_llama).generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24,
                                                              ignore_eos=True))
    for prompt, out in zip(PROMPTS, plain):
        stop = out.output_token_ids[2]  # the model writes it early
        p = SamplingParams(temperature=0, max_tokens=24, min_tokens=10, stop_token_ids=[stop])
        off, on, engine = _both(tiny_llama, [prompt], p)
        assert on[0].output_token_ids == off[0].output_token_ids
        assert stop not in off[0].output_token_ids[:10]
