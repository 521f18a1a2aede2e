"""Scheduler policies on a real tiny engine: budgets, chunk caps, skipping a blocked head."""
from baton import LLM, SamplingParams
from baton.engine.request import RequestStatus


def _engine(folder, **kw):
    return LLM(str(folder), **kw).engine


def test_token_budget_and_per_request_chunk_cap(tiny_llama):
    e = _engine(tiny_llama, block_size=4, num_blocks=64, max_num_batched_tokens=20,
                long_prefill_token_threshold=8)
    p = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for i in range(3):  # distinct first tokens: no shared prefix to wait for
        e.add_request(str(i), [3 + i] + list(range(10, 39)), p)
    scheduled, _ = e.scheduler.schedule()
    assert [s.num_new_tokens for s in scheduled] == [8, 8, 4]  # cap 8, budget 20


def test_running_decodes_are_not_stalled_by_a_long_prompt(tiny_llama):
    e = _engine(tiny_llama, block_size=4, num_blocks=128, max_num_batched_tokens=16,
                long_prefill_token_threshold=8)
    p = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    e.add_request("short", [5, 6, 7], p)
    e.step()
    e.add_request("long", list(range(3, 200)), p)
    decisions = []
    real = e.scheduler.schedule

    def recording():
        scheduled, preempted = real()
        decisions.append({s.request.request_id: s.num_new_tokens for s in scheduled})
        return scheduled, preempted

    e.scheduler.schedule = recording
    for _ in range(5):
        e.step()
    for by_id in decisions:
        assert by_id["short"] == 1 and by_id["long"] <= 8


def test_blocked_head_does_not_block_smaller_requests(tiny_llama):
    e = _engine(tiny_llama, block_size=4, num_blocks=12, long_prefill_token_threshold=0,
                max_num_batched_tokens=512)
    p = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    e.add_request("hog", list(range(3, 23)), p)  # takes 5 blocks, keeps running
    e.step()
    e.add_request("huge", [9] * 37, p)  # needs 10 blocks: cannot fit now
    e.add_request("small", [5, 6, 7], p)
    scheduled, _ = e.scheduler.schedule()
    names = [s.request.request_id for s in scheduled]
    assert "small" in names and "huge" not in names
    assert e.get_request("huge").status == RequestStatus.WAITING
    while e.has_unfinished_requests():
        e.step()
    assert e.kv.num_free_blocks == e.kv.num_blocks


def test_seeded_request_same_alone_and_in_batch(tiny_qwen2):
    llm = LLM(str(tiny_qwen2), num_blocks=64)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12,
                            ignore_eos=True)
    alone = llm.generate([[5, 6, 7, 8]], seeded)[0].output_token_ids
    other = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    mixed = llm.generate([[9, 9, 9], [5, 6, 7, 8], [4, 4]], [other, seeded, other])
    assert mixed[1].output_token_ids == alone


def test_blocked_head_is_not_starved_after_max_bypass(tiny_llama):
    """Case 6 without starvation: once the huge request has been passed by for max_bypass_s,
    later small requests wait behind it; it runs as soon as the hog frees its blocks."""
    e = _engine(tiny_llama, block_size=4, num_blocks=12, long_prefill_token_threshold=0,
                max_num_batched_tokens=512, max_bypass_s=0.0)
    p = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    e.add_request("hog", list(range(3, 23)), p)  # takes 5-6 blocks while it runs
    e.step()
    e.add_request("huge", [9] * 37, p)  # needs 10 blocks: cannot fit now
    e.add_request("small", [5, 6, 7], p)
    order = []
    while e.has_unfinished_requests():
        scheduled = {r.request_id for r in e.step()}
        order.extend(sorted(scheduled - set(order)))
    assert order.index("huge") < order.index("small")
    assert e.kv.num_free_blocks == e.kv.num_blocks



def test_requests_sharing_an_uncached_prefix_compute_it_once(tiny_llama):
    """An agent's fan-out: prompts with one uncached 48-token prefix arrive together. The later
    ones wait one step and take the prefix as a cache hit instead of computing it again; the
    outputs are those of a run without prefix caching."""
    prefix = list(range(3, 51))  # 3 blocks of 16
    prompts = [prefix + [60, 61, 62], prefix + [70, 71], prefix + [80]]
    p = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm = LLM(str(tiny_llama), num_blocks=64)
    shared = llm.generate(prompts, p)
    assert [o.num_cached_tokens for o in shared] == [0, 48, 48]
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
    plain = LLM(str(tiny_llama), num_blocks=64, enable_prefix_caching=False).generate(prompts, p)
    assert [o.output_token_ids for o in shared] == [o.output_token_ids for o in plain]
    assert [o.num_cached_tokens for o in plain] == [0, 0, 0]


def test_prompts_that_cannot_both_fit_are_not_admitted_to_thrash(tiny_llama):
    """Two chunked prompts that each fit the pool alone but not together: the second waits
    for room for its whole prompt instead of being admitted, preempted when the first grows
    into its blocks, and recomputed."""
    kw = dict(block_size=4, num_blocks=24, long_prefill_token_threshold=8,
              max_num_batched_tokens=16)
    p = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = [[3] + list(range(10, 69)), [4] + list(range(100, 159))]  # 15 blocks each
    alone = [LLM(str(tiny_llama), **kw).generate([q], p)[0].output_token_ids for q in prompts]
    llm = LLM(str(tiny_llama), **kw)
    real = llm.engine.scheduler.schedule
    computed, preemptions = [], []

    def recording():
        scheduled, preempted = real()
        computed.extend(s.num_new_tokens for s in scheduled if s.num_new_tokens > 1)
        preemptions.extend(r.request_id for r in preempted)
        return scheduled, preempted

    llm.engine.scheduler.schedule = recording
    both = [o.output_token_ids for o in llm.generate(prompts, p)]
    assert preemptions == []
    assert sum(computed) == 120  # every prompt token once
    assert both == alone
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_whole_prompt_check_counts_cache_hits(tiny_llama):
    """A long prompt whose prefix is cached needs blocks only for its uncached tail: it is
    admitted beside a running request although its whole length would not fit again."""
    e = _engine(tiny_llama, block_size=4, num_blocks=24, long_prefill_token_threshold=8,
                max_num_batched_tokens=16)
    p = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    turn1 = [3] + list(range(10, 65))  # 56 tokens: 14 blocks
    e.add_request("t1", turn1, p)
    while e.has_unfinished_requests():
        e.step()
    e.add_request("other", [4] + list(range(100, 119)), SamplingParams(
        temperature=0, max_tokens=20, ignore_eos=True))  # 5 blocks, keeps decoding
    e.step()
    e.add_request("t2", turn1 + [70, 71, 72, 73, 74, 75, 76, 77], p)  # 16 blocks, 14 cached
    scheduled, preempted = e.scheduler.schedule()
    assert "t2" in [s.request.request_id for s in scheduled] and not preempted
    while e.has_unfinished_requests():
        e.step()
    assert e.kv.num_free_blocks == e.kv.num_blocks
