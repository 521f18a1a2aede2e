"""Closed and open loop against the fake streaming server."""
import asyncio
import time
from collections import defaultdict

from baton.bench.metrics import summarize
from baton.bench.prepare import Preparer
from baton.bench.runner import RunConfig, open_schedule, run_workload
from baton.bench.tokens import TokenCounter
from baton.bench.workload import Child, Session, Turn

B = 16


def block_session(name, turns=3, delay=0.05, max_tokens=4, start=None, first_id=0):
    """Turn k: (k + 2) blocks; the first block is shared by every session (a system prompt)."""
    ts = tuple(Turn(max_tokens=max_tokens, delay_s=delay if k else 0.0, arrival_s=0.2 * k,
                    block_ids=(0,) + tuple(range(first_id, first_id + k + 1)),
                    num_tokens=(k + 2) * B) for k in range(turns))
    return Session(name, ts, block_tokens=B, start_s=start)


def run(url, sessions, **kw):
    cfg = RunConfig(url=url, model="fake", progress=False, **kw)
    prep = Preparer(TokenCounter(None), "salt", prompt_format="tokens")
    return asyncio.run(run_workload(cfg, sessions, prep))


def test_closed_loop_sessions_headers_growth_and_concurrency(fake):
    server, url = fake
    sessions = [block_session(f"s{i}", first_id=100 * (i + 1)) for i in range(5)]
    t0 = time.monotonic()
    result = run(url, sessions, concurrency=2, duration_s=10.0, grace_s=1.0)
    assert time.monotonic() - t0 < 5.0  # the workload drains long before the deadline
    assert len(server.log) == 15 and all(r.ok for r in result.records)
    assert result.sessions_started == result.sessions_finished == 5
    by_sid = defaultdict(list)
    for entry in server.log:
        assert entry.path == "/v1/completions" and entry.body["ignore_eos"] is True
        assert entry.body["stream"] and entry.body["stream_options"]["include_usage"]
        by_sid[entry.session_id].append(entry)
    assert len(by_sid) == 5 and None not in by_sid
    for entries in by_sid.values():
        assert [len(e.prompt) for e in entries] == [2 * B, 3 * B, 4 * B]  # turns grow
        for a, b in zip(entries, entries[1:]):
            assert b.prompt[: len(a.prompt)] == a.prompt       # ... by appending
            assert b.arrived - a.finished >= 0.04              # think time honoured
    spans = sorted((min(e.arrived for e in es), max(e.finished for e in es))
                   for es in by_sid.values())
    for t, _ in spans:  # never more than 2 sessions live
        assert sum(1 for a, b in spans if a <= t < b) <= 2
    s = summarize(result.records, 0.0, result.end_s)
    # the fake server caches in 16-token blocks, like the theoretical count here
    assert s.prefix_hit_actual == s.prefix_hit_global
    assert s.prefix_hit_theoretical < s.prefix_hit_global  # block 0 is shared across sessions


def test_closed_loop_is_bounded_by_duration(fake):
    server, url = fake
    sessions = [block_session(f"s{i}", turns=5, delay=30.0, first_id=100 * (i + 1))
                for i in range(4)]
    t0 = time.monotonic()
    result = run(url, sessions, concurrency=2, duration_s=1.0, grace_s=0.5)
    assert time.monotonic() - t0 < 3.0  # think time is cut short at the deadline
    assert len(server.log) == 2  # first turn of the two live sessions only
    assert 1.0 <= result.end_s < 2.0


def test_grace_then_cancel(fake):
    server, url = fake
    server.token_s = 0.05
    result = run(url, [block_session("slow", turns=1, max_tokens=200)], concurrency=1,
                 duration_s=0.5, grace_s=0.3)
    (r,) = result.records
    assert r.cancelled and not r.ok and result.end_s < 1.5
    assert summarize(result.records, 0.0, result.end_s).cancelled == 1


def test_warmup_excluded(fake):
    _, url = fake
    sessions = [block_session(f"s{i}", turns=4, delay=0.4, first_id=100 * (i + 1))
                for i in range(2)]
    result = run(url, sessions, concurrency=2, duration_s=5.0, warmup_s=0.3)
    s = summarize(result.records, result.warmup_s, result.end_s)
    assert s.warmup == 2 and s.measured == 6


def test_subagent_join_gates_parent(fake):
    server, url = fake
    kid = Session("kid", (Turn(max_tokens=3, block_ids=(900,), num_tokens=B),
                          Turn(max_tokens=3, delay_s=0.2, block_ids=(900, 901),
                               num_tokens=2 * B)), block_tokens=B)
    bg = Session("bg", (Turn(max_tokens=2, block_ids=(950,), num_tokens=B),), block_tokens=B)
    parent = block_session("p", turns=2, delay=0.0, first_id=100)
    tree = Session("p", parent.turns, children=(Child(kid, after_turn=0, join_turn=1),
                                                Child(bg, after_turn=0, delay_s=0.3)),
                   block_tokens=B)
    result = run(url, [tree], concurrency=1, duration_s=5.0)
    assert len(result.records) == 5 and all(r.ok for r in result.records)
    by_sid = defaultdict(list)
    for e in server.log:
        by_sid[e.session_id].append(e)
    assert len(by_sid) == 3  # parent, child, background child: each its own X-Session-ID
    (p_sid,) = [k for k in by_sid if k.endswith("-p")]
    (kid_sid,) = [k for k in by_sid if k.endswith("/0")]
    (bg_sid,) = [k for k in by_sid if k.endswith("/1")]
    first, second = by_sid[p_sid]
    assert by_sid[kid_sid][0].arrived >= first.finished  # spawned after parent turn 0
    assert second.arrived >= by_sid[kid_sid][-1].finished  # turn 1 joins the child
    assert by_sid[bg_sid][0].arrived - first.finished >= 0.28  # its own start delay
    assert result.sessions_finished == 1


def test_errors_are_recorded_and_sessions_continue(fake):
    server, url = fake
    server.fail_every = 3
    result = run(url, [block_session("s", turns=6, delay=0.0)], concurrency=1, duration_s=5.0)
    s = summarize(result.records, 0.0, result.end_s)
    assert len(server.log) == 6 and s.errors == 2 and s.measured == 4
    assert s.error_kinds == {"HTTP 500": 2}


def test_a_429_is_sent_again_after_its_retry_after(fake):
    """As the OpenAI client: the same turn again after Retry-After, at most max_retries
    times; each attempt is a record (refusals are errors), the session goes on."""
    server, url = fake
    server.reject_429 = 4
    result = run(url, [block_session("s", turns=2, delay=0.0)], concurrency=1, duration_s=5.0)
    s = summarize(result.records, 0.0, result.end_s)
    # turn 0: 429, 429, 429 (max_retries = 2: given up); turn 1: 429, then served
    assert [len(e.prompt) // B for e in server.log] == [2, 2, 2, 3, 3]
    assert s.error_kinds == {"HTTP 429": 4} and s.measured == 1
    gaps = [b.arrived - a.arrived for a, b in zip(server.log, server.log[1:])]
    assert all(g >= 0.19 for i, g in enumerate(gaps) if i != 2)  # waited; turn 1 at once
    none = run(url, [block_session("t", turns=1)], concurrency=1, duration_s=5.0,
               max_retries=0)
    assert len(none.records) == 1 and none.records[0].ok


def test_context_overflow_ends_the_session(fake):
    server, url = fake
    server.max_len = 3 * B  # turns of 2, 3, 4, 5 blocks: the third overflows
    result = run(url, [block_session("s", turns=4, delay=0.0)], concurrency=1, duration_s=5.0)
    s = summarize(result.records, 0.0, result.end_s)
    assert len(server.log) == 3 and s.measured == 2
    assert s.error_kinds == {"context overflow": 1}


def test_open_loop_follows_timestamps(fake):
    server, url = fake
    sessions = [block_session("a", turns=3, start=10.0, first_id=100),
                block_session("b", turns=2, start=10.5, first_id=200)]
    result = run(url, sessions, mode="open", duration_s=3.0)
    assert len(server.log) == 5 and all(r.ok for r in result.records)
    starts = sorted(r.start for r in result.records)
    # a: 0.0, 0.2, 0.4; b: 0.5, 0.7 (relative to the first arrival)
    for got, want in zip(starts, [0.0, 0.2, 0.4, 0.5, 0.7]):
        assert abs(got - want) < 0.1


def test_open_schedule_rate_and_trace_starts():
    s = [block_session("x"), block_session("y"), block_session("z", start=7.0)]
    starts = open_schedule(s, rate=2.0, seed=1)
    assert starts[0] == 0.0 and starts[1] > 0.0
    assert open_schedule(s, rate=2.0, seed=1) == starts
