"""The engine's measured prefill rate (baton/engine/prefill_rate.py): a windowed median,
nothing before the first step with prompt tokens, and carried to WorkerStats."""
from __future__ import annotations

import pytest

from baton import LLM, SamplingParams
from baton.engine.prefill_rate import MIN_STEP_TOKENS, PrefillRate
from baton.worker.wire import worker_stats
from protos import common_pb2


def test_nothing_until_a_step_with_enough_prompt_tokens():
    rate = PrefillRate()
    assert rate.tokens_per_s == 0.0
    rate.observe(MIN_STEP_TOKENS - 1, 0.001)   # a decode step's fixed cost, not a rate
    rate.observe(100, 0.0)                     # no time: ignored
    assert rate.tokens_per_s == 0.0 and rate.samples == 0
    rate.observe(500, 1.0)
    assert rate.tokens_per_s == pytest.approx(500.0)


def test_one_odd_step_does_not_move_the_rate():
    """The median of the window: a first step slowed 10x (or one sped up) is outvoted as
    soon as two steps agree; old steps leave the window."""
    rate = PrefillRate(window=3)
    rate.observe(256, 5.0)                     # 51 tokens/s: a one-off slow step
    rate.observe(256, 0.5)
    rate.observe(256, 0.5)                     # 512 tokens/s twice
    assert rate.tokens_per_s == pytest.approx(512.0)
    for _ in range(3):
        rate.observe(100, 1.0)                 # the rate really drops: the window follows
    assert rate.tokens_per_s == pytest.approx(100.0)


def test_the_engine_measures_its_prefill_and_reports_it(tiny_llama):
    llm = LLM(str(tiny_llama), num_blocks=64, block_size=4, dtype="float32")
    assert llm.engine.stats().prefill_tokens_per_s == 0.0
    prompt = list(range(3, 3 + 4 * MIN_STEP_TOKENS))
    llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0))
    stats = llm.engine.stats()
    assert stats.prefill_tokens_per_s > 0
    assert llm.engine.prefill_rate.samples == 1  # the prefill step; decode steps do not count
    msg = worker_stats(stats, common_pb2.WORKER_ROLE_DECODE, "w", common_pb2.KVLayout(), 1)
    assert msg.prefill_tokens_per_s == pytest.approx(stats.prefill_tokens_per_s, rel=1e-6)
