"""Hostile requests and a stall meter for the gateway's event loop (issue 27, item 2).

    deep_one_of_body()   a chat request whose response_format schema is `oneOf` nested 16 deep
                         (65,536 leaves, about 3 MB): a meta-schema check of it alone takes a
                         minute of pure Python
    many_tools_body()    a chat request offering 1,500 tools (about 0.5 MB; its rendered
                         prompt is about 150k tokens)
    measure(...)         while one stream runs (a decode worker that emits one token every
                         `pace` seconds) and /health is polled, send the hostile requests one
                         after the other; report the stream's chunk gaps, /health latencies and
                         each hostile request's answer

Bodies are encoded once, before measuring, so the client's own JSON encoding never stalls the
loop it shares with an in-process gateway. Used by tests/gateway/test_event_loop.py and
benchmarks/gateway_stalls.py.
"""
from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field

import httpx

CHAT_PATH = "/v1/chat/completions"


def deep_one_of(depth: int) -> dict:
    """`oneOf` of two branches, nested `depth` deep: 2**depth leaves."""
    schema: dict = {"type": "string", "maxLength": 8}
    for _ in range(depth):
        schema = {"oneOf": [schema, schema]}
    return schema


def deep_one_of_body(model: str, depth: int = 16) -> bytes:
    return json.dumps({"model": model, "max_tokens": 4,
                       "messages": [{"role": "user", "content": "Fill the form."}],
                       "response_format": {"type": "json_schema", "json_schema": {
                           "name": "form", "schema": deep_one_of(depth)}}}).encode()


def many_tools_body(model: str, num_tools: int = 1500) -> bytes:
    tools = [{"type": "function", "function": {
        "name": f"tool_{i}", "description": f"Does step {i} of the plan, carefully.",
        "parameters": {"type": "object", "required": ["target"], "properties": {
            "target": {"type": "string", "description": "what to act on"},
            "count": {"type": "integer", "minimum": 0}}}}} for i in range(num_tools)]
    return json.dumps({"model": model, "max_tokens": 4, "tools": tools,
                       "messages": [{"role": "user", "content": "Plan the trip."}]}).encode()


@dataclass
class Answer:
    """One hostile request's outcome."""

    name: str
    status: int
    param: str | None
    seconds: float


@dataclass
class Stalls:
    """Chunk gaps of the running stream and /health latencies (seconds), while measuring."""

    gaps: list[float] = field(default_factory=list)
    health: list[float] = field(default_factory=list)
    answers: list[Answer] = field(default_factory=list)
    stream_ended: str | None = None  # why the stream ended before the measurement did

    @property
    def median_gap(self) -> float:
        return statistics.median(self.gaps)

    @property
    def bound(self) -> float:
        """Issue 27's bound on any gap: twice the median gap plus 100 ms."""
        return 2 * self.median_gap + 0.1

    def summary(self) -> str:
        answers = ", ".join(f"{a.name}: {a.status} param={a.param} in {a.seconds:.2f} s"
                            for a in self.answers)
        return (f"stream gaps: median {self.median_gap * 1e3:.0f} ms, max "
                f"{max(self.gaps) * 1e3:.0f} ms (bound {self.bound * 1e3:.0f} ms), "
                f"{len(self.gaps)} gaps; /health: median "
                f"{statistics.median(self.health) * 1e3:.1f} ms, max "
                f"{max(self.health) * 1e3:.0f} ms, {len(self.health)} polls; {answers}"
                + (f"; the stream ended early: {self.stream_ended}" if self.stream_ended else ""))


async def _stream(client: httpx.AsyncClient, model: str, started: asyncio.Event,
                  arrivals: list[float]) -> None:
    body = {"model": model, "stream": True, "messages": [{"role": "user", "content": "go"}]}
    async with client.stream("POST", CHAT_PATH, json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                arrivals.append(time.monotonic())
                started.set()


async def _poll_health(client: httpx.AsyncClient, every: float, out: list[float]) -> None:
    while True:
        t0 = time.monotonic()
        await client.get("/health")
        out.append(time.monotonic() - t0)
        await asyncio.sleep(every)


async def _send(client: httpx.AsyncClient, name: str, body: bytes) -> Answer:
    t0 = time.monotonic()
    r = await client.post(CHAT_PATH, content=body,
                          headers={"Content-Type": "application/json"})
    param = r.json().get("error", {}).get("param") if r.status_code >= 400 else None
    return Answer(name, r.status_code, param, time.monotonic() - t0)


async def measure(url: str, model: str, hostile: list[tuple[str, bytes]],
                  settle_s: float = 0.5, timeout_s: float = 300.0) -> Stalls:
    """Run the stream, poll /health, send each hostile body in turn (see the module
    docstring); the stream must outlast the measurement (it is cut off at the end)."""
    out = Stalls()
    arrivals: list[float] = []
    started = asyncio.Event()
    limits = httpx.Limits(max_connections=8)
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as client:
        for _ in range(300):  # until the gateway sees its decode worker healthy (bounded)
            if (await client.get("/health")).status_code == 200:
                break
            await asyncio.sleep(0.05)
        stream = asyncio.create_task(_stream(client, model, started, arrivals))
        await asyncio.wait_for(started.wait(), 30)
        health = asyncio.create_task(_poll_health(client, 0.05, out.health))
        try:
            await asyncio.sleep(settle_s)
            for name, body in hostile:
                out.answers.append(await _send(client, name, body))
            await asyncio.sleep(settle_s)
            if stream.done():
                error = stream.exception()
                out.stream_ended = repr(error) if error else "after its last chunk"
        finally:
            for task in (stream, health):
                task.cancel()
            await asyncio.gather(stream, health, return_exceptions=True)
    out.gaps = [b - a for a, b in zip(arrivals[1:], arrivals[2:])]  # [0]: the first token
    return out
