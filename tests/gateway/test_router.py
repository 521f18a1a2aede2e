"""Router unit tests: pure routing decisions from worker views (no I/O)."""
from __future__ import annotations

from gateway.config import RouterConfig, RoutingPolicy
from gateway.router import RouteDecision, Router, WorkerView

A, B, C = "10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"
P1, P2 = "10.0.1.1:2", "10.0.1.2:2"


def router(policy=RoutingPolicy.SESSION, **kw) -> Router:
    return Router(RouterConfig(policy=policy, **kw))


def views(*specs) -> list[WorkerView]:
    return [WorkerView(address=s) if isinstance(s, str) else s for s in specs]


def test_no_healthy_worker_is_none():
    r = router()
    assert r.route("s", [], [], [], 0.0) is None
    assert r.route("s", [], [WorkerView(A, healthy=False)], [], 0.0) is None
    assert r.route("s", [], views(A), [], 0.0, exclude=[A]) is None


def test_new_session_goes_to_longest_cached_prefix():
    r = router()
    decodes = [WorkerView(A, load=0.1, cached={1}), WorkerView(B, load=0.1, cached={1, 2, 3})]
    d = r.route("s1", [1, 2, 3, 4], decodes, [], 0.0)
    assert (d.decode, d.reason, d.overlap_blocks) == (B, "kv", 3)


def test_overlap_counts_only_a_leading_prefix():
    r = router()
    w = WorkerView(A, cached={2, 3, 4})  # block 1 missing: chained hashes cannot hit later
    assert r.overlap(w, [1, 2, 3]) == 0
    assert r.overlap(WorkerView(A, cached={1, 3}), [1, 2, 3]) == 1


def test_load_outweighs_small_overlap():
    r = router()
    decodes = [WorkerView(A, load=0.9, cached={1}), WorkerView(B, load=0.0)]
    d = r.route("", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], decodes, [], 0.0)
    assert (d.decode, d.reason) == (B, "load")


def test_session_sticks_while_healthy_and_not_overloaded():
    r = router()
    first = r.route("s1", [], views(A, B), [], 0.0)
    r.record("s1", first, [7, 8], 0.0)
    other = B if first.decode == A else A
    # even when the other worker looks better, the session stays
    decodes = [WorkerView(first.decode, load=0.5), WorkerView(other, load=0.0, cached={7, 8})]
    again = r.route("s1", [7, 8, 9], decodes, [], 1.0)
    assert (again.decode, again.reason) == (first.decode, "sticky")


def test_session_moves_off_a_dead_worker_and_then_sticks_to_the_new_one():
    r = router()
    r.record("s1", RouteDecision(A, None, "load"), [1], 0.0)
    d = r.route("s1", [1], [WorkerView(A, healthy=False), WorkerView(B)], [], 1.0)
    assert (d.decode, d.reason) == (B, "moved")
    r.record("s1", d, [1], 1.0)
    back = r.route("s1", [1], views(A, B), [], 2.0)
    assert (back.decode, back.reason) == (B, "sticky")


def test_session_leaves_an_overloaded_worker_only_for_a_better_one():
    r = router(overload_load=1.0)
    r.record("s1", RouteDecision(A, None, "load"), [], 0.0)
    both_busy = [WorkerView(A, load=1.2), WorkerView(B, load=1.1)]
    assert r.route("s1", [], both_busy, [], 1.0).decode == A
    d = r.route("s1", [], [WorkerView(A, load=1.2), WorkerView(B, load=0.2)], [], 1.0)
    assert (d.decode, d.reason) == (B, "moved")


def test_stale_stats_never_count_as_overloaded():
    """Case 14: a worker whose stats are stale (load None) is routable and not saturated."""
    r = router(overload_load=1.0)
    r.record("s1", RouteDecision(A, None, "load"), [], 0.0)
    d = r.route("s1", [], [WorkerView(A, load=None), WorkerView(B, load=0.0)], [], 1.0)
    assert d.decode == A and d.reason == "sticky"
    assert not r.overloaded(WorkerView(A, load=None))
    assert r.load(WorkerView(A, load=None, pending=0)) == 0.0


def test_pending_requests_spread_a_burst_between_stats_polls():
    r = router(capacity_hint=4)
    picks = []
    pending = {A: 0, B: 0}
    for i in range(8):
        d = r.route(f"s{i}", [], [WorkerView(A, load=0.0, pending=pending[A]),
                                  WorkerView(B, load=0.0, pending=pending[B])], [], 0.0)
        pending[d.decode] += 1
        picks.append(d.decode)
    assert picks.count(A) == picks.count(B) == 4


def test_sent_index_counts_as_overlap_before_stats_report_it():
    r = router()
    r.record("", RouteDecision(B, None, "load"), [5, 6, 7], 0.0)
    d = r.route("other-session", [5, 6, 7, 8], views(A, B), [], 1.0)
    assert (d.decode, d.overlap_blocks) == (B, 3)
    r.forget_worker(B)
    assert r.overlap(WorkerView(B), [5, 6]) == 0


def test_round_robin_rotates_and_ignores_sessions_and_kv():
    r = router(RoutingPolicy.ROUND_ROBIN)
    decodes = [WorkerView(A, cached={1}), WorkerView(B), WorkerView(C)]
    picks = []
    for _ in range(6):
        d = r.route("same-session", [1], decodes, [], 0.0)
        r.record("same-session", d, [1], 0.0)
        picks.append(d.decode)
        assert d.reason == "round_robin"
    assert picks == [A, B, C, A, B, C]
    assert r.num_sessions == 0


def test_kv_policy_has_no_stickiness():
    r = router(RoutingPolicy.KV)
    r.record("s1", RouteDecision(A, None, "load"), [], 0.0)
    d = r.route("s1", [1, 2], [WorkerView(A), WorkerView(B, cached={1, 2})], [], 1.0)
    assert (d.decode, d.reason) == (B, "kv")


def test_prefill_worker_is_chosen_and_sticks_with_the_session():
    r = router()
    d = r.route("s1", [1], views(A), [WorkerView(P1, load=0.5), WorkerView(P2, cached={1})],
                0.0)
    assert d.prefill == P2
    r.record("s1", d, [1], 0.0)
    again = r.route("s1", [1, 2], views(A), [WorkerView(P1), WorkerView(P2, load=0.4)], 1.0)
    assert again.prefill == P2
    dead = r.route("s1", [1], views(A), [WorkerView(P1), WorkerView(P2, healthy=False)], 2.0)
    assert dead.prefill == P1
    assert r.route("s1", [1], views(A), [WorkerView(P1, healthy=False)], 3.0).prefill is None


def test_retry_excludes_tried_workers():
    r = router()
    d = r.route("s", [], views(A, B), [], 0.0, exclude=[A])
    assert d.decode == B


def test_session_table_is_bounded_and_expires():
    r = router(max_sessions=2, session_ttl_s=10.0)
    for i, s in enumerate(["a", "b", "c"]):
        r.record(s, RouteDecision(A, None, "load"), [], float(i))
    assert r.num_sessions == 2 and r.session_of("a") is None
    assert r.expire_sessions(11.5) == 1  # "b" (t=1) is older than 10 s, "c" (t=2) is not
    assert r.session_of("c") == (A, None)


def test_a_shared_system_prompt_does_not_drown_a_sessions_own_prefix():
    """Issue 5: both workers hold the 84-block system prompt; A also holds the session's
    previous turn (9 more blocks of a 100-block prompt). A's lead must outweigh a moderate
    load difference (the old score, 93/100 vs 84/100, lost to 0.3 of load)."""
    system, own = list(range(84)), list(range(1000, 1016))
    prompt = system + own
    decodes = [WorkerView(A, load=0.5, cached=set(system + own[:9])),
               WorkerView(B, load=0.2, cached=set(system))]
    for policy in (RoutingPolicy.KV, RoutingPolicy.SESSION):
        d = router(policy).route("s-new", prompt, decodes, [], 0.0)
        assert (d.decode, d.reason, d.overlap_blocks) == (A, "kv", 93)
    # with nothing beyond the shared prefix anywhere, load decides
    even = [WorkerView(A, load=0.5, cached=set(system)), WorkerView(B, load=0.2,
                                                                     cached=set(system))]
    assert router(RoutingPolicy.KV).route("", prompt, even, [], 0.0).decode == B


def test_a_new_session_with_a_parent_starts_on_the_parents_workers():
    r = router()
    r.record("parent", RouteDecision(A, P1, "load"), [1, 2], 0.0)
    decodes = [WorkerView(A, load=0.9), WorkerView(B, load=0.0)]  # B looks better
    d = r.route("child", [1, 2, 3], decodes, views(P1, P2), 1.0, parent_session_id="parent")
    assert (d.decode, d.prefill, d.reason, d.overlap_blocks) == (A, P1, "parent", 2)
    r.record("child", d, [1, 2, 3], 1.0)
    r.record("parent", RouteDecision(B, P2, "moved"), [1, 2], 2.0)  # the parent moves on
    d = r.route("child", [1, 2, 3, 4], decodes, views(P1, P2), 3.0,
                parent_session_id="parent")
    assert (d.decode, d.reason) == (A, "sticky")  # the child keeps its own session
    # an unknown parent, or one whose worker is overloaded, routes like a new session
    assert r.route("orphan", [], decodes, [], 3.0, parent_session_id="nobody").decode == B
    overloaded = [WorkerView(A, load=2.0), WorkerView(B, load=0.0)]
    d = r.route("child2", [], overloaded, [], 3.0, parent_session_id="child")
    assert (d.decode, d.reason) == (B, "load")
