"""GET /metrics/workers: every worker's Prometheus metrics through the gateway, one scrape.

Workers serve their own /metrics on --metrics-port (`baton up` gives each a free port) and
report that port in WorkerStats.metrics_port; the gateway already polls those stats, so it
knows where each one is. A scrape here fetches them all at once (timeout each), adds the
labels `worker` (its gRPC address) and `role` to every sample, and merges them family by
family (one HELP/TYPE per name, as the exposition format requires), plus
`baton_worker_metrics_up{worker, role}` 1/0 for whether the fetch worked. Gateway metrics
stay on GET /metrics: worker and gateway names overlap (baton_ttft_seconds). GET /metrics
carries the workers' `vllm:*` families too (the same merge, those names only, a shorter
timeout), since harnesses such as AgentX and Grafana read vLLM's names from the one URL
they were given: one sample per worker, labelled, so `sum by (...)` gives the cluster's.

A scrape is cheap, since harnesses poll: AIPerf (under AgentX) reads GET /metrics every
second or so through a whole run, and on a 2-core host every millisecond here is taken from
the decode step. Each scrape once built a new client, and so a new verified TLS context
(`ssl.create_default_context` loads the CA bundle: 63 % of the gateway's CPU during an AgentX
run, py-spy; the gateway at 13-19 % of a core beside the decode worker, vLLM's API server at
4 %); the context is now built once. With a `prefix`, only the lines of those families are
parsed.
"""
from __future__ import annotations

import asyncio
import functools
import ssl
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import httpx
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from gateway.config import split_host_port


class Target(NamedTuple):
    """One worker's metrics endpoint."""

    role: str
    address: str  # its gRPC address: the `worker` label
    url: str


def metrics_url(address: str, metrics_port: int) -> str | None:
    """http://host:metrics_port/metrics of a worker at gRPC `address`; None without a port."""
    if not metrics_port:
        return None
    host, _ = split_host_port(address)
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{metrics_port}/metrics"


async def scrape(targets: Sequence[Target], timeout_s: float, prefix: str = "",
                 with_up: bool = True) -> bytes:
    """The merged exposition text of every target (see the module docstring); only the
    families whose name starts with `prefix`; `baton_worker_metrics_up` when `with_up`."""
    if not targets and not with_up:
        return b""
    async with httpx.AsyncClient(timeout=timeout_s, verify=_tls_context()) as client:
        texts = await asyncio.gather(*(_fetch(client, t.url) for t in targets))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(list(zip(targets, texts)), prefix, with_up))
    return generate_latest(registry)


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """httpx's default verified context, built once (the targets are plain http: never used
    to connect, but a client builds one unless given it)."""
    return ssl.create_default_context()


def families_of(text: str, prefix: str) -> str:
    """The lines of `text` (exposition format) that belong to families named `prefix`...:
    their samples and their HELP / TYPE lines (all of it when `prefix` is empty)."""
    if not prefix:
        return text
    heads = (f"# HELP {prefix}", f"# TYPE {prefix}", prefix)
    return "".join(line for line in text.splitlines(keepends=True) if line.startswith(heads))


async def _fetch(client: httpx.AsyncClient, url: str) -> str | None:
    try:
        r = await client.get(url)
        r.raise_for_status()
        return r.text
    except httpx.HTTPError:
        return None


class _Merged(Collector):
    def __init__(self, scraped: list[tuple[Target, str | None]], prefix: str,
                 with_up: bool) -> None:
        self._scraped, self._prefix, self._with_up = scraped, prefix, with_up

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        up = GaugeMetricFamily("baton_worker_metrics_up", "1 when the worker's /metrics "
                               "answered this scrape", labels=["worker", "role"])
        for target, text in self._scraped:
            up.add_metric([target.address, target.role], 0.0 if text is None else 1.0)
            for family in text_string_to_metric_families(families_of(text or "", self._prefix)):
                if not family.name.startswith(self._prefix):
                    continue
                merged = families.setdefault(
                    family.name, Metric(family.name, family.documentation, family.type))
                extra = {"worker": target.address, "role": target.role}
                merged.samples.extend(s._replace(labels={**s.labels, **extra})
                                      for s in family.samples)
        if self._with_up:
            yield up
        yield from families.values()
