"""Time slicing of a full pool with a KV tier (baton/engine/time_slice.py): a request
waiting for pool space preempts a long-running decode, whose KV comes back from the pool or
the tier as a prefix hit; never without a tier; greedy outputs unchanged."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from baton import LLM, SamplingParams
from baton.config import SchedulerConfig
from baton.engine.kv_cache import KVCacheManager
from baton.engine.kv_tier import KVTier
from baton.engine.request import RequestStatus
from baton.engine.scheduler import Scheduler
from tests.reference import hf_greedy
from tests.test_scheduler import _req, _rows, _step

BS = 4
SLICE = 2.0


@pytest.fixture
def clock(monkeypatch) -> SimpleNamespace:
    c = SimpleNamespace(t=100.0)
    monkeypatch.setattr("baton.engine.scheduler.time", SimpleNamespace(monotonic=lambda: c.t))
    return c


def _scheduler(num_blocks: int, tier: bool) -> Scheduler:
    kv_tier = KVTier(torch.zeros(num_blocks, 1, 2, BS, 1, 2), host_bytes=1 << 20) \
        if tier else None
    return Scheduler(SchedulerConfig(time_slice_s=SLICE, max_bypass_s=0.0),
                     KVCacheManager(num_blocks, BS, tier=kv_tier))


def _two(clock, tier: bool):
    """10 blocks: a (20-token prompt, 12 out) runs; b (24 tokens) cannot fit beside."""
    s = _scheduler(10, tier)
    a = _req("a", list(range(10, 30)), max_tokens=12)
    s.add(a)
    assert _rows(_step(s)) == [("a", 20)]
    b = _req("b", list(range(50, 74)), max_tokens=3)
    s.add(b)
    for _ in range(3):
        clock.t += 0.5
        assert _rows(_step(s)) == [("a", 1)]  # b waits: 6 + 6 blocks > 10
    return s, a, b


def test_a_waiting_request_takes_a_slice_and_the_victim_comes_back_as_a_hit(clock):
    s, a, b = _two(clock, tier=True)
    clock.t += 1.0                              # b blocked 2 s, a admitted 3.5 s ago
    assert _rows(_step(s)) == [("b", 24)]       # a preempted in the same step, b admitted
    assert a.status is RequestStatus.PREEMPTED and s.waiting[0] is a
    assert s.totals.num_preemptions == s.totals.num_time_slices == 1
    while b.status is RequestStatus.RUNNING:    # b is short: done within its slice
        _step(s)
    rows = _rows(_step(s))
    assert rows[0][0] == "a" and rows[0][1] <= BS  # a's full blocks were a hit: ≤ a block
    assert a.num_cached_tokens == 0             # cached counts only never-computed tokens
    while s.has_unfinished():
        _step(s)
    assert len(a.output_token_ids) == 12 and s.kv.num_free_blocks == 10


def test_the_slice_protects_a_request_admitted_recently(clock):
    """b, admitted by a slice, is not preempted back before it has run SLICE seconds."""
    s, a, b = _two(clock, tier=True)
    b.max_tokens = 12                            # b is long too now
    clock.t += 1.0
    assert _rows(_step(s)) == [("b", 24)]
    for _ in range(3):
        clock.t += 0.6                           # a waits ≥ 2 s, b runs < 2 s: no slice
        assert _rows(_step(s)) == [("b", 1)]
    clock.t += 1.0                               # a blocked 2.2 s (since the first step it
                                                 # found no room), b ran 2.8 s: a's turn
    rows = _rows(_step(s))
    assert rows[0][0] == "a" and b.status is RequestStatus.PREEMPTED


def test_no_slicing_without_a_tier(clock):
    s, a, b = _two(clock, tier=False)
    for _ in range(4):
        clock.t += 1.0
        assert _rows(_step(s)) == [("a", 1)]  # preempting would recompute a: b waits
    assert a.num_preemptions == 0


def test_greedy_outputs_unchanged_when_requests_slice_every_step(tiny_llama):
    """slice 1 ns: whichever waits preempts the other every step, through the host tier;
    fp32 greedy outputs equal transformers' and the pool is whole after."""
    prompts = [list(range(3 + 40 * k, 43 + 40 * k)) for k in range(3)]  # 40 tokens each
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm = LLM(str(tiny_llama), block_size=BS, num_blocks=24, time_slice_s=1e-9,
              kv_host_tier_bytes=1 << 22, dtype="float32")
    outs = llm.generate(prompts, params)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(tiny_llama, p, 12)
    assert llm.engine.scheduler.totals.num_time_slices > 0
    assert llm.engine.kv.num_free_blocks == 24
