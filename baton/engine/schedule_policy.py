"""Admission orders of the waiting queue (`SchedulerConfig.policy`), as pure functions the
scheduler applies before its admission rules (scheduler.py)."""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

from baton.config import SchedulerConfig
from baton.engine.kv_cache import KVCacheManager
from baton.engine.request import Request, RequestStatus


def aged(r: Request, now: float, config: SchedulerConfig) -> bool:
    """True once `r` has waited `max_prefill_wait_s` since arrival (seconds, monotonic)."""
    return now - r.arrival_time >= config.max_prefill_wait_s


def order_key(r: Request, now: float, config: SchedulerConfig,
              uncached: Callable[[], int]) -> tuple:
    """shortest_first's sort key of `r`, `uncached()` its prompt tokens left to compute
    (called only when the key needs it): lower goes first (see `shortest_first`). Also
    compares a running partial prefill with the waiting queue's head (prefill_target.py:
    the one with the higher key yields the step)."""
    if r.status is RequestStatus.PREEMPTED:
        return (0, 0, 0.0)  # equal keys: the stable sort keeps their queue order
    blocked = r.blocked_since is not None and now - r.blocked_since >= config.max_bypass_s
    if blocked or aged(r, now, config):
        return (1, 0, r.arrival_time)
    return (2, uncached(), r.arrival_time)


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
    return sorted(waiting, key=lambda r: order_key(r, now, config, lambda: uncached(r)))


class WaitingOrder:
    """Sorts a scheduler's waiting queue by its policy each step (fcfs: leaves it).

    An exact hit per request per step (get_computed_blocks) costs ~1 ms a 20k-token prompt
    (64 of them: 64 ms; hash lookups alone 18 ms), so each hit is an estimate moved only by
    the blocks that changed since the last step (`KVCacheManager.estimate_hit_blocks`),
    from the estimate kept here.
    """

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config, self.kv = config, kv
        self._hit_blocks: dict[str, int] = {}  # waiting request → estimated hit (last order)

    def sort(self, waiting: deque[Request], now: float,
             keep_estimates: bool = False) -> Callable[[Request], tuple] | None:
        """Sort `waiting` in place; return shortest_first's key at `now` for any request
        (a running one's uncached tokens are those it has left; None under fcfs). Estimates
        made by the key after this call are kept for the next step's order too when
        `keep_estimates` (the caller merges running requests in by key)."""
        if self.config.policy != "shortest_first":
            return None
        bs, old, hits = self.kv.block_size, self._hit_blocks, {}

        def uncached(r: Request) -> int:
            if r.status is RequestStatus.RUNNING:
                return r.num_tokens - r.num_computed_tokens
            if r.request_id not in hits:
                hits[r.request_id] = self.kv.estimate_hit_blocks(
                    r.request_id, r.all_token_ids, old.get(r.request_id, 0))
            return r.num_tokens - hits[r.request_id] * bs

        def key(r: Request) -> tuple:
            return order_key(r, now, self.config, lambda: uncached(r))

        if len(waiting) > 1:
            order = shortest_first(waiting, now, self.config, uncached)
            waiting.clear()
            waiting.extend(order)
        if hits or keep_estimates:
            self._hit_blocks = hits
        return key
