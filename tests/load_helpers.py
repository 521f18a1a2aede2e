"""Shared by the soak and fault tests: an SSE chat client that classifies every answer,
agent-like multi-turn sessions, worker processes on fixed ports, pool checks over gRPC
(GetStats) and resident-memory sampling.

Every answer is one of (see `Outcome.kind`):
    ok        200, the stream ended with `data: [DONE]`
    shed      429/503 with Retry-After (the gateway sheds load or has no worker right now)
    error     a `data: {"error": ...}` event, then `data: [DONE]` (every failed stream ends
              so: issue 27), or any other 5xx
    client    any other 4xx (a bug in the test or a wrong 400)
    cut       200 but the stream ended without [DONE] (after an error event too), or sent
              data after its end
    hung      no end within the client timeout
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx

from baton.worker.process import parse_ready
from protos import common_pb2, decode_pb2_grpc, prefill_pb2_grpc

REPO = Path(__file__).resolve().parent.parent
SYSTEM = ("You are a travel agent. Use tools to look up flights, then answer briefly. "
          "Flight UA 123 from SFO to JFK departs at 10:45. Baggage allowance: two bags.")
MB = 1 << 20


def free_port() -> int:
    """A free 127.0.0.1 TCP port for a process started later (or again) on a fixed port.

    Drawn below the kernel's ephemeral range (/proc/sys/net/ipv4/ip_local_port_range), which
    a port-0 bind would return: until the process binds it, any outgoing connection or port-0
    bind on the host may take an ephemeral port for itself (a gateway once failed to start
    with EADDRINUSE on the port picked for it). Ports there are taken only by an explicit
    bind. Falls back to a port-0 pick if none below is free."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(10000, max(10001, low))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- one request ----------------------------------------------------------------------------
@dataclass
class Outcome:
    kind: str
    status: int = 200
    text: str = ""
    error: str = ""
    retry_after: float | None = None
    started: float = 0.0  # time.monotonic()
    seconds: float = 0.0


async def stream_chat(client: httpx.AsyncClient, model: str, messages: list[dict],
                      session: str, max_tokens: int, timeout_s: float = 60.0,
                      **extra) -> Outcome:
    """One streaming chat request, classified (never raises for server behaviour)."""
    body = {"model": model, "messages": messages, "stream": True, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, **extra}
    t0 = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s):
            out = await _stream(client, body, session)
    except TimeoutError:
        out = Outcome("hung", error=f"no end within {timeout_s:g} s")
    except httpx.TransportError as e:  # the gateway itself hung up
        out = Outcome("error", status=0, error=f"{type(e).__name__}: {e}")
    out.started, out.seconds = t0, time.monotonic() - t0
    return out


async def _stream(client: httpx.AsyncClient, body: dict, session: str) -> Outcome:
    async with client.stream("POST", "/v1/chat/completions", json=body,
                             headers={"X-Session-ID": session}) as r:
        if r.status_code != 200:
            text = (await r.aread()).decode(errors="replace")
            retry = r.headers.get("retry-after")
            shed = r.status_code in (429, 503) and retry is not None
            kind = "shed" if shed else "error" if r.status_code >= 500 else "client"
            return Outcome(kind, r.status_code, error=text[:300],
                           retry_after=float(retry) if retry else None)
        parts, error, done, after_end = [], "", False, False
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if done or (error and data != "[DONE]"):
                after_end = True
            if data == "[DONE]":
                done = True
                continue
            event = json.loads(data)
            if "error" in event:
                error = event["error"].get("message") or "error event"
                continue
            for choice in event.get("choices", ()):
                parts.append(choice.get("delta", {}).get("content") or "")
        if after_end:
            return Outcome("cut", error="data after the end of the stream")
        if error:
            return Outcome("error" if done else "cut", error=error)
        return Outcome("ok" if done else "cut", text="".join(parts))


# ---- sessions -------------------------------------------------------------------------------
@dataclass
class Tally:
    """Every answer of a run, by kind; `samples` keeps a few error texts per kind."""

    kinds: Counter = field(default_factory=Counter)
    statuses: Counter = field(default_factory=Counter)
    samples: dict[str, list[str]] = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list)
    outcomes: list[Outcome] = field(default_factory=list)

    def add(self, out: Outcome) -> None:
        self.outcomes.append(out)
        self.kinds[out.kind] += 1
        self.statuses[out.status] += 1
        if out.kind == "ok":
            self.latencies.append(out.seconds)
        elif len(self.samples.setdefault(out.kind, [])) < 5:
            self.samples[out.kind].append(f"{out.status} {out.error}")

    @property
    def requests(self) -> int:
        return sum(self.kinds.values())

    def summary(self) -> str:
        lat = sorted(self.latencies) or [0.0]
        p50, p99 = lat[len(lat) // 2], lat[min(len(lat) - 1, int(len(lat) * 0.99))]
        return (f"{self.requests} answers {dict(self.kinds)} statuses {dict(self.statuses)} "
                f"latency p50 {p50:.2f}s p99 {p99:.2f}s samples {self.samples}")


async def request_until_answered(client: httpx.AsyncClient, tally: Tally, model: str,
                                 messages: list[dict], session: str, max_tokens: int,
                                 retry_for_s: float = 30.0, timeout_s: float = 60.0) -> Outcome:
    """Send; a shed answer (429/503 + Retry-After) is counted, then retried after its delay
    (for up to `retry_for_s`)."""
    give_up = time.monotonic() + retry_for_s
    while True:
        out = await stream_chat(client, model, messages, session, max_tokens, timeout_s)
        tally.add(out)
        if out.kind != "shed" or time.monotonic() > give_up:
            return out
        await asyncio.sleep(min(out.retry_after or 1.0, 1.0) * random.uniform(0.5, 1.0))


async def agent_session(client: httpx.AsyncClient, tally: Tally, model: str, index: int,
                        turns: int, max_tokens: int, think_s: float = 0.3,
                        retry_for_s: float = 30.0) -> None:
    """A few growing turns: each turn sends the whole history plus a tool result, like an
    agent does; a random pause between turns stands for tool latency."""
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Session {index}: find a flight to JFK."}]
    for turn in range(turns):
        out = await request_until_answered(client, tally, model, messages, f"s{index}",
                                           max_tokens, retry_for_s)
        reply = out.text if out.kind == "ok" else ""
        messages += [{"role": "assistant", "content": reply},
                     {"role": "user", "content": f"Tool result {turn}: UA {100 + turn} departs "
                                                 f"at 10:{turn}5 from SFO; two bags."}]
        await asyncio.sleep(random.uniform(0, think_s))


def http_client(base_url: str, connections: int = 256) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=base_url, timeout=httpx.Timeout(120.0, connect=10.0),
        limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections))


# ---- workers over gRPC ----------------------------------------------------------------------
_STUBS = {"prefill": prefill_pb2_grpc.PrefillServiceStub,
          "decode": decode_pb2_grpc.DecodeServiceStub}


async def get_stats(role: str, address: str, timeout: float = 5.0) -> common_pb2.WorkerStats:
    async with grpc.aio.insecure_channel(address) as channel:
        return await _STUBS[role](channel).GetStats(common_pb2.GetStatsRequest(),
                                                    timeout=timeout)


async def wait_pools_whole(workers: dict[str, tuple[str, str]],
                           settle_s: float = 15.0) -> dict[str, common_pb2.WorkerStats]:
    """Poll GetStats of {name: (role, address)} until every pool is whole (all blocks free,
    nothing running or waiting); AssertionError with the last stats after `settle_s`."""
    deadline = time.monotonic() + settle_s
    while True:
        stats = {name: await get_stats(role, address)
                 for name, (role, address) in workers.items()}
        if all(s.num_free_blocks == s.num_total_blocks and not s.num_running
               and not s.num_waiting for s in stats.values()):
            return stats
        if time.monotonic() > deadline:
            raise AssertionError("pools not whole: " + "; ".join(
                f"{n}: free {s.num_free_blocks}/{s.num_total_blocks} running {s.num_running} "
                f"waiting {s.num_waiting}" for n, s in stats.items()))
        await asyncio.sleep(0.1)


# ---- resident memory ------------------------------------------------------------------------
class RssSampler:
    """Samples the RSS of named processes every `interval_s` while running (a thread, so a
    busy event loop does not skew the samples)."""

    def __init__(self, pids: dict[str, int], interval_s: float = 0.25) -> None:
        import psutil

        self.procs = {name: psutil.Process(pid) for name, pid in pids.items()}
        self.interval_s = interval_s
        self.samples: list[tuple[float, dict[str, int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                rss = {n: p.memory_info().rss for n, p in self.procs.items()}
            except Exception:  # noqa: BLE001 - a process ended: keep the samples we have
                return
            self.samples.append((time.monotonic(), rss))
            self._stop.wait(self.interval_s)

    def thirds(self, start: float, end: float) -> dict[str, tuple[float, float]]:
        """{name: (median RSS of the first third, of the last third)} of [start, end], MB."""
        third = (end - start) / 3
        first = [s for t, s in self.samples if start <= t <= start + third]
        last = [s for t, s in self.samples if end - third <= t <= end]
        assert len(first) >= 3 and len(last) >= 3, f"too few RSS samples: {len(self.samples)}"
        return {n: (statistics.median(s[n] for s in first) / MB,
                    statistics.median(s[n] for s in last) / MB) for n in self.procs}


# ---- worker processes -----------------------------------------------------------------------
class Proc:
    """A role process (`python -m MODULE ARGS`): stdout lines kept, READY awaited."""

    def __init__(self, name: str, module: str, args: list[str], log_dir: Path) -> None:
        self.name, self.module, self.args = name, module, args
        self.log_path = log_dir / f"{name}.log"
        self.p: subprocess.Popen | None = None
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.metrics_port: int | None = None

    def start(self) -> Proc:
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
               "UCX_NET_DEVICES": "lo", "TOKENIZERS_PARALLELISM": "false",
               "PYTHONUNBUFFERED": "1"}
        self.lines, self.ready = [], threading.Event()
        log = open(self.log_path, "ab")
        self.p = subprocess.Popen([sys.executable, "-m", self.module, *self.args], cwd=REPO,
                                  env=env, stdout=subprocess.PIPE, stderr=log, text=True)
        log.close()
        threading.Thread(target=self._read, args=(self.p,), daemon=True).start()
        return self

    def _read(self, p: subprocess.Popen) -> None:
        for line in p.stdout:
            self.lines.append(line.rstrip())
            ready = parse_ready(line)  # the gateway prints one too, after "[gateway] serving"
            if ready is not None:
                self.metrics_port = ready.metrics_port
                self.ready.set()

    async def wait_ready(self, timeout: float = 180.0) -> Proc:
        deadline = time.monotonic() + timeout
        while not self.ready.is_set():
            if self.p.poll() is not None:
                raise AssertionError(f"{self.name} exited {self.p.returncode}:\n{self.tail()}")
            assert time.monotonic() < deadline, f"{self.name} not ready:\n{self.tail()}"
            await asyncio.sleep(0.1)
        return self

    def metrics(self, prefix: str) -> dict[str, float]:
        """Prometheus samples whose name starts with `prefix` ({line label part: value})."""
        import urllib.request

        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        body = urllib.request.urlopen(url, timeout=5).read().decode()
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                for line in body.splitlines() if line.startswith(prefix)}

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL: no drain, no goodbye."""
        if self.p is not None and self.p.poll() is None:
            self.p.send_signal(signal.SIGKILL)
            self.p.wait(10)

    def stop(self, timeout: float = 20.0) -> int | None:
        if self.p is None or self.p.poll() is not None:
            return None if self.p is None else self.p.returncode
        self.p.send_signal(signal.SIGTERM)
        try:
            return self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait(10)
            return None


def ready_port(log_path: Path) -> int:
    """The port a `baton up` child announced (its READY line is copied into its log)."""
    lines = log_path.read_text(errors="replace").splitlines()
    ready = next((r for r in map(parse_ready, lines) if r is not None), None)
    assert ready, f"no READY line in {log_path}"
    return ready.port
