"""The session-retention and prefetch series on a worker's /metrics (decode and prefill alike),
read from the engine's KV manager at scrape time (single int reads; engine/free_lists.py,
engine/kv_prefetch.py).

    baton_kv_session_free_blocks             gauge    free blocks kept in session lists
                                                      (classes b and c: evicted after the
                                                      session-less ones)
    baton_kv_pinned_evictions_total          counter  blocks of sessions inside their TTL
                                                      evicted because nothing else was free
    baton_kv_prefetched_blocks_total         counter  blocks loaded from the KV tier when a
                                                      request arrived, ahead of its admission
    baton_kv_prefetch_hits_total             counter  prefetched blocks a request then took
    baton_kv_prefetch_wasted_blocks_total    counter  prefetched blocks evicted unused
"""
from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


class SessionKVCollector(Collector):
    """The series of the module docstring for `engine.kv` (a KVCacheManager); none for an
    engine without one (the metrics tests' stand-ins)."""

    def __init__(self, engine) -> None:
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        kv = getattr(self._engine, "kv", None)
        if kv is None:
            return
        pool = kv.pool
        yield GaugeMetricFamily("baton_kv_session_free_blocks",
                                "Free KV blocks kept in session lists (evicted after the "
                                "session-less ones)", value=pool.free.num_session_free)
        for name, doc, value in (
                ("pinned_evictions", "Blocks of sessions inside their TTL evicted because "
                 "nothing else was free", pool.free.pinned_evictions),
                ("prefetched_blocks", "Blocks loaded from the KV tier ahead of admission",
                 kv.prefetched_blocks),
                ("prefetch_hits", "Prefetched blocks a request then took", pool.prefetch_hits),
                ("prefetch_wasted_blocks", "Prefetched blocks evicted unused",
                 pool.prefetch_wasted)):
            yield CounterMetricFamily(f"baton_kv_{name}", doc, value=value)
