"""Prometheus metrics of one gateway (own registry, so tests can run several in a process).

TTFT is from the request's arrival at the gateway (before templating) to its first token
chunk; ITL is between token chunks of one completion; E2E from arrival to the last Finished.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from protos import common_pb2

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0, 60.0, 120.0, 300.0)
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("baton_gateway_requests", "Finished requests by endpoint and "
                                "HTTP status", ["endpoint", "status"], registry=r)
        self.errors = Counter("baton_gateway_errors", "Errors; where='response': an error "
                              "HTTP status; where='stream': an SSE error event after a 200 "
                              "(status is then the error code)", ["status", "where"],
                              registry=r)
        self.ttft = Histogram("baton_gateway_ttft_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("baton_gateway_itl_seconds", "Inter-token latency",
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("baton_gateway_e2e_seconds", "Request latency, arrival to end",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.routing = Counter("baton_gateway_routing_decisions", "Routing decisions by policy "
                               "and reason", ["policy", "reason"], registry=r)
        self.retries = Counter("baton_gateway_retries", "Requests retried on another decode "
                               "worker before their first token", ["reason"], registry=r)
        self.inflight = Gauge("baton_gateway_inflight_requests", "Requests in flight",
                              registry=r)
        self.healthy_workers = Gauge("baton_gateway_healthy_workers", "Healthy workers by role",
                                     ["role"], registry=r)
        self.prompt_tokens = Counter("baton_gateway_prompt_tokens", "Prompt tokens",
                                     registry=r)
        self.cached_tokens = Counter("baton_gateway_cached_prompt_tokens",
                                     "Prompt tokens served from a prefix cache", registry=r)
        self.cached_by = Counter("baton_gateway_cached_prompt_tokens_by_source",
                                 "Prompt tokens not computed, by where they came from "
                                 "(decode_pool, prefill_pool, host_tier, disk_tier, store)",
                                 ["source"], registry=r)
        self.recomputed_held = Counter("baton_gateway_recomputed_held_tokens",
                                       "Prompt tokens computed although a worker held them",
                                       registry=r)
        self.completion_tokens = Counter("baton_gateway_completion_tokens",
                                         "Generated tokens", registry=r)
        self.slo_rejections = Counter("baton_gateway_slo_rejections",
                                      "Requests refused with 429 slo_unattainable: their "
                                      "predicted TTFT exceeded --slo-ttft-ms", registry=r)
        self.disconnects = Counter("baton_gateway_client_disconnects",
                                   "Requests aborted because the client went away", registry=r)
        self.worker_restarts = Counter("baton_gateway_worker_restarts", "Workers seen with a "
                                       "new kv_epoch (restarted), by role", ["role"],
                                       registry=r)

    def count_restart(self, role: str, address: str) -> None:
        """A poll saw the worker at `address` restarted (WorkerPool's on_worker_restarted)."""
        self.worker_restarts.labels(role).inc()

    def count_cached_by(self, usage) -> None:
        """A finished request's Usage split (common_pb2.Usage.cached_by) into the counters."""
        for c in usage.cached_by:
            name = common_pb2.KVSource.Name(c.source).removeprefix("KV_SOURCE_").lower()
            self.cached_by.labels(name).inc(c.num_tokens)
        self.recomputed_held.inc(usage.recomputed_held_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
