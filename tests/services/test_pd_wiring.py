"""The cost-based P/D decider wired into a real decode worker (no --min-remote-tokens):
a short prompt prefills here, a long cold one on the prefill worker, its continuation here
again (decode's own hit); a saturated prefill queue keeps a long prompt here; every decision
is counted in baton_decode_pd_decisions_total{path, reason}."""
from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import time

import pytest

from baton.worker.cpu_share import create_share_file
from decode_service.pd_rates import Ewma
from decode_service.peers import PeerLoad
from decode_service.server import DecodeServer
from tests.services.helpers import decode_config

pytestmark = pytest.mark.asyncio


def prompt_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 380) for _ in range(n)]


class PinnedRate:
    """An engine's per-step prefill rate (baton/engine/prefill_rate.py), held fixed."""

    tokens_per_s = 1000.0

    def observe(self, tokens: int, seconds: float) -> None:
        pass


def decisions(decode, path: str, reason: str) -> float:
    return decode.metrics.registry.get_sample_value(
        "baton_decode_pd_decisions_total", {"path": path, "reason": reason}) or 0


async def start(cluster, model):
    prefill = await cluster.prefill(model, "grpc")
    decode = await cluster.decode(model, "grpc", prefill.address, min_remote_tokens=None,
                                  local_prefill_itl_budget_ms=50.0)
    # pin the rates: 1000 prompt tokens/s each side, per step and learned
    decode.engine.prefill_rate = prefill.engine.prefill_rate = PinnedRate()
    est = decode.worker.ctx.pd.estimator
    est.local = Ewma(1000.0, alpha=0.0)
    est.peer(prefill.address).remote = Ewma(1000.0, alpha=0.0)
    return prefill, decode, cluster.client(decode)


async def test_short_local_long_remote_continuation_local(cluster, model):
    prefill, decode, client = await start(cluster, model)
    short = await client.generate(prompt_of(10, seed=1))
    assert not short.fin.timings.remote_prefill
    assert decisions(decode, "local", "faster_local") == 1

    turn1 = prompt_of(300, seed=2)  # 300 ms stall > 250 ms idle budget: the prefill worker's
    first = await client.generate(turn1)
    assert first.fin.timings.remote_prefill
    assert decisions(decode, "remote", "long_prompt") == 1

    turn2 = turn1 + first.output + prompt_of(8, seed=3)  # decode holds turn 1's blocks
    cont = await client.generate(turn2)
    assert not cont.fin.timings.remote_prefill
    assert decisions(decode, "local", "faster_local") == 2
    assert cont.fin.usage.cached_tokens >= 288


async def test_saturated_prefill_keeps_long_prompt_local_and_queue_is_polled(cluster, model):
    prefill, decode, client = await start(cluster, model)
    await client.generate(prompt_of(10, seed=4))  # the first decision asks for GetStats
    for _ in range(100):
        if decode.peers.load(prefill.address) is not None:
            break
        await asyncio.sleep(0.02)
    assert decode.peers.load(prefill.address).num_waiting_tokens == 0
    decode.peers._loads[prefill.address] = PeerLoad(time.monotonic(), 0, 50, 20_000,
                                                    4, 3.0)  # 20 s of queue, fresh
    res = await client.generate(prompt_of(300, seed=5))
    assert not res.fin.timings.remote_prefill
    assert decisions(decode, "local", "prefill_saturated") == 1


async def test_idle_decode_prefills_a_short_continuation_here(cluster, model):
    """A 120-token suffix (120 ms, past the 50 ms ITL budget) while nothing decodes: local
    (idle budget 250 ms); with the idle budget off, the prefill worker's."""
    prefill, decode, client = await start(cluster, model)
    res = await client.generate(prompt_of(120, seed=7))
    assert not res.fin.timings.remote_prefill
    assert decisions(decode, "local", "idle_faster_local") == 1
    decode.worker.ctx.pd.policy = dataclasses.replace(decode.worker.ctx.pd.policy,
                                                      idle_budget_s=0.0)
    res = await client.generate(prompt_of(120, seed=8))
    assert res.fin.timings.remote_prefill
    assert decisions(decode, "remote", "long_prompt") == 1


async def test_min_remote_tokens_flag_overrides_the_decider(cluster, model):
    prefill = await cluster.prefill(model, "grpc")
    decode = await cluster.decode(model, "grpc", prefill.address, min_remote_tokens=8)
    client = cluster.client(decode)
    res = await client.generate(prompt_of(10, seed=6))  # the decider would keep it here
    assert res.fin.timings.remote_prefill
    assert decisions(decode, "remote", "threshold") == 1


async def test_a_decode_worker_sharing_cores_prices_and_publishes_it(cluster, model, tmp_path):
    """Under `--pin share` (a share file with the prefill worker's slot beside its own) the
    decode worker's policy prices what a remote prefill takes of its cores, and GetStats
    publishes it for the gateway's prediction; alone on its cores, 0."""
    prefill = await cluster.prefill(model, "grpc")
    share = create_share_file(tmp_path / "cpu-share", 2)
    cfg = decode_config(model, "grpc", prefill.address)
    server = dataclasses.replace(cfg.server, cpu_share=f"{share}:1")
    shared = await DecodeServer(dataclasses.replace(cfg, server=server)).start()
    cluster.servers.append(shared)
    alone = await cluster.decode(model, "grpc", prefill.address)
    n = len(os.sched_getaffinity(0))
    expected = 1 - max(1, n // 2) / n
    assert shared.worker.ctx.pd.policy.remote_stall_fraction == pytest.approx(expected)
    stats = await cluster.client(shared).stats()
    assert stats.pd_policy.remote_stall_fraction == pytest.approx(expected)
    assert (await cluster.client(alone).stats()).pd_policy.remote_stall_fraction == 0.0
