"""The KV tier's series on a worker's /metrics (decode and prefill alike), one label `tier`
("host" | "disk" | "store": the cluster's KV store, engine/kv_store.py, whose blocks and
capacity are the blocks this worker knows are there and the segment it lends); read from
`EngineCounts.kv_tiers` at scrape time, absent without tiers. Beside them, always: the
engine's prefix hits in tokens by where it found them,

    baton_kv_cached_prompt_tokens_total{source}  counter  prompt tokens not computed, found
                                                          in the pool ("pool") or loaded
                                                          from "host_tier" / "disk_tier" /
                                                          "store"

    baton_kv_tier_blocks{tier}                   gauge    blocks held
    baton_kv_tier_bytes{tier}                    gauge    bytes held (disk: file bytes)
    baton_kv_tier_capacity_bytes{tier}           gauge    budget
    baton_kv_tier_hits_total{tier}               counter  block lookups found there
    baton_kv_tier_misses_total{tier}             counter  block lookups not found there
    baton_kv_tier_saved_bytes_total{tier}        counter  bytes moved down into it
    baton_kv_tier_save_seconds_total{tier}       counter  seconds spent on those moves
    baton_kv_tier_loaded_bytes_total{tier}       counter  bytes loaded back into the pool
    baton_kv_tier_load_seconds_total{tier}       counter  seconds spent on those loads
    baton_kv_tier_dropped_blocks_total{tier}     counter  blocks lost (bad file, failed write)
    baton_kv_tier_unavailable_total{tier}        counter  store calls answered "down"
    baton_kv_tier_reconnects_total{tier}         counter  new store connections after an
                                                          outage or a master restart
    baton_kv_tier_recomputed_blocks_total        counter  tier blocks found unusable on load
                                                          and recomputed
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from baton.engine.stats import EngineCounts

_GAUGES = (("blocks", "KV blocks held by the tier", lambda c: c.blocks),
           ("bytes", "Bytes held by the tier", lambda c: c.bytes),
           ("capacity_bytes", "Byte budget of the tier", lambda c: c.capacity_bytes))
_COUNTERS = (
    ("hits", "Block lookups past the pool found in the tier", lambda t: t.hits),
    ("misses", "Block lookups past the pool not found in the tier", lambda t: t.misses),
    ("saved_bytes", "Bytes moved down into the tier", lambda t: t.saved_bytes),
    ("save_seconds", "Seconds spent moving blocks into the tier", lambda t: t.save_seconds),
    ("loaded_bytes", "Bytes loaded from the tier into the pool", lambda t: t.loaded_bytes),
    ("load_seconds", "Seconds spent loading blocks from the tier", lambda t: t.load_seconds),
    ("dropped_blocks", "Blocks the tier lost (corrupt or truncated file, failed write)",
     lambda t: t.dropped_blocks),
    ("unavailable", "Tier calls not made or failed because the KV store was down",
     lambda t: t.unavailable),
    ("reconnects", "New connections to a KV store master that came back or restarted "
     "(blocks believed stored are published again)", lambda t: t.reconnects),
)


class KVTierCollector(Collector):
    """The series of the module docstring, from `counts()` at each scrape."""

    def __init__(self, counts: Callable[[], EngineCounts]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[Metric]:
        c = self._counts()
        by = CounterMetricFamily("baton_kv_cached_prompt_tokens", "Prompt tokens this engine "
                                 "did not compute, by where it found them", labels=["source"])
        for source, n in c.cached_tokens_by_source:
            by.add_metric([source.value], n)
        yield by
        if not c.kv_tiers:
            return
        for name, doc, get in _GAUGES:
            m = GaugeMetricFamily(f"baton_kv_tier_{name}", doc, labels=["tier"])
            for tier in c.kv_tiers:
                m.add_metric([tier.tier], get(tier))
            yield m
        for name, doc, get in _COUNTERS:
            m = CounterMetricFamily(f"baton_kv_tier_{name}", doc, labels=["tier"])
            for tier in c.kv_tiers:
                m.add_metric([tier.tier], get(tier.totals))
            yield m
        yield CounterMetricFamily("baton_kv_tier_recomputed_blocks",
                                  "Tier blocks found unusable on load and recomputed",
                                  value=c.kv_tier_recomputed_blocks)
