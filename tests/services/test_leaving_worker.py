"""Case 15 with real decode workers behind the real gateway (in-process): a decode worker
that is leaving (SIGTERM's drain: health NOT_SERVING, new requests refused UNAVAILABLE) while
the gateway still routes to it. Each request is answered by the other worker (retried before
the first token) within seconds, and the request in flight on the leaving worker is given
its drain time, then aborted (503 with Retry-After); nothing leaks on either worker."""
from __future__ import annotations

import asyncio
import time

import httpx

from gateway.config import GatewayConfig, RouterConfig, RoutingPolicy
from gateway.prompts import PromptBuilder
from gateway.server import Gateway
from tests.services.helpers import pools_whole, start_decode


async def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def test_leaving_decode_worker_requests_go_to_the_other(model):
    leaving = await start_decode(model, "grpc", None)
    staying = await start_decode(model, "grpc", None)
    real_step = leaving.engine.step

    def step_at_most_100_per_s():
        # A floor under the long request's time, not a ceiling: its 700 tokens take ≥ 7 s
        # on any machine, so the 1.5 s drain always ends first (on a fast machine the whole
        # request used to finish inside the drain: 200, not the 503 this test is about).
        time.sleep(0.01)
        return real_step()

    leaving.engine.step = step_at_most_100_per_s
    config = GatewayConfig(
        model=str(model), decode=(leaving.address, staying.address), port=0,
        poll_interval_s=3600,  # the gateway keeps believing the leaving worker is healthy
        router=RouterConfig(policy=RoutingPolicy.ROUND_ROBIN))
    gateway = Gateway(config, PromptBuilder.from_folder(model))
    await gateway.start()
    body = {"model": str(model), "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "Which flight leaves first?"}]}
    try:
        async with httpx.AsyncClient(base_url=gateway.http_url, timeout=30) as c:
            long = asyncio.create_task(c.post("/v1/chat/completions", json={
                **body, "max_tokens": 700, "ignore_eos": True}))
            await wait_for(lambda: leaving.worker.jobs or long.done())  # round-robin: there
            assert leaving.worker.jobs, long.result().text
            stop = asyncio.create_task(leaving.stop(drain_s=1.5))
            await wait_for(lambda: not leaving.worker.accepting)
            for _ in range(4):
                t0 = time.monotonic()
                r = await c.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                assert time.monotonic() - t0 < 5
            await stop
            r = await long  # drained, then aborted: 503 + Retry-After, not silence
            assert r.status_code == 503 and r.headers["retry-after"], r.text
            assert r.json()["error"]["code"] == "aborted"
        retries = gateway.metrics.retries.collect()[0].samples
        assert sum(s.value for s in retries if s.name.endswith("_total")) >= 1
        await pools_whole(leaving, staying)
    finally:
        await gateway.stop()
        await staying.stop(drain_s=0)
