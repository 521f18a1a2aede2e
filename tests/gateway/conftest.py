"""Gateway test fixtures: the tiny model's tokenizer, fake decode workers, a live gateway.

Everything binds 127.0.0.1 port 0 and runs on the test's event loop.
"""
from __future__ import annotations

import contextlib

import pytest

from gateway.config import GatewayConfig, RouterConfig, RoutingPolicy
from gateway.prompts import PromptBuilder
from gateway.server import Gateway
from tests.gateway.fake_decode import Behavior, FakeWorker

MODEL = "tiny"


@pytest.fixture(scope="session")
def prompts(tiny_llama) -> PromptBuilder:
    return PromptBuilder.from_folder(tiny_llama)


def gateway_config(decode: list[str], prefill: list[str] = (), **overrides) -> GatewayConfig:
    router = overrides.pop("router", None) or RouterConfig(
        policy=overrides.pop("policy", RoutingPolicy.SESSION), stale_after_s=1.0)
    base = dict(model=MODEL, decode=tuple(decode), prefill=tuple(prefill), port=0, grpc_port=0,
                poll_interval_s=0.05, rpc_timeout_s=0.5, first_token_timeout_s=5.0,
                stream_idle_timeout_s=5.0, shutdown_grace_s=0.5, router=router)
    base.update(overrides)
    return GatewayConfig(**base)


@contextlib.asynccontextmanager
async def running_gateway(prompts: PromptBuilder, workers: list[FakeWorker],
                          prefill_workers: list[FakeWorker] = (), **overrides):
    config = gateway_config([w.address for w in workers],
                            [w.address for w in prefill_workers], **overrides)
    gw = Gateway(config, prompts)
    await gw.start()
    try:
        yield gw
    finally:
        await gw.stop()


@pytest.fixture
async def fake():
    worker = await FakeWorker.start()
    yield worker
    await worker.stop(0)


@pytest.fixture
async def gateway(prompts, fake):
    async with running_gateway(prompts, [fake]) as gw:
        yield gw


__all__ = ["Behavior", "FakeWorker", "MODEL", "gateway_config", "running_gateway"]
