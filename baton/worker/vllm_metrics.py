"""vLLM-compatible metrics beside Baton's own on a worker's /metrics, so dashboards, routers
and autoscalers written against vLLM (its Grafana board, llm-d's scorers, Dynamo's planner)
read a Baton worker unchanged. Names, types and units follow vLLM v1; every series carries
vLLM's labels `model_name` (the served model name) and `engine` ("0": one engine a process).

    vllm:num_requests_running            gauge      requests in the running batch
    vllm:num_requests_waiting            gauge      queued + waiting for remote KV (vLLM
                                                    keeps WAITING_FOR_REMOTE_KVS in waiting)
    vllm:kv_cache_usage_perc             gauge      fraction of KV blocks in use, 0..1
    vllm:prefix_cache_queries_total      counter    prompt tokens looked up  } once per
    vllm:prefix_cache_hits_total         counter    of those, tokens found   } request
    vllm:num_preemptions_total           counter
    vllm:prompt_tokens_total             counter    prompt tokens of requests that started
    vllm:generation_tokens_total         counter    output tokens
    vllm:spec_decode_num_drafts          counter    speculative decoding: rows verified with
    vllm:spec_decode_num_draft_tokens    counter    drafts, drafted tokens, accepted ones, and
    vllm:spec_decode_num_accepted_tokens counter    accepted ones by draft position (label
    vllm:spec_decode_num_accepted_tokens_per_pos    `position`, from 0; counter)
    vllm:time_to_first_token_seconds     histogram  decode role only (it sees the stream)
    vllm:inter_token_latency_seconds     histogram  decode role only
The engine values are read from `EngineCounts` at scrape time (a collector: no engine
internals, nothing to keep in step); the two histograms are observed by the decode stream.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from baton.engine.stats import EngineCounts

LABELS = ("model_name", "engine")
ENGINE_INDEX = "0"
# vLLM v1's buckets (vllm/v1/metrics/loggers.py), so histogram quantiles compare directly
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)


class VllmEngineCollector(Collector):
    """The engine-state series of the module docstring, from `counts()` at each scrape."""

    def __init__(self, counts: Callable[[], EngineCounts], model_name: str) -> None:
        self._counts = counts
        self._labels = [model_name, ENGINE_INDEX]

    def collect(self) -> Iterator[Metric]:
        """One sample per series (prometheus_client calls this on every scrape)."""
        c = self._counts()
        usage = 1.0 - c.num_free_blocks / c.num_total_blocks if c.num_total_blocks else 0.0
        yield self._one(GaugeMetricFamily, "vllm:num_requests_running",
                        "Number of requests in model execution batches.", c.num_running)
        yield self._one(GaugeMetricFamily, "vllm:num_requests_waiting",
                        "Number of requests waiting to be processed.",
                        c.num_waiting + c.num_waiting_for_remote_kv)
        yield self._one(GaugeMetricFamily, "vllm:kv_cache_usage_perc",
                        "KV-cache usage. 1 means 100 percent usage.", usage)
        for name, doc, value in (
            ("prefix_cache_queries", "Prefix cache queries, in terms of number of queried "
             "tokens.", c.prefix_cache_queries),
            ("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
             c.prefix_cache_hits),
            ("num_preemptions", "Cumulative number of preemption from the engine.",
             c.num_preemptions),
            ("prompt_tokens", "Number of prefill tokens processed.", c.prompt_tokens),
            ("generation_tokens", "Number of generation tokens processed.",
             c.generation_tokens),
        ):
            yield self._one(CounterMetricFamily, f"vllm:{name}", doc, value)
        yield from self._spec(c)

    def _spec(self, c: EngineCounts) -> Iterator[Metric]:
        """vLLM's spec_decode counters (vllm/v1/spec_decode/metrics.py)."""
        for name, doc, value in (
            ("num_drafts", "Number of spec decoding drafts.", c.spec_drafts),
            ("num_draft_tokens", "Number of draft tokens.", c.spec_draft_tokens),
            ("num_accepted_tokens", "Number of accepted tokens.", c.spec_accepted_tokens),
        ):
            yield self._one(CounterMetricFamily, f"vllm:spec_decode_{name}", doc, value)
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted tokens per draft position.",
                                      labels=(*LABELS, "position"))
        for position, value in enumerate(c.spec_accepted_per_pos):
            per_pos.add_metric([*self._labels, str(position)], value)
        yield per_pos

    def _one(self, family: type, name: str, doc: str, value: float) -> Metric:
        m = family(name, doc, labels=LABELS)
        m.add_metric(self._labels, value)
        return m


def vllm_latency_histograms(registry: CollectorRegistry, model_name: str
                            ) -> tuple[Histogram, Histogram]:
    """(TTFT, ITL) histograms with vLLM's names, buckets and labels, in `registry`."""
    ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token "
                     "in seconds.", LABELS, buckets=TTFT_BUCKETS, registry=registry)
    itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency "
                    "in seconds.", LABELS, buckets=ITL_BUCKETS, registry=registry)
    return ttft.labels(model_name, ENGINE_INDEX), itl.labels(model_name, ENGINE_INDEX)
