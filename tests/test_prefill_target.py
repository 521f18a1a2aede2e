"""prefill_target_tokens (baton/engine/prefill_target.py) on a bare Scheduler, fake clock; and
on a tiny real model, where it must not change what any request generates."""
from types import SimpleNamespace

import pytest

from baton import LLM, SamplingParams
from baton.engine.request import RequestStatus
from tests.test_scheduler import _admission_order, _drain, _req, _rows, _scheduler, _step


@pytest.fixture
def clock(monkeypatch) -> SimpleNamespace:
    c = SimpleNamespace(t=100.0)
    monkeypatch.setattr("baton.engine.scheduler.time", SimpleNamespace(monotonic=lambda: c.t))
    return c


def _arrive(s, clock, req):
    req.arrival_time = clock.t
    s.add(req)
    return req


def _three(target: int, clock, policy: str = "shortest_first"):
    s = _scheduler(32, policy=policy, prefill_target_tokens=target,
                   long_prefill_token_threshold=0)
    for rid, first in (("a", 3), ("b", 4), ("c", 5)):
        _arrive(s, clock, _req(rid, [first] + list(range(10, 21)), max_tokens=3))  # 12 tokens
    return s


@pytest.mark.parametrize("policy", ["fcfs", "shortest_first"])
def test_prompts_arriving_together_prefill_one_after_the_other(clock, policy):
    """Target 8: each 12-token prompt fills a step alone, so a gets its first token after one
    step of 12 tokens instead of one of 36; the decodes of those before ride along."""
    s = _three(8, clock, policy)
    assert _rows(_step(s)) == [("a", 12)]
    assert _rows(_step(s)) == [("a", 1), ("b", 12)]
    assert _rows(_step(s)) == [("a", 1), ("b", 1), ("c", 12)]
    _drain(s)
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_without_a_target_they_share_one_step(clock):
    s = _three(0, clock)
    assert _admission_order(s)[0] == ["a", "b", "c"]


def test_under_the_target_several_short_prompts_share_a_step(clock):
    """Target 40: a, b and c (12 each) all complete under it in one step. Target 30: a and b
    complete; c would get only the 6 tokens left of the target and not complete, so it
    starts the next step instead of delaying their first tokens. Target 20: b's 8 would not
    complete beside a's 12 either. The step's first row keeps its whole chunk (target 8)."""
    s = _three(40, clock)
    assert _rows(_step(s)) == [("a", 12), ("b", 12), ("c", 12)]
    s = _three(30, clock)
    assert _rows(_step(s)) == [("a", 12), ("b", 12)]
    assert _rows(_step(s)) == [("a", 1), ("b", 1), ("c", 12)]
    s = _three(20, clock)
    assert _rows(_step(s)) == [("a", 12)]
    s = _three(8, clock)
    assert _rows(_step(s)) == [("a", 12)]


def _long_then_short(clock, policy: str, **kw):
    """A 40-token cold prompt runs in chunks of 8; then a 10-token one arrives."""
    s = _scheduler(32, policy=policy, prefill_target_tokens=8, long_prefill_token_threshold=8,
                   **kw)
    long = _arrive(s, clock, _req("long", list(range(100, 140)), max_tokens=1))
    assert _rows(_step(s)) == [("long", 8)]
    clock.t += 1.0
    short = _arrive(s, clock, _req("short", [3] + list(range(10, 19)), max_tokens=1))
    return s, long, short


def test_a_running_prefill_yields_its_step_to_a_shorter_one(clock):
    """shortest_first: long (32 tokens left) sits out while short (10) runs, keeping its
    blocks, and resumes after; nothing is recomputed."""
    s, long, short = _long_then_short(clock, "shortest_first")
    blocks = s.kv.num_request_blocks("long")
    assert _rows(_step(s)) == [("short", 8)]  # the chunk cap
    assert long.status is RequestStatus.RUNNING and s.kv.num_request_blocks("long") == blocks
    assert _rows(_step(s)) == [("short", 2)]  # short completes: long's chunk waits a step
    assert short.status is RequestStatus.FINISHED_LENGTH
    assert _drain(s) == [[("long", 8)]] * 4
    assert long.num_computed_tokens == 40 and long.num_preemptions == 0
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_a_partial_chunk_never_delays_a_prefill_that_completes(clock):
    """A 40-token prompt in chunks of 8 is running when a 4-token one arrives: the short one
    completes alone in the next step (the long one's chunk would not complete beside it),
    then the long one resumes at its full chunk. Under the target both run beside decode
    rows, which never wait."""
    s = _scheduler(32, policy="shortest_first", prefill_target_tokens=16,
                   long_prefill_token_threshold=8)
    _arrive(s, clock, _req("d", [1, 2], max_tokens=6))
    long = _arrive(s, clock, _req("long", list(range(100, 140)), max_tokens=1))
    assert _rows(_step(s)) == [("d", 2)]  # d completes: long's chunk starts the next step
    assert _rows(_step(s)) == [("d", 1), ("long", 8)]
    _arrive(s, clock, _req("short", [3, 4, 5, 6], max_tokens=2))
    assert _rows(_step(s)) == [("d", 1), ("short", 4)]
    assert _rows(_step(s)) == [("d", 1), ("long", 8), ("short", 1)]
    assert long.num_preemptions == 0
    _drain(s)
    assert long.num_computed_tokens == 40 and s.kv.num_free_blocks == s.kv.num_blocks


def test_an_old_partial_prefill_still_runs_beside_a_completing_one(clock):
    """The starvation bound holds: past max_prefill_wait_s the long prompt does not count
    toward the target, so it runs its chunk beside the short one that completes."""
    s, long, short = _long_then_short(clock, "shortest_first", max_prefill_wait_s=2.0)
    clock.t += 1.5  # long is 2.5 s old, short 1.5 s
    assert _rows(_step(s)) == [("long", 8), ("short", 8)]
    assert _rows(_step(s)) == [("long", 8), ("short", 2)]
    assert short.status is RequestStatus.FINISHED_LENGTH


def test_fcfs_keeps_the_running_prefill_first(clock):
    s, long, short = _long_then_short(clock, "fcfs")
    assert _admission_order(s) == [[], [], [], [], ["short"], []]
    assert long.status is short.status is RequestStatus.FINISHED_LENGTH


def test_an_old_prefill_is_never_paused_and_runs_beside_the_target(clock):
    """Past max_prefill_wait_s since arrival the long prompt neither yields nor counts:
    short is admitted beside it every step."""
    s, long, short = _long_then_short(clock, "shortest_first", max_prefill_wait_s=5.0)
    clock.t += 4.5  # long is 5.5 s old, short 4.5 s
    assert _rows(_step(s)) == [("long", 8), ("short", 8)]
    assert _rows(_step(s)) == [("long", 8), ("short", 2)]


def test_old_prefills_run_beside_the_target_one_a_step_oldest_first(clock):
    """Three cold prompts all past max_prefill_wait_s (an overload): one of them a step
    advances beside the young short one, the oldest first, so the step stays one chunk
    plus the target instead of every old prompt's chunk at once."""
    s = _scheduler(64, policy="shortest_first", prefill_target_tokens=8,
                   long_prefill_token_threshold=8, max_prefill_wait_s=5.0)
    olds = [_arrive(s, clock, _req(f"old{i}", [3 + i] + list(range(100, 115)), max_tokens=1))
            for i in range(3)]  # 16 tokens each
    clock.t += 6.0
    _arrive(s, clock, _req("short", [9] + list(range(10, 17)), max_tokens=1))
    assert _rows(_step(s)) == [("old0", 8), ("short", 8)]
    assert _rows(_step(s)) == [("old0", 8)]
    assert _rows(_step(s)) == [("old1", 8)]
    assert _drain(s) == [[("old1", 8)], [("old2", 8)], [("old2", 8)]]
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in olds)
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_a_paused_prefill_runs_when_the_shorter_one_cannot_start(clock):
    """max_num_seqs=1: short heads the queue but cannot be admitted beside long, so long does
    not sit out for it (no step without progress); short starts when long is done."""
    s, long, short = _long_then_short(clock, "shortest_first", max_num_seqs=1)
    assert _admission_order(s) == [[], [], [], [], ["short"], []]
    assert long.num_computed_tokens == 40 and s.kv.num_free_blocks == s.kv.num_blocks


def test_decode_rows_are_never_held_back(clock):
    """A decode (one token left) is not a prefill row: it runs every step at any target."""
    s = _scheduler(32, prefill_target_tokens=1, long_prefill_token_threshold=0)
    _arrive(s, clock, _req("d", [3, 4, 5], max_tokens=4))
    _step(s)
    _arrive(s, clock, _req("p", [6] + list(range(10, 17)), max_tokens=1))
    assert _rows(_step(s)) == [("d", 1), ("p", 8)]
    assert _rows(_step(s)) == [("d", 1)]


def test_outputs_equal_a_run_without_the_target(tiny_llama):
    """The same prompts (one long enough to be chunked and paused) with the target on and
    off generate the same greedy tokens, and the pool is whole after."""
    p = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [list(range(3, 70)), [5, 6, 7, 8, 9], list(range(100, 130)), [11] * 20]
    outs = {}
    for target in (0, 16):
        llm = LLM(str(tiny_llama), num_blocks=64, block_size=4, prefill_target_tokens=target,
                  long_prefill_token_threshold=16, policy="shortest_first", dtype="float32")
        outs[target] = [o.output_token_ids for o in llm.generate(prompts, p)]
        assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
    assert outs[16] == outs[0]
