"""Shared by the restart and chaos tests (real `baton up` clusters): which process a worker
address runs now and what that process has counted, read from the process itself.

    Output(proc)                    baton up's stdout read by a thread, each line timed
    process_metrics(role, address) -> Process(kv_epoch, samples)   GetStats (its kv_epoch and
                                                                    metrics_port), then its
                                                                    own GET /metrics
    worker_addresses(url, role)     the gateway's view (GET /metrics/workers)
    count(samples, name, **labels)  the sum of the samples of `name` whose labels match

A restarted process starts its counters from zero under a new kv_epoch, so what a Process
counts is that process's own work, never its predecessor's.
"""
from __future__ import annotations

import asyncio
import threading
import time
from typing import NamedTuple

import grpc
import httpx
from prometheus_client.parser import text_string_to_metric_families

from protos import common_pb2, decode_pb2_grpc, prefill_pb2_grpc

_STUBS = {"prefill": prefill_pb2_grpc.PrefillServiceStub,
          "decode": decode_pb2_grpc.DecodeServiceStub}


class Sample(NamedTuple):
    name: str
    labels: dict[str, str]
    value: float


class Process(NamedTuple):
    kv_epoch: int
    samples: list[Sample]


def parse_samples(text: str) -> list[Sample]:
    return [Sample(s.name, s.labels, s.value)
            for fam in text_string_to_metric_families(text) for s in fam.samples]


def count(samples: list[Sample], name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels`."""
    return sum(s.value for s in samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def process_metrics(role: str, address: str, timeout_s: float = 5.0) -> Process:
    """The kv_epoch and /metrics of the process serving `address` now. Raises grpc.RpcError
    or httpx.HTTPError while it is down."""
    with grpc.insecure_channel(address) as channel:
        stats = _STUBS[role](channel).GetStats(common_pb2.GetStatsRequest(),
                                               timeout=timeout_s)
    host = address.rsplit(":", 1)[0]
    text = httpx.get(f"http://{host}:{stats.metrics_port}/metrics", timeout=timeout_s).text
    return Process(stats.kv_epoch, parse_samples(text))


def worker_addresses(url: str, role: str) -> list[str]:
    """The `role` workers the gateway at `url` knows (GET /metrics/workers)."""
    text = httpx.get(url + "/metrics/workers", timeout=10).text
    return sorted(s.labels["worker"] for s in parse_samples(text)
                  if s.name == "baton_worker_metrics_up" and s.labels.get("role") == role)


REMOTE_OUTCOMES = ("ok", "recompute", "failed", "rejected", "aborted")


def remote_outcomes(samples: list[Sample]) -> dict[str, float]:
    """A decode process's remote prefills by outcome (baton_decode_remote_prefills_total;
    "local" and "unreachable" are no remote prefill)."""
    return {o: count(samples, "baton_decode_remote_prefills_total", outcome=o)
            for o in REMOTE_OUTCOMES}


class Output:
    """baton up's stdout, line by line, with the time.monotonic() each one was read."""

    def __init__(self, proc) -> None:
        self.lines: list[tuple[float, str]] = []
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc) -> None:
        for line in proc.stdout:
            with self._cond:
                self.lines.append((time.monotonic(), line))
                self._cond.notify_all()

    def rest(self, since: int, timeout_s: float) -> str:
        """The text from line `since` on once the output ended (the process exited)."""
        self._thread.join(timeout_s)
        return self.text(since)

    def mark(self) -> int:
        with self._cond:
            return len(self.lines)

    def wait_sync(self, text: str, since: int, timeout_s: float) -> float:
        """When the first line from index `since` on containing `text` was read."""
        end = time.monotonic() + timeout_s
        with self._cond:
            while True:
                for t, line in self.lines[since:]:
                    if text in line:
                        return t
                left = end - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no {text!r} in baton up's output within "
                                         f"{timeout_s:g} s: {self.text(since)}")
                self._cond.wait(left)

    async def wait(self, text: str, since: int, timeout_s: float = 90.0) -> float:
        return await asyncio.to_thread(self.wait_sync, text, since, timeout_s)

    def text(self, since: int = 0) -> str:
        with self._cond:
            return "".join(line for _, line in self.lines[since:])
