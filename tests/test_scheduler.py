"""Scheduler policies on a bare Scheduler + KVCacheManager: no model, no engine.

`_step` plays the engine's bookkeeping after `schedule()` (llm_engine.LLMEngine.step): each
row's tokens become computed, its full blocks are cached, a row that completes its prompt
gets a fake sampled token, and a request with max_tokens outputs is finished. Block ids are
deterministic (the free queue starts 0, 1, 2, ...; see kv_cache.BlockPool), so they are pinned.
Output-comparing tests on a real tiny model live in test_engine_scheduling.py.
"""
from types import SimpleNamespace

import pytest

from baton.config import SchedulerConfig
from baton.engine.kv_cache import KVCacheManager
from baton.engine.request import Request, RequestStatus
from baton.engine.sched_output import SchedulerOutput
from baton.engine.scheduler import Scheduler
from baton.sampling_params import SamplingParams

FAKE_TOKEN = 1  # what the fake sampler "draws" for every row that completes its prompt
# Tests of mechanisms defined in arrival order (admission bypass, fan-out, preemption order)
# name it: the production default is shortest_first with a 256-token prefill target.
ARRIVAL_ORDER = {"policy": "fcfs", "prefill_target_tokens": 0}
MAX_STEPS = 200  # a scheduler that stops making progress fails instead of hanging


def _scheduler(num_blocks: int, block_size: int = 4, prefix_caching: bool = True,
               **config) -> Scheduler:
    return Scheduler(SchedulerConfig(**config),
                     KVCacheManager(num_blocks, block_size, prefix_caching))


def _req(request_id: str, prompt: list[int], max_tokens: int = 4) -> Request:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return Request(request_id, list(prompt), params, max_tokens)


def _step(s: Scheduler) -> SchedulerOutput:
    """schedule() plus what the engine does with the decision (minus the model)."""
    return _run(s, s.schedule())


def _run(s: Scheduler, out: SchedulerOutput) -> SchedulerOutput:
    """The engine's bookkeeping for one decision: tokens computed, blocks cached, a fake
    token for each row that completes its prompt, max_tokens reached → FINISHED_LENGTH."""
    sampled = [row.request for row in out.scheduled if row.completes_prompt]
    for row in out.scheduled:
        req = row.request
        req.num_computed_tokens += row.num_new_tokens
        s.kv.cache_blocks(req.request_id, req.all_token_ids, req.num_computed_tokens)
    for req in sampled:
        req.append_output_token(FAKE_TOKEN)
        if len(req.output_token_ids) >= req.max_tokens:
            s.finish(req, RequestStatus.FINISHED_LENGTH)
    return out


def _rows(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(row.request.request_id, row.num_new_tokens) for row in out.scheduled]


def _tables(out: SchedulerOutput) -> dict[str, list[int]]:
    return {row.request.request_id: row.block_table for row in out.scheduled}


def _drain(s: Scheduler) -> list[list[tuple[str, int]]]:
    """Step until nothing is left; the rows of every step."""
    steps = []
    while s.has_unfinished():
        assert len(steps) < MAX_STEPS, "no progress"
        steps.append(_rows(_step(s)))
    return steps


def _admission_order(s: Scheduler) -> list[list[str]]:
    """Step until nothing is left; per step, the requests scheduled for the first time (those
    running already excluded)."""
    seen = {r.request_id for r in s.running}
    order = []
    while s.has_unfinished():
        assert len(order) < MAX_STEPS, "no progress"
        ids = [rid for rid, _ in _rows(_step(s))]
        order.append([rid for rid in ids if rid not in seen])
        seen.update(ids)
    return order


def test_token_budget_and_per_request_chunk_cap():
    s = _scheduler(64, max_num_batched_tokens=20, long_prefill_token_threshold=8)
    reqs = [_req(str(i), [3 + i] + list(range(10, 39)), max_tokens=2)  # 30 tokens each
            for i in range(3)]  # distinct first tokens: no shared prefix to wait for
    for r in reqs:
        s.add(r)
    out = _step(s)
    assert _rows(out) == [("0", 8), ("1", 8), ("2", 4)]  # cap 8, budget 20
    assert _tables(out) == {"0": [0, 1], "1": [2, 3], "2": [4]}
    assert out.preempted == [] and s.kv.num_free_blocks == 59
    out = _step(s)  # running first, in admission order: the same split again
    assert _rows(out) == [("0", 8), ("1", 8), ("2", 4)]
    assert _tables(out) == {"0": [0, 1, 5, 6], "1": [2, 3, 7, 8], "2": [4, 9]}
    assert [r.num_computed_tokens for r in reqs] == [16, 16, 8]
    assert [r.status for r in reqs] == [RequestStatus.RUNNING] * 3
    _drain(s)
    assert s.kv.num_free_blocks == 64 and not s.running and not s.waiting


def test_running_decodes_are_not_stalled_by_a_long_prompt():
    s = _scheduler(128, max_num_batched_tokens=16, long_prefill_token_threshold=8)
    short = _req("short", [5, 6, 7], max_tokens=30)
    s.add(short)
    assert _rows(_step(s)) == [("short", 3)]
    long = _req("long", list(range(3, 200)), max_tokens=30)  # 197 tokens
    s.add(long)
    decisions = [dict(_rows(_step(s))) for _ in range(5)]
    assert decisions == [{"short": 1, "long": 8}] * 5  # the decode runs every step
    assert short.output_token_ids == [FAKE_TOKEN] * 6
    assert long.num_computed_tokens == 40 and long.output_token_ids == []
    assert s.kv.block_table("short") == [0, 3]
    assert s.kv.block_table("long") == [1, 2, 4, 5, 6, 7, 8, 9, 10, 11]


def _hog_then_huge_and_small(**config) -> tuple[Scheduler, dict[str, Request]]:
    """A 12-block pool: "hog" (20 tokens) runs; then "huge" (37 tokens = 10 blocks, more
    than is free while hog runs) and "small" (1 block) arrive, in that order."""
    s = _scheduler(12, long_prefill_token_threshold=0, max_num_batched_tokens=512, **config)
    reqs = {"hog": _req("hog", list(range(3, 23))), "huge": _req("huge", [9] * 37),
            "small": _req("small", [5, 6, 7])}
    s.add(reqs["hog"])
    out = _step(s)
    assert _rows(out) == [("hog", 20)] and _tables(out) == {"hog": [0, 1, 2, 3, 4]}
    s.add(reqs["huge"])
    s.add(reqs["small"])
    return s, reqs


def test_blocked_head_does_not_block_smaller_requests():
    s, reqs = _hog_then_huge_and_small()
    out = _step(s)
    assert _rows(out) == [("hog", 1), ("small", 3)]  # huge is passed by
    assert _tables(out) == {"hog": [0, 1, 2, 3, 4, 5], "small": [6]}
    assert reqs["huge"].status == RequestStatus.WAITING and list(s.waiting) == [reqs["huge"]]
    assert reqs["huge"].blocked_since is not None
    assert s.kv.num_free_blocks == 5
    _step(s)
    out = _step(s)  # hog finishes with this step's token (4 outputs), freeing 6 blocks
    assert reqs["hog"].status == RequestStatus.FINISHED_LENGTH
    assert _rows(out) == [("hog", 1), ("small", 1)] and s.kv.num_free_blocks == 10
    out = _step(s)
    assert _rows(out) == [("small", 1), ("huge", 37)]
    # hog's blocks come back last first: block 5 (never full, no hash) at the head of the free
    # queue, its cached blocks 4..0 at the tail behind the never-used 8..11
    assert _tables(out)["huge"] == [5, 8, 9, 10, 11, 4, 3, 2, 1, 0]
    assert reqs["huge"].blocked_since is None
    _drain(s)
    assert s.kv.num_free_blocks == s.kv.num_blocks == 12
    assert all(r.num_preemptions == 0 for r in reqs.values())


def test_blocked_head_is_not_starved_after_max_bypass():
    """Without starvation: once the huge request has been passed by for max_bypass_s (0
    here), later small requests wait behind it; it runs as soon as the hog frees its blocks."""
    s, reqs = _hog_then_huge_and_small(max_bypass_s=0.0, **ARRIVAL_ORDER)
    out = _step(s)
    assert _rows(out) == [("hog", 1)]  # small waits behind huge although it would fit
    assert list(s.waiting) == [reqs["huge"], reqs["small"]]
    order = _admission_order(s)
    assert order == [[], [], ["huge", "small"], [], [], []]  # hog ends in the 2nd of these
    assert s.kv.num_free_blocks == s.kv.num_blocks == 12


def test_max_bypass_is_measured_from_the_first_block_miss(monkeypatch):
    """max_bypass_s = 5 on a fake clock: a request behind the blocked head is admitted at
    4.9 s, not at 5.0 s; the blocked head then goes first."""
    clock = SimpleNamespace(t=100.0)
    monkeypatch.setattr("baton.engine.scheduler.time",
                        SimpleNamespace(monotonic=lambda: clock.t))
    s, reqs = _hog_then_huge_and_small(max_bypass_s=5.0)
    assert _rows(_step(s)) == [("hog", 1), ("small", 3)]
    assert reqs["huge"].blocked_since == 100.0
    clock.t = 104.9
    s.add(small2 := _req("small2", [6, 7, 8]))
    assert _rows(_step(s)) == [("hog", 1), ("small", 1), ("small2", 3)]
    assert reqs["huge"].blocked_since == 100.0  # not reset by a further miss
    clock.t = 105.0
    s.add(small3 := _req("small3", [10, 11]))
    assert _rows(_step(s)) == [("hog", 1), ("small", 1), ("small2", 1)]
    assert list(s.waiting) == [reqs["huge"], small3]
    assert reqs["hog"].status == RequestStatus.FINISHED_LENGTH
    # 8 free < 10: huge still waits and small3 with it; small ends this step
    assert _rows(_step(s)) == [("small", 1), ("small2", 1)]
    assert list(s.waiting) == [reqs["huge"], small3]
    out = s.schedule()  # small's 2 blocks are back: 10 free, huge takes them all
    assert _rows(out) == [("small2", 1), ("huge", 37)]
    assert s.kv.num_free_blocks == 0 and list(s.waiting) == [small3]
    _run(s, out)
    assert small3.blocked_since == 105.0  # passed by huge's blocks now, not for 5 s yet
    _drain(s)
    assert s.kv.num_free_blocks == 12


def test_prompts_that_cannot_both_fit_are_not_admitted_to_thrash():
    """Two chunked prompts that each fit the pool alone but not together: the second waits
    for room for its whole prompt instead of being admitted, preempted when the first grows
    into its blocks, and recomputed."""
    s = _scheduler(24, long_prefill_token_threshold=8, max_num_batched_tokens=16)
    a = _req("a", [3] + list(range(10, 69)))  # 60 tokens: 15 blocks each
    b = _req("b", [4] + list(range(100, 159)))
    s.add(a)
    s.add(b)
    steps, preempted = [], []
    while s.has_unfinished():
        assert len(steps) < MAX_STEPS, "no progress"
        out = _step(s)
        steps.append(_rows(out))
        preempted.extend(out.preempted)
    one = lambda rid: [[(rid, 8)]] * 7 + [[(rid, 4)]] + [[(rid, 1)]] * 3  # noqa: E731
    assert steps == one("a") + one("b")  # b starts only once a has finished
    assert preempted == [] and a.num_preemptions == b.num_preemptions == 0
    computed = sum(n for rows in steps for _, n in rows if n > 1)
    assert computed == 120  # every prompt token once
    assert s.kv.num_free_blocks == s.kv.num_blocks == 24


def test_whole_prompt_check_counts_cache_hits():
    """A long prompt whose prefix is cached needs blocks only for its uncached tail: it is
    admitted beside a running request although its whole length would not fit again."""
    s = _scheduler(24, long_prefill_token_threshold=8, max_num_batched_tokens=16, **ARRIVAL_ORDER)
    turn1 = [3] + list(range(10, 65))  # 56 tokens: 14 blocks
    s.add(_req("t1", turn1, max_tokens=2))
    _drain(s)
    assert s.kv.num_free_blocks == 24 and s.kv.num_cached_blocks == 14
    other = _req("other", [4] + list(range(100, 119)), max_tokens=20)  # 5 blocks
    s.add(other)
    assert _rows(_step(s)) == [("other", 8)]
    t2 = _req("t2", turn1 + [70, 71, 72, 73, 74, 75, 76, 77], max_tokens=2)  # 16 blocks
    s.add(t2)
    out = _step(s)
    # 20 free: 16 + other's 1 to come would not fit; 14 of t2's blocks are cached hits
    assert _rows(out) == [("other", 8), ("t2", 8)] and out.preempted == []
    assert _tables(out) == {"other": [14, 15, 16, 17], "t2": list(range(14)) + [18, 19]}
    assert t2.num_cached_tokens == 56 and t2.num_computed_tokens == 64
    assert [s.kv.pool.blocks[i].ref_cnt for i in range(14)] == [1] * 14
    assert s.kv.num_free_blocks == 4
    _drain(s)
    assert s.kv.num_free_blocks == s.kv.num_blocks == 24


def test_whole_prompt_check_counts_hits_a_running_request_holds():
    """The cached prefix is in use by the running request it came from: it costs no free
    block, so the follow-up fits beside it (its whole 16 blocks would not: 9 are free)."""
    s = _scheduler(24, long_prefill_token_threshold=8, max_num_batched_tokens=16)
    turn1 = [3] + list(range(10, 65))  # 56 tokens: 14 blocks
    t1 = _req("t1", turn1, max_tokens=20)
    s.add(t1)
    assert [_rows(_step(s)) for _ in range(8)] == [[("t1", 8)]] * 7 + [[("t1", 1)]]
    t2 = _req("t2", turn1 + [70, 71, 72, 73, 74, 75, 76, 77], max_tokens=2)  # 16 blocks
    s.add(t2)
    out = _step(s)
    assert _rows(out) == [("t1", 1), ("t2", 8)] and out.preempted == []
    assert _tables(out)["t2"] == list(range(14)) + [15, 16]
    assert [s.kv.pool.blocks[i].ref_cnt for i in range(14)] == [2] * 14
    assert t2.num_cached_tokens == 56 and s.kv.num_free_blocks == 7


def test_free_cache_hits_still_take_a_free_block_each():
    """Hits that sit in the free queue leave it when taken: a follow-up whose 2 new blocks
    fit but whose 14 free hits would eat the blocks a running prompt still needs waits."""
    s = _scheduler(24, long_prefill_token_threshold=8, max_num_batched_tokens=16)
    turn1 = [3] + list(range(10, 65))  # 56 tokens: 14 blocks, cached and free when done
    s.add(_req("t1", turn1, max_tokens=2))
    _drain(s)
    other = _req("other", [4] + list(range(100, 139)), max_tokens=2)  # 40 tokens: 10 blocks
    s.add(other)
    assert _rows(_step(s)) == [("other", 8)]
    t2 = _req("t2", turn1 + [70, 71, 72, 73, 74, 75, 76, 77], max_tokens=2)
    s.add(t2)
    out = _step(s)
    # 20 free, 14 of them t2's hits: 2 new + other's 6 to come > the 6 others
    assert _rows(out) == [("other", 8)] and t2.status == RequestStatus.WAITING
    assert s.kv.num_free_blocks == 20 and t2.blocked_since is not None
    steps = _drain(s)
    # other's decode evicts t1's last cached block (the free-queue head): t2 then hits 13
    assert steps == [[("other", 8)]] * 3 + [[("other", 1)]] + \
        [[("t2", 8)], [("t2", 4)], [("t2", 1)]]
    assert t2.num_cached_tokens == 52
    assert other.num_preemptions == t2.num_preemptions == 0
    assert s.kv.num_free_blocks == 24


def _fan_out() -> list[Request]:
    prefix = list(range(3, 51))  # 3 blocks of 16
    return [_req("a", prefix + [60, 61, 62]), _req("b", prefix + [70, 71]),
            _req("c", prefix + [80])]


def test_requests_sharing_an_uncached_prefix_compute_it_once():
    """An agent's fan-out: prompts with one uncached 48-token prefix arrive together. The later
    ones wait one step and take the prefix as a cache hit instead of computing it again."""
    s = _scheduler(64, block_size=16, **ARRIVAL_ORDER)
    a, b, c = reqs = _fan_out()
    for r in reqs:
        s.add(r)
    out = _step(s)
    assert _rows(out) == [("a", 51)] and list(s.waiting) == [b, c]
    assert b.status == c.status == RequestStatus.WAITING
    assert b.blocked_since is None and c.blocked_since is None  # deferred, not blocked
    out = _step(s)
    assert _rows(out) == [("a", 1), ("b", 2), ("c", 1)]
    assert _tables(out) == {"a": [0, 1, 2, 3], "b": [0, 1, 2, 4], "c": [0, 1, 2, 5]}
    assert [s.kv.pool.blocks[i].ref_cnt for i in range(6)] == [3, 3, 3, 1, 1, 1]
    _drain(s)
    assert [r.num_cached_tokens for r in reqs] == [0, 48, 48]
    assert s.kv.num_free_blocks == s.kv.num_blocks == 64


def test_without_prefix_caching_the_fan_out_is_admitted_at_once():
    s = _scheduler(64, block_size=16, prefix_caching=False, **ARRIVAL_ORDER)
    reqs = _fan_out()
    for r in reqs:
        s.add(r)
    out = _step(s)
    assert _rows(out) == [("a", 51), ("b", 50), ("c", 49)]
    assert _tables(out) == {"a": [0, 1, 2, 3], "b": [4, 5, 6, 7], "c": [8, 9, 10, 11]}
    _drain(s)
    assert [r.num_cached_tokens for r in reqs] == [0, 0, 0]
    assert s.kv.num_free_blocks == 64


def test_preemption_takes_the_most_recently_admitted_request():
    """Three requests fill the pool; the first one's decode needs a block: the last admitted
    is preempted (blocks freed, PREEMPTED, front of the waiting queue) and no one is
    admitted in that step, although a block is free; it is later recomputed."""
    s = _scheduler(6, long_prefill_token_threshold=0, **ARRIVAL_ORDER)
    a = _req("a", [3] + list(range(10, 17)), max_tokens=2)  # 8 tokens: 2 full blocks
    b = _req("b", [4] + list(range(10, 16)), max_tokens=2)  # 7 tokens: its decode fits
    c = _req("c", [5] + list(range(10, 17)), max_tokens=2)
    for r in (a, b, c):
        s.add(r)
    out = _step(s)
    assert _rows(out) == [("a", 8), ("b", 7), ("c", 8)]
    assert _tables(out) == {"a": [0, 1], "b": [2, 3], "c": [4, 5]}
    assert s.kv.num_free_blocks == 0
    s.add(d := _req("d", [20, 21], max_tokens=1))
    out = s.schedule()
    assert out.preempted == [c]
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0
    assert c.num_preemptions == 1 and s.kv.num_request_blocks("c") == 0
    assert list(s.waiting) == [c, d] and s.running == [a, b]
    assert _rows(out) == [("a", 1), ("b", 1)]  # d would fit, but not in a preempting step
    assert _tables(out) == {"a": [0, 1, 5], "b": [2, 3]}  # c's blocks freed last first
    assert s.kv.num_free_blocks == 1  # block 4: c's first block, still cached
    assert a.num_preemptions == b.num_preemptions == 0
    _run(s, out)  # a and b reach max_tokens
    out = _step(s)  # c takes its first block back as a hit and recomputes 5 of its 9 tokens
    assert _rows(out) == [("c", 5), ("d", 2)]
    assert _tables(out) == {"c": [4, 5, 1], "d": [0]}
    assert c.output_token_ids == [FAKE_TOKEN, FAKE_TOKEN]
    assert c.status == d.status == RequestStatus.FINISHED_LENGTH
    assert not s.has_unfinished() and s.kv.num_free_blocks == 6


def _remote_wait(s: Scheduler, req: Request) -> None:
    """What the decode role does (remote_kv.RemoteKV): allocate the whole prompt's blocks,
    then wait for another worker to write them."""
    hits, num_cached = s.kv.get_computed_blocks(req.request_id, req.prompt_token_ids)
    assert s.kv.allocate_slots(req.request_id, req.num_prompt_tokens, hits) is not None
    s.wait_for_remote_kv(req, num_cached)


def test_a_remote_kv_wait_is_never_scheduled_nor_preempted():
    s = _scheduler(4, long_prefill_token_threshold=0)
    r = _req("r", list(range(10, 18)))  # 2 blocks
    _remote_wait(s, r)
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KV
    assert r.num_computed_tokens == r.num_cached_tokens == 0
    assert s.remote_waits == {"r": r} and s.kv.block_table("r") == [0, 1]
    assert not s.has_unfinished()
    assert _rows(s.schedule()) == []
    a = _req("a", list(range(30, 38)))  # takes the other 2 blocks
    s.add(a)
    assert _tables(_step(s)) == {"a": [2, 3]}
    out = _step(s)  # a's decode needs a 3rd block: a alone is preempted, r keeps its blocks
    assert out.preempted == [a] and _rows(out) == []
    assert a.status == RequestStatus.PREEMPTED and list(s.waiting) == [a]
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KV and s.kv.block_table("r") == [0, 1]
    assert s.kv.num_free_blocks == 2


def test_remote_kv_ready_moves_the_request_to_running():
    s = _scheduler(8)
    r = _req("r", list(range(10, 18)))
    _remote_wait(s, r)
    s.kv.cache_blocks("r", r.all_token_ids, 8)  # what RemoteKV.finish does on arrival
    r.append_output_token(FAKE_TOKEN)  # the prefill worker's first token
    s.remote_kv_ready(r, 8)
    assert r.status == RequestStatus.RUNNING and r.num_computed_tokens == 8
    assert s.running == [r] and s.remote_waits == {} and r.scheduled_time is not None
    assert s.has_unfinished()
    out = _step(s)
    assert _rows(out) == [("r", 1)] and _tables(out) == {"r": [0, 1, 2]}
    with pytest.raises(KeyError):
        s.remote_kv_ready(r, 8)  # running, not waiting for remote KV
    w = _req("w", [5, 6, 7])
    s.add(w)
    with pytest.raises(KeyError):
        s.remote_kv_ready(w, 3)  # waiting for a local prefill
    assert w.status == RequestStatus.WAITING and s.running == [r] and w.num_computed_tokens == 0


def test_remote_kv_ready_with_a_prefix_recomputes_the_rest():
    """A failed transfer: the decode side keeps its own cached prefix and computes the rest."""
    s = _scheduler(8)
    s.add(_req("x", list(range(10, 15)), max_tokens=1))  # caches block [10..13]
    _drain(s)
    r = _req("r", list(range(10, 20)))  # 10 tokens: 3 blocks, the first a hit
    _remote_wait(s, r)
    assert r.num_cached_tokens == r.num_computed_tokens == 4
    assert s.kv.block_table("r") == [0, 1, 2]  # the hit, then the free-queue head
    s.remote_kv_ready(r, r.num_cached_tokens)
    out = _step(s)
    assert _rows(out) == [("r", 6)] and _tables(out) == {"r": [0, 1, 2]}
    assert r.output_token_ids == [FAKE_TOKEN]


def test_finishing_a_remote_kv_wait_frees_its_blocks():
    s = _scheduler(4)
    r = _req("r", list(range(10, 18)))
    _remote_wait(s, r)
    assert s.kv.num_free_blocks == 2
    s.finish(r, RequestStatus.FINISHED_ABORTED)
    assert r.status == RequestStatus.FINISHED_ABORTED
    assert s.remote_waits == {} and s.kv.num_request_blocks("r") == 0
    assert s.kv.num_free_blocks == 4 and not s.has_unfinished()
    k = _req("k", list(range(20, 28)))
    _remote_wait(s, k)
    s.finish(k, RequestStatus.FINISHED_ABORTED, free=False)  # blocks kept for a transfer
    assert s.remote_waits == {} and s.kv.num_request_blocks("k") == 2
    assert s.kv.num_free_blocks == 2


def test_totals_count_preemptions_and_prefix_cache_tokens():
    """Queries and hits in tokens, once per request (first admission or remote-KV wait)."""
    s = _scheduler(6, long_prefill_token_threshold=0)
    s.add(_req("x", list(range(10, 15)), max_tokens=1))  # 5 tokens, caches [10..13]
    _drain(s)
    _remote_wait(s, r := _req("r", list(range(10, 20))))  # 10 tokens, 4 of them a hit
    s.finish(r, RequestStatus.FINISHED_ABORTED)
    assert (s.totals.prefix_cache_queries, s.totals.prefix_cache_hits) == (15, 4)
    a = _req("a", [3] + list(range(10, 17)), max_tokens=2)  # the preemption case above
    b = _req("b", [4] + list(range(10, 16)), max_tokens=2)
    c = _req("c", [5] + list(range(10, 17)), max_tokens=2)
    for q in (a, b, c):
        s.add(q)
    _step(s)
    assert _step(s).preempted == [c] and s.totals.num_preemptions == 1
    _drain(s)  # c's re-admission is not a new query
    assert (s.totals.prefix_cache_queries, s.totals.prefix_cache_hits) == (38, 4)
    assert s.totals.num_preemptions == 1


def test_cached_tokens_after_preemption_count_only_tokens_never_computed():
    """c's first admission hits x's block (4 tokens); preempted, that block is evicted before
    c comes back, so c recomputes all of it: none of its prompt went uncomputed."""
    from baton.engine.kv_source import KVSource
    s = _scheduler(6, long_prefill_token_threshold=0, **ARRIVAL_ORDER)
    s.add(_req("x", list(range(10, 15)), max_tokens=1))  # caches [10..13]
    _drain(s)
    a = _req("a", [3] + list(range(10, 17)), max_tokens=2)
    b = _req("b", [4] + list(range(10, 16)), max_tokens=2)
    c = _req("c", [10, 11, 12, 13, 5, 16, 17, 18], max_tokens=2)
    for r in (a, b, c):
        s.add(r)
    _step(s)
    assert (c.num_cached_tokens, c.cached_spans) == (4, ((KVSource.POOL, 4),))
    out = _run(s, s.schedule())
    assert out.preempted == [c]
    first = s.kv.block_hashes("c", c.all_token_ids)[0]
    assert first in s.kv.pool.cached
    taken = s.kv.pool.allocate(s.kv.num_free_blocks)  # someone else takes the free blocks
    assert first not in s.kv.pool.cached
    s.kv.pool.release(taken)
    out = _step(s)
    assert _rows(out) == [("c", 9)]  # its prompt and its first output token, all computed
    assert (c.num_cached_tokens, c.cached_spans) == (0, ())
