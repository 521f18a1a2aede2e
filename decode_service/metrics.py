"""Prometheus metrics of one decode worker, in a registry of its own (so two workers can
share a process in tests). Engine gauges read live state lazily at scrape time; the vLLM-named
series sit beside Baton's (baton/worker/vllm_metrics.py)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from baton.worker.session_metrics import SessionKVCollector
from baton.worker.tier_metrics import KVTierCollector
from baton.worker.wire import source_label
from decode_service.usage import PromptUsage
from baton.worker.vllm_metrics import VllmEngineCollector, vllm_latency_histograms

_SECONDS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class DecodeMetrics:
    """model_name: the served model name, the vLLM series' `model_name` label."""

    def __init__(self, model_name: str = "") -> None:
        self.model_name = model_name
        r = self.registry = CollectorRegistry()
        self.waiting = Gauge("baton_decode_waiting_requests", "Requests queued in the engine",
                             registry=r)
        self.running = Gauge("baton_decode_running_requests", "Requests in the running batch",
                             registry=r)
        self.remote_inflight = Gauge("baton_decode_remote_prefills_inflight",
                                     "Sequences waiting for remote KV", registry=r)
        self.quarantined = Gauge("baton_decode_quarantined_requests",
                                 "Sequences whose blocks wait out an unconfirmed transfer",
                                 registry=r)
        self.quarantines = Counter("baton_decode_quarantines",
                                   "Sequences whose blocks waited out an unconfirmed transfer",
                                   registry=r)
        self.quarantines_confirmed = Counter(
            "baton_decode_quarantines_confirmed",
            "Quarantines ended before the prefill deadline: a re-sent Abort was answered",
            registry=r)
        self.free_blocks = Gauge("baton_kv_free_blocks", "KV blocks no request holds",
                                 registry=r)
        self.ttft = Histogram("baton_ttft_seconds", "Time to first token", buckets=_SECONDS,
                              registry=r)
        self.itl = Histogram("baton_itl_seconds", "Inter-token latency", buckets=_SECONDS,
                             registry=r)
        self.requests = Counter("baton_decode_requests", "Finished sequences by reason",
                                ["finish_reason"], registry=r)
        self.cache_hit_tokens = Counter("baton_decode_cache_hit_tokens",
                                        "Prompt tokens found in this worker's prefix cache",
                                        registry=r)
        self.remote_prefills = Counter("baton_decode_remote_prefills",
                                       "Remote prefill outcomes", ["outcome"], registry=r)
        self.received_blocks = Counter("baton_kv_received_blocks",
                                       "KV blocks written by prefill workers", registry=r)
        self.received_bytes = Counter("baton_kv_received_bytes",
                                      "KV bytes written by prefill workers", registry=r)
        self.transfer_seconds = Histogram("baton_kv_transfer_seconds",
                                          "KV transfer time (sender) + arrival wait",
                                          buckets=_SECONDS, registry=r)
        self.pd_decisions = Counter("baton_decode_pd_decisions",
                                    "Local / remote prefill decisions (decode_service/"
                                    "baton/pd_cost.py) by path and reason", ["path", "reason"],
                                    registry=r)
        self.pd_rates = Gauge("baton_decode_pd_learned_rate", "The P/D decider's learned "
                              "rates (EWMA; peer: the prefill worker of a remote rate, empty "
                              "for the local one)", ["kind", "peer"], registry=r)
        self.pd_rejected_samples = Counter(
            "baton_decode_pd_rejected_samples", "Rate samples the P/D decider did not take "
            "(not positive, or 100x off the learned rate: decode_service/pd_rates.py)",
            ["kind"], registry=r)
        self.prefill_peer_restarts = Counter(
            "baton_decode_prefill_peer_restarts", "Prefill peers seen with a new kv_epoch "
            "(a restarted process): handshaken again at once", registry=r)
        self.cached_prompt_tokens = Counter(
            "baton_decode_cached_prompt_tokens", "Prompt tokens not computed for a request, "
            "by where they came from (decode_pool, prefill_pool, host_tier, disk_tier, store)",
            ["source"], registry=r)
        self.recomputed_held_tokens = Counter(
            "baton_decode_recomputed_held_tokens", "Prompt tokens a prefill worker computed "
            "although this decode worker held them (its prefix hit beyond prefill's)",
            registry=r)
        self.vllm_ttft, self.vllm_itl = vllm_latency_histograms(r, model_name)

    def count_usage(self, usage: PromptUsage) -> None:
        """One request's prompt usage (decode_service/usage.py) into the counters."""
        for source, n in usage.cached_by.items():
            self.cached_prompt_tokens.labels(source_label(source)).inc(n)
        self.recomputed_held_tokens.inc(usage.recomputed_held_tokens)

    def observe_first_token(self, seconds: float) -> None:
        """Time from arrival to a request's first token (Baton's and vLLM's histogram)."""
        self.ttft.observe(seconds)
        self.vllm_ttft.observe(seconds)

    def observe_tokens(self, seconds_per_token: float, num_tokens: int) -> None:
        """num_tokens more tokens of one sequence, seconds_per_token apart on average."""
        self.itl.observe(seconds_per_token)
        for _ in range(num_tokens):  # vLLM counts one inter-token gap per token
            self.vllm_itl.observe(seconds_per_token)

    def watch(self, engine) -> None:
        """Point the engine gauges at live state (EngineCounts: safe from the scrape thread)."""
        self.registry.register(VllmEngineCollector(engine.counts, self.model_name))
        self.registry.register(KVTierCollector(engine.counts))
        self.registry.register(SessionKVCollector(engine))
        self.waiting.set_function(lambda: engine.counts().num_waiting)
        self.running.set_function(lambda: engine.counts().num_running)
        self.free_blocks.set_function(lambda: engine.counts().num_free_blocks)
