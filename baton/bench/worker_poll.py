"""The workers' queues and KV usage during a run: `GET /metrics/workers` about once a second.

A Baton gateway serves every worker's Prometheus text there, each sample labelled `worker`
(its gRPC address) and `role`. Of it we keep, per worker and poll:

    running    vllm:num_requests_running   (summed over the worker's engines)
    waiting    vllm:num_requests_waiting   (summed)
    kv_usage   vllm:kv_cache_usage_perc    (a fraction, 0..1; the largest engine's)

and two counters, read at the run's first and last poll (one more poll is taken when the run
ends) and reported as the difference, summed over workers:

    recomputed_held         baton_decode_recomputed_held_tokens_total: prompt tokens a
                            prefill worker computed although the decode worker held them
    tier_recomputed_blocks  baton_kv_tier_recomputed_blocks_total: blocks a KV tier said it
                            held but could not load (bad file), recomputed

A server without the endpoint (not Baton, or an older Baton) answers 404 or something that
is not exposition text: polling stops at the first such answer and the series says why.
Errors of a single poll later in the run are counted, not fatal. Times are seconds on the
run's clock (`series(origin)` with the run's `t0`).
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

PATH = "/metrics/workers"
FIELDS = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting",
          "vllm:kv_cache_usage_perc": "kv_usage",
          "baton_decode_recomputed_held_tokens": "recomputed_held",
          "baton_kv_tier_recomputed_blocks": "tier_recomputed_blocks"}
COUNTERS = ("recomputed_held", "tier_recomputed_blocks")


@dataclass(frozen=True)
class WorkerSample:
    role: str
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float | None = None
    recomputed_held: float | None = None  # counters: None where the worker has no such series
    tier_recomputed_blocks: float | None = None


def parse_workers(text: str) -> dict[str, WorkerSample]:
    """worker label → its sample, from one exposition text (ValueError when it is not one)."""
    values: dict[str, dict] = {}
    for family in text_string_to_metric_families(text):
        name = FIELDS.get(family.name.removesuffix("_total"))
        if name is None:
            continue
        for s in family.samples:
            if s.name not in (family.name, family.name + "_total"):
                continue  # a counter's _created sample
            worker = s.labels.get("worker", "")
            row = values.setdefault(worker, {"role": s.labels.get("role", "")})
            if name == "kv_usage":
                row[name] = max(row.get(name) or 0.0, s.value)
            else:
                row[name] = (row.get(name) or 0.0) + s.value
    return {w: WorkerSample(**row) for w, row in values.items()}


@dataclass
class WorkerSeries:
    """What report.json keeps: per worker, columns over the polls."""

    available: bool
    note: str | None = None
    polls: int = 0
    failed_polls: int = 0
    workers: dict[str, dict] = field(default_factory=dict)
    first: dict[str, WorkerSample] = field(default_factory=dict)  # each worker's first poll
    last: dict[str, WorkerSample] = field(default_factory=dict)   # and its last

    def add(self, t: float, samples: dict[str, WorkerSample]) -> None:
        for worker, s in samples.items():
            self.first.setdefault(worker, s)
            self.last[worker] = s
            col = self.workers.setdefault(worker, {"role": s.role, "t": [], "running": [],
                                                   "waiting": [], "kv_usage": []})
            col["t"].append(round(t, 3))
            col["running"].append(s.running)
            col["waiting"].append(s.waiting)
            col["kv_usage"].append(s.kv_usage)

    def counter_delta(self, name: str) -> int | None:
        """A counter's growth over the run (last poll − first), summed over workers; None
        when no worker reports it. A worker whose counter went down restarted meanwhile:
        its last value counts (all of it grew after the restart)."""
        deltas = []
        for worker, last in self.last.items():
            end, start = getattr(last, name), getattr(self.first[worker], name)
            if end is not None:
                deltas.append(end - (start or 0.0) if end >= (start or 0.0) else end)
        return round(sum(deltas)) if deltas else None

    def to_dict(self) -> dict:
        return {"available": self.available, "note": self.note, "polls": self.polls,
                "failed_polls": self.failed_polls, "workers": self.workers,
                **{f"{c}_delta": self.counter_delta(c) for c in COUNTERS}}


class WorkerPoller:
    """Poll `url`'s /metrics/workers every `interval_s` until `stop()`; run it as a task."""

    def __init__(self, url: str, interval_s: float = 1.0, timeout_s: float = 2.0):
        self.url, self.interval_s, self.timeout_s = url, interval_s, timeout_s
        self._stop = asyncio.Event()
        self._stamped: list[tuple[float, dict[str, WorkerSample]]] = []
        self._note: str | None = None
        self._available = True
        self._failed = 0

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        """Poll until stopped, or until the first answer says there is nothing to poll."""
        async with httpx.AsyncClient(base_url=self.url, timeout=self.timeout_s) as client:
            while not self._stop.is_set():
                await self._poll(client)
                if not self._available:
                    return
                try:
                    await asyncio.wait_for(self._stop.wait(), self.interval_s)
                except TimeoutError:
                    pass
            await self._poll(client)  # the run's end: the counters' last values

    async def _poll(self, client: httpx.AsyncClient) -> None:
        first = not self._stamped and not self._failed
        try:
            r = await client.get(PATH)
            r.raise_for_status()
            samples = parse_workers(r.text)
        except (httpx.HTTPError, ValueError) as exc:
            if first:
                why = (f"HTTP {exc.response.status_code}"
                       if isinstance(exc, httpx.HTTPStatusError) else f"{type(exc).__name__}")
                self._unavailable(f"GET {PATH} answered {why}")
            else:
                self._failed += 1
            return
        if first and not samples:
            self._unavailable(f"GET {PATH} has no vllm:num_requests_* samples")
            return
        self._stamped.append((time.perf_counter(), samples))

    def _unavailable(self, note: str) -> None:
        self._available, self._note = False, note + ": no worker time series"

    def series(self, origin: float) -> WorkerSeries:
        """The polls so far, times relative to `origin` (a perf_counter value)."""
        out = WorkerSeries(self._available, self._note, len(self._stamped), self._failed)
        for stamp, samples in self._stamped:
            out.add(stamp - origin, samples)
        return out
