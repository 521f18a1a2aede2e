"""GET /metrics/workers: the gateway fetches every worker's /metrics (the port each reports
in WorkerStats.metrics_port) and labels each sample with its worker and role."""
from __future__ import annotations

import asyncio

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server
from prometheus_client.parser import text_string_to_metric_families

from tests.gateway.conftest import FakeWorker, running_gateway


def _worker_registry(running: int) -> CollectorRegistry:
    r = CollectorRegistry()
    Gauge("vllm:num_requests_running", "running", ["model_name"], registry=r) \
        .labels("tiny").set(running)
    Counter("vllm:prompt_tokens", "prompt tokens", ["model_name"], registry=r) \
        .labels("tiny").inc(10 * running)
    Gauge("baton_kv_free_blocks", "a worker's own series", registry=r).set(7)
    return r


async def test_worker_metrics_are_merged_with_worker_and_role_labels(prompts):
    servers = [start_http_server(0, addr="127.0.0.1", registry=_worker_registry(n))
               for n in (1, 2)]
    workers = [await FakeWorker.start(worker_id=f"w{i}", metrics_port=s[0].server_port)
               for i, s in enumerate(servers)]
    silent = await FakeWorker.start(worker_id="gone", metrics_port=1)  # nothing listens
    bare = await FakeWorker.start(worker_id="bare")  # no metrics port: not listed
    try:
        async with running_gateway(prompts, [*workers, silent, bare]) as gw, \
                httpx.AsyncClient(base_url=gw.http_url, timeout=10) as c:
            await asyncio.sleep(0.3)  # a stats poll or more (poll_interval_s 0.05)
            r = await c.get("/metrics/workers")
        assert r.status_code == 200 and r.text.count("# TYPE vllm:prompt_tokens_total") == 1
        samples = [s for f in text_string_to_metric_families(r.text) for s in f.samples]
        running = {s.labels["worker"]: s.value for s in samples
                   if s.name == "vllm:num_requests_running"}
        assert running == {workers[0].address: 1.0, workers[1].address: 2.0}
        tokens = [s for s in samples if s.name == "vllm:prompt_tokens_total"]
        assert sorted(s.value for s in tokens) == [10.0, 20.0]
        assert all(s.labels["role"] == "decode" and s.labels["model_name"] == "tiny"
                   for s in tokens)
        up = {s.labels["worker"]: s.value for s in samples
              if s.name == "baton_worker_metrics_up"}
        assert up == {workers[0].address: 1.0, workers[1].address: 1.0, silent.address: 0.0}
    finally:
        for w in [*workers, silent, bare]:
            await w.stop(0)
        for httpd, thread in servers:
            httpd.shutdown()


async def test_the_gateways_metrics_carry_the_workers_vllm_series(prompts):
    """GET /metrics: the gateway's own series, then every worker's `vllm:*` series with its
    worker and role labels (what AgentX and Grafana read from the one URL); nothing else
    of the workers'."""
    servers = [start_http_server(0, addr="127.0.0.1", registry=_worker_registry(n))
               for n in (1, 2)]
    workers = [await FakeWorker.start(worker_id=f"w{i}", metrics_port=s[0].server_port)
               for i, s in enumerate(servers)]
    try:
        async with running_gateway(prompts, workers) as gw, \
                httpx.AsyncClient(base_url=gw.http_url, timeout=10) as c:
            await asyncio.sleep(0.3)
            r = await c.get("/metrics")
        samples = [s for f in text_string_to_metric_families(r.text) for s in f.samples]
        running = {s.labels["worker"]: s.value for s in samples
                   if s.name == "vllm:num_requests_running"}
        assert running == {workers[0].address: 1.0, workers[1].address: 2.0}
        assert sum(s.value for s in samples if s.name == "vllm:prompt_tokens_total") == 30.0
        names = {s.name for s in samples}
        assert "baton_gateway_inflight_requests" in names
        assert not names & {"baton_kv_free_blocks", "baton_worker_metrics_up"}
    finally:
        for w in workers:
            await w.stop(0)
        for httpd, thread in servers:
            httpd.shutdown()


def test_a_prefix_keeps_only_its_families_lines():
    """GET /metrics parses only the workers' `vllm:*` lines (harnesses poll it every second)."""
    from gateway.worker_metrics import families_of
    text = ("# HELP vllm:a Requests.\n# TYPE vllm:a counter\nvllm:a_total{x=\"1\"} 2.0\n"
            "# HELP baton_b B.\n# TYPE baton_b gauge\nbaton_b 1.0\n"
            "# HELP vllm:h H.\n# TYPE vllm:h histogram\nvllm:h_bucket{le=\"+Inf\"} 3.0\n"
            "vllm:h_count 3.0\nvllm:h_sum 1.5\n")
    kept = families_of(text, "vllm:")
    assert "baton_b" not in kept and kept.count("\n") == 8
    assert families_of(text, "") == text


def test_scrapes_share_one_tls_context():
    """A new verified context per scrape loaded the CA bundle each time (~29 ms here)."""
    from gateway.worker_metrics import _tls_context
    assert _tls_context() is _tls_context()
