"""Prometheus metrics of one prefill worker, in a registry of its own (so two workers can
share a process in tests). Gauges read the engine lazily at scrape time; the vLLM-named
series sit beside Baton's (baton/worker/vllm_metrics.py)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from baton.worker.session_metrics import SessionKVCollector
from baton.worker.tier_metrics import KVTierCollector
from baton.worker.vllm_metrics import VllmEngineCollector

_SECONDS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class PrefillMetrics:
    """model_name: the served model name, the vLLM series' `model_name` label."""

    def __init__(self, model_name: str = "") -> None:
        self.model_name = model_name
        r = self.registry = CollectorRegistry()
        self.waiting = Gauge("baton_prefill_waiting_requests", "Requests queued in the engine",
                             registry=r)
        self.running = Gauge("baton_prefill_running_requests", "Requests in the running batch",
                             registry=r)
        self.held = Gauge("baton_prefill_held_requests", "Requests whose blocks are leased",
                          registry=r)
        self.free_blocks = Gauge("baton_kv_free_blocks", "KV blocks no request holds",
                                 registry=r)
        self.requests = Counter("baton_prefill_requests", "Prefill calls by outcome",
                                ["status"], registry=r)
        self.computed_tokens = Counter("baton_prefill_computed_tokens",
                                       "Prompt tokens computed", registry=r)
        self.cache_hit_tokens = Counter("baton_prefill_cache_hit_tokens",
                                        "Prompt tokens found in the prefix cache", registry=r)
        self.pulled_tokens = Counter("baton_prefill_pulled_tokens",
                                     "Prompt tokens read from the decode worker's pool "
                                     "instead of computed (kv_pull.py)", registry=r)
        self.transferred_blocks = Counter("baton_kv_transferred_blocks",
                                          "KV blocks sent to decode workers", registry=r)
        self.transferred_bytes = Counter("baton_kv_transferred_bytes",
                                         "KV bytes sent to decode workers", registry=r)
        self.transfer_seconds = Histogram("baton_kv_transfer_seconds", "KV transfer time",
                                          buckets=_SECONDS, registry=r)
        self.compute_seconds = Histogram("baton_prefill_compute_seconds",
                                         "Queue + compute time of a prefill", buckets=_SECONDS,
                                         registry=r)
        self.leases_expired = Counter("baton_prefill_leases_expired",
                                      "Held blocks released by lease expiry", registry=r)

    def watch(self, engine, held: dict) -> None:
        """Point the gauges at live state (EngineCounts: safe from the scrape thread)."""
        self.registry.register(VllmEngineCollector(engine.counts, self.model_name))
        self.registry.register(KVTierCollector(engine.counts))
        self.registry.register(SessionKVCollector(engine))
        self.waiting.set_function(lambda: engine.counts().num_waiting)
        self.running.set_function(lambda: engine.counts().num_running)
        self.free_blocks.set_function(lambda: engine.counts().num_free_blocks)
        self.held.set_function(lambda: len(held))
