"""Admission orders of the waiting queue (`SchedulerConfig.policy`), as pure functions the
scheduler applies before its admission rules (scheduler.py)."""
from __future__ import annotations

from collections.abc import Callable, Iterable

from baton.config import SchedulerConfig
from baton.engine.request import Request, RequestStatus


def shortest_first(waiting: Iterable[Request], now: float, config: SchedulerConfig,
                   uncached: Callable[[Request], int]) -> list[Request]:
    """The shortest_first admission order of `waiting` at time `now`.

    1. preempted requests, in queue order (as fcfs: they ran and lost their blocks);
    2. aged requests, in arrival order: waiting at least max_prefill_wait_s since arrival,
       or passed by for blocks at least max_bypass_s (so the bypass limit still holds:
       nothing younger is admitted ahead of such a request);
    3. the rest by fewest `uncached(request)` prompt tokens (prompt minus its prefix-cache
       hit), arrival breaking ties.
    A cold prompt therefore starts within max_prefill_wait_s (+ max_bypass_s if the pool is
    full then) of arriving, whatever keeps arriving behind it.
    """
    def key(r: Request) -> tuple[int, int, float]:
        if r.status is RequestStatus.PREEMPTED:
            return (0, 0, 0.0)  # equal keys: the stable sort keeps their queue order
        blocked = r.blocked_since is not None and now - r.blocked_since >= config.max_bypass_s
        if blocked or now - r.arrival_time >= config.max_prefill_wait_s:
            return (1, 0, r.arrival_time)
        return (2, uncached(r), r.arrival_time)

    return sorted(waiting, key=key)
