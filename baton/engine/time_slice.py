"""Time slicing of a full pool when a KV tier keeps what it evicts (preemption as a swap).

Without a tier, preempting a running request throws its KV away, so a request that does
not fit beside the running ones waits until one of them ends: on an agent worker whose pool
holds one or two long contexts at a time, a turn with 100 new tokens waited 10–20 s behind
another session's 200-token reply (the τ-bench replay with a quarter-size pool). With a
tier, a preempted request's full blocks stay cached (in the pool while nobody needs them,
then in the host or disk tier when evicted: kv_cache.py), so bringing it back is a prefix hit
that is loaded, not computed; only its partial last block is recomputed. Then the waiting
turn need not wait for the end:

    slice_victims(waiter, running, now, slice_s, kv)
      waiter blocked for pool space ≥ slice_s            (Request.blocked_since)
      candidates: running, past their prompt (decoding), admitted ≥ slice_s ago
                  (Request.admitted_time), longest-running first
      take candidates until their blocks and the free ones cover the waiter's
      → [] when the waiter has not waited that long or all of them would not make room

Each request runs at least slice_s once admitted, so the pool is shared round robin in
slices of at least slice_s; a victim waits like any preempted request (front of the queue)
and may itself take a slice back once it has waited slice_s. vLLM v0 preempted by swapping
blocks to host memory only when the running batch itself ran out of blocks; here the tier
makes preemption cheap enough to do it for a waiting request's TTFT.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from baton.engine.kv_cache import KVCacheManager
    from baton.engine.request import Request


def slice_victims(waiter: Request, running: Sequence[Request], now: float, slice_s: float,
                  kv: KVCacheManager, reserved: int = 0) -> list[Request]:
    """Running requests to preempt so `waiter` (which found no blocks) fits; times are
    time.monotonic() seconds; `reserved`: blocks the running prompts still need. The room
    is estimated from block counts (blocks shared with others are counted as freed), so the
    caller checks the fit again after preempting."""
    if slice_s <= 0 or waiter.blocked_since is None or now - waiter.blocked_since < slice_s:
        return []
    candidates = sorted(
        (r for r in running if r is not waiter and r.admitted_time is not None
         and now - r.admitted_time >= slice_s
         and r.num_computed_tokens >= r.num_prompt_tokens),
        key=lambda r: r.admitted_time)
    need = kv.blocks_needed(waiter.num_tokens) + reserved - kv.num_free_blocks
    victims, freed = [], 0
    for r in candidates:
        if freed >= need:
            break
        victims.append(r)
        freed += kv.num_request_blocks(r.request_id)
    return victims if victims and freed >= need else []


def victims_for_waiting(waiting: Iterable[Request], running: Sequence[Request], now: float,
                        slice_s: float, kv: KVCacheManager,
                        reserved: Callable[[], int]) -> list[Request]:
    """`slice_victims` for the first of `waiting` (policy order) blocked for pool space at
    least slice_s; [] when none is. `reserved()`: blocks the running prompts still need."""
    if slice_s <= 0:
        return []
    waiter = next((r for r in waiting if r.blocked_since is not None
                   and now - r.blocked_since >= slice_s), None)
    if waiter is None:
        return []
    return slice_victims(waiter, running, now, slice_s, kv, reserved())
