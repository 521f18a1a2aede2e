"""Scheduling decisions must not change what a request generates (tiny real models).

The policies themselves (budgets, chunk caps, admission, preemption) are pinned without a
model in test_scheduler.py; here the same situations run through LLM / LLMEngine and the
outputs are compared with a run where the policy has nothing to decide.
"""
from baton import LLM, SamplingParams


def test_seeded_request_same_alone_and_in_batch(tiny_qwen2):
    llm = LLM(str(tiny_qwen2), num_blocks=64, dtype="float32")
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12,
                            ignore_eos=True)
    alone = llm.generate([[5, 6, 7, 8]], seeded)[0].output_token_ids
    other = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    mixed = llm.generate([[9, 9, 9], [5, 6, 7, 8], [4, 4]], [other, seeded, other])
    assert mixed[1].output_token_ids == alone


def test_shared_prefix_outputs_equal_a_run_without_prefix_caching(tiny_llama):
    """An agent's fan-out (test_scheduler: the later ones wait a step and take the 48-token
    prefix as a cache hit): the outputs are those of a run without prefix caching."""
    prefix = list(range(3, 51))  # 3 blocks of 16
    prompts = [prefix + [60, 61, 62], prefix + [70, 71], prefix + [80]]
    p = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm = LLM(str(tiny_llama), num_blocks=64, dtype="float32")
    shared = llm.generate(prompts, p)
    # the first one scheduled (the shortest: shortest_first) computes the prefix
    assert sorted(o.num_cached_tokens for o in shared) == [0, 48, 48]
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
    plain = LLM(str(tiny_llama), num_blocks=64, enable_prefix_caching=False,
                dtype="float32").generate(prompts, p)
    assert [o.output_token_ids for o in shared] == [o.output_token_ids for o in plain]
    assert [o.num_cached_tokens for o in plain] == [0, 0, 0]


def test_prompts_that_cannot_both_fit_give_their_outputs_alone(tiny_llama):
    """Two chunked prompts that each fit the pool alone but not together (test_scheduler:
    the second waits for room for its whole prompt, no preemption): each generates what it
    generates alone."""
    kw = dict(block_size=4, num_blocks=24, long_prefill_token_threshold=8,
              max_num_batched_tokens=16)
    p = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = [[3] + list(range(10, 69)), [4] + list(range(100, 159))]  # 15 blocks each
    alone = [LLM(str(tiny_llama), **kw).generate([q], p)[0].output_token_ids for q in prompts]
    e = LLM(str(tiny_llama), **kw).engine
    reqs = [e.add_request(str(i), q, p) for i, q in enumerate(prompts)]
    while e.has_unfinished_requests():
        e.step()
    assert [r.output_token_ids for r in reqs] == alone
    assert [r.num_preemptions for r in reqs] == [0, 0]
    assert e.kv.num_free_blocks == e.kv.num_blocks
