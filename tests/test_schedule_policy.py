"""The shortest_first admission policy on a bare Scheduler + KVCacheManager (no model), on a
fake clock (`baton.engine.scheduler.time` monkeypatched; arrival times set by hand).
The helpers are test_scheduler.py's: `_step` plays the engine's bookkeeping."""
from types import SimpleNamespace

import pytest

from baton.engine.kv_cache import KVCacheManager
from baton.engine.request import Request, RequestStatus
from baton.engine.scheduler import Scheduler
from tests.test_scheduler import _admission_order, _drain, _req, _rows, _scheduler, _step

TURN1 = [3] + list(range(10, 65))  # 56 tokens: 14 blocks of 4


@pytest.fixture
def clock(monkeypatch) -> SimpleNamespace:
    c = SimpleNamespace(t=100.0)
    monkeypatch.setattr("baton.engine.scheduler.time", SimpleNamespace(monotonic=lambda: c.t))
    return c


def _arrive(s: Scheduler, clock: SimpleNamespace, req: Request) -> Request:
    req.arrival_time = clock.t
    s.add(req)
    return req


def _cold_warm_mid(policy: str, clock: SimpleNamespace) -> Scheduler:
    """One request at a time (max_num_seqs=1). TURN1 is cached; then arrive, in order: a cold
    60-token prompt, the session's next turn (64 tokens, 8 uncached), a cold 20-token one."""
    s = _scheduler(64, max_num_seqs=1, long_prefill_token_threshold=0, policy=policy)
    s.add(_req("t1", TURN1, max_tokens=1))
    _drain(s)
    _arrive(s, clock, _req("cold", [4] + list(range(100, 159)), max_tokens=1))
    clock.t += 0.1
    _arrive(s, clock, _req("warm", TURN1 + list(range(70, 78)), max_tokens=1))
    clock.t += 0.1
    _arrive(s, clock, _req("mid", [5] + list(range(200, 219)), max_tokens=1))
    return s


def test_shortest_first_admits_the_fewest_uncached_tokens_first(clock):
    s = _cold_warm_mid("shortest_first", clock)
    assert _rows(_step(s)) == [("warm", 8)]  # 56 of its 64 tokens are cached hits
    assert [r.request_id for r in s.waiting] == ["mid", "cold"]
    assert _admission_order(s) == [["mid"], ["cold"]]
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_fcfs_admits_in_arrival_order(clock):
    s = _cold_warm_mid("fcfs", clock)
    assert _admission_order(s) == [["cold"], ["warm"], ["mid"]]
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_a_long_prefill_goes_first_after_max_prefill_wait(clock):
    """A stream of short prompts, one a step, would pass a cold one forever; after
    max_prefill_wait_s (5 s) it goes first, and the shorts resume behind it."""
    s = _scheduler(64, max_num_seqs=1, long_prefill_token_threshold=0,
                   policy="shortest_first", max_prefill_wait_s=5.0)
    cold = _arrive(s, clock, _req("cold", list(range(100, 140)), max_tokens=1))
    admitted = []
    for i, t in enumerate([100.0, 102.0, 104.9, 105.0, 105.5]):
        clock.t = t
        _arrive(s, clock, _req(f"short{i}", [5 + i, 6, 7], max_tokens=1))
        admitted += [rid for rid, _ in _rows(_step(s))]
    assert admitted == ["short0", "short1", "short2", "cold", "short3"]
    assert cold.status == RequestStatus.FINISHED_LENGTH and cold.num_cached_tokens == 0
    assert [r.request_id for r in s.waiting] == ["short4"]


def test_a_request_passed_by_for_max_bypass_goes_first(clock):
    """The bypass limit composes with the order: once the huge prompt has been passed by for
    blocks for max_bypass_s (0), a shorter arrival waits behind it, as under fcfs."""
    s = _scheduler(12, long_prefill_token_threshold=0, max_num_batched_tokens=512,
                   policy="shortest_first", max_bypass_s=0.0)
    hog = _arrive(s, clock, _req("hog", list(range(3, 23))))
    assert _rows(_step(s)) == [("hog", 20)]
    huge = _arrive(s, clock, _req("huge", [9] * 37))  # 10 blocks: more than is free
    _arrive(s, clock, _req("small", [5, 6, 7]))
    assert _rows(_step(s)) == [("hog", 1), ("small", 3)]  # shortest first; huge misses
    assert huge.blocked_since == 100.0
    _arrive(s, clock, small2 := _req("small2", [6, 7, 8]))
    assert _rows(_step(s)) == [("hog", 1), ("small", 1)]  # small2 waits behind huge
    assert list(s.waiting) == [huge, small2]
    # hog ends; huge takes the 10 free blocks (small holds 2); small2 gets small's when it ends
    assert _admission_order(s) == [[], ["huge"], ["small2"], [], [], []]
    assert hog.num_preemptions == huge.num_preemptions == 0
    assert s.kv.num_free_blocks == 12


@pytest.mark.parametrize("policy", ["fcfs", "shortest_first"])
def test_preempted_requests_are_admitted_first(clock, policy):
    """c is preempted (9 tokens to recompute, 4 of them a hit) while d (2 tokens) waits:
    under both policies c goes back in first."""
    s = _scheduler(6, long_prefill_token_threshold=0, policy=policy)
    reqs = [_arrive(s, clock, _req(rid, [first] + list(range(10, 10 + n)), max_tokens=2))
            for rid, first, n in (("a", 3, 7), ("b", 4, 6), ("c", 5, 7))]
    assert sorted(_rows(_step(s))) == [("a", 8), ("b", 7), ("c", 8)]  # b first if shortest
    _arrive(s, clock, d := _req("d", [20, 21], max_tokens=1))
    out = _step(s)
    assert out.preempted == [reqs[2]] and list(s.waiting) == [reqs[2], d]
    assert _rows(_step(s)) == [("c", 5), ("d", 2)]
    assert not s.has_unfinished() and s.kv.num_free_blocks == 6


def test_estimated_hit_follows_the_cache():
    """estimate_hit_blocks moves from its hint: forward as blocks get cached, back as the
    chain's tail is evicted; never past the last block with a token left to compute."""
    kv = KVCacheManager(7, 4)
    tokens = list(range(10, 26))  # 4 full blocks
    assert kv.estimate_hit_blocks("w", tokens, 0) == 0
    hits, _ = kv.get_computed_blocks("a", tokens[:12])
    kv.allocate_slots("a", 12, hits)
    kv.cache_blocks("a", tokens[:12], 12)
    assert kv.estimate_hit_blocks("w", tokens, 0) == 3
    assert kv.estimate_hit_blocks("w", tokens, 9) == 3  # a hint past the end is clamped
    kv.free("a")  # released last first: block 2 heads the cached part of the free queue
    assert kv.allocate_slots("x", 4 * 4) is not None  # takes the 4 never-used blocks...
    assert kv.allocate_slots("y", 4) is not None  # ...then evicts a's last block
    assert kv.estimate_hit_blocks("w", tokens, 3) == 2
    assert kv.estimate_hit_blocks("w", tokens[:8], 2) == 1  # 8 tokens: 1 block + 4 to compute


def test_workers_default_to_shortest_first_with_a_prefill_target():
    """Both roles: a queue mixing continuing turns (short uncached suffixes) with cold
    contexts keeps the former from queueing behind the latter, on a colocated or decode
    worker as on a prefill worker."""
    from decode_service.config import parse_args as decode_args
    from prefill_service.config import parse_args as prefill_args
    for parse in (prefill_args, decode_args):
        sched = parse([]).engine.scheduler
        assert (sched.policy, sched.prefill_target_tokens) == ("shortest_first", 256)
    sched = prefill_args(["--schedule-policy", "fcfs", "--max-prefill-wait-s", "2.5",
                          "--prefill-target-tokens", "0"]).engine.scheduler
    assert (sched.policy, sched.max_prefill_wait_s, sched.prefill_target_tokens) \
        == ("fcfs", 2.5, 0)
