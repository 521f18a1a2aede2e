"""EngineStats (baton/engine/stats.py): what the engine reports of its queues."""
from __future__ import annotations

from baton import LLM, SamplingParams


def test_a_waiting_requests_queue_tokens_leave_out_its_cached_prefix(tiny_llama):
    """num_waiting_tokens (the P/D decider's local queue, a prefill worker's queue in
    WorkerStats) counts a waiting request's uncached tokens: its prefix hit is applied only
    when it is scheduled, and counted whole an agent's continuation turn (a short suffix after
    a long cached prefix) weighed its entire prompt."""
    llm = LLM(str(tiny_llama), num_blocks=64, block_size=4, dtype="float32")  # small pool
    prefix = list(range(3, 43))                                   # 40 tokens: 10 blocks
    llm.generate([prefix], SamplingParams(max_tokens=1, temperature=0))
    engine = llm.engine
    engine.add_request("turn2", prefix + list(range(100, 110)), SamplingParams(max_tokens=1))
    assert engine.stats().num_waiting_tokens == 10                # 50 − the 40 cached
    engine.add_request("cold", list(range(200, 230)), SamplingParams(max_tokens=1))
    assert engine.stats().num_waiting_tokens == 10 + 30
