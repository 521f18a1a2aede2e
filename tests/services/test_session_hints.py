"""Session hints over gRPC: they reach decode's pool and (remote prefill) prefill's, outputs equal
the no-hint run, EndSession ends retention on both, bad hints are INVALID_ARGUMENT."""
from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from protos import common_pb2
from tests.services.helpers import pools_whole

pytestmark = pytest.mark.asyncio(loop_scope="module")


def prompt_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 380) for _ in range(n)]


async def _until(pred, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not pred():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.02)


async def test_hints_reach_both_pools_and_end_session_ends_them(whole):
    prefill, decode, client = whole
    prompt = prompt_of(37, seed=5)  # above decode's --min-remote-tokens 16: remote prefill
    plain = await client.generate(prompt)
    res = await client.generate(prompt_of(37, seed=6), session_id="agent-1",
                                session_ttl_seconds=30)
    again = await client.generate(prompt, session_id="agent-1", session_ttl_seconds=30)
    assert again.output == plain.output and res.fin.usage.prompt_tokens == 37
    await pools_whole(prefill, decode)
    for server in (decode, prefill):
        free = server.engine.kv.pool.free
        await _until(lambda: free.num_session_free > 0)  # prefill: once its lease ended
        assert free.is_pinned("agent-1")
        sample = server.metrics.registry.get_sample_value
        assert sample("baton_kv_session_free_blocks") == free.num_session_free
        assert sample("baton_kv_prefetched_blocks_total") == 0  # no tier configured
    ended = await client.decode.EndSession(common_pb2.EndSessionRequest(session_id="agent-1"))
    pended = await client.prefill.EndSession(common_pb2.EndSessionRequest(session_id="agent-1"))
    assert ended.num_blocks > 0 and pended.num_blocks > 0
    for server in (decode, prefill):
        free = server.engine.kv.pool.free
        assert "agent-1" in free.ended and free.num_session_free == 0
    none = await client.decode.EndSession(common_pb2.EndSessionRequest(session_id="nobody"))
    assert none.num_blocks == 0


@pytest.mark.parametrize("kw", [
    {"session_id": "s", "session_ttl_seconds": -1},
    {"session_id": "s", "session_ttl_seconds": 1e9},
    {"session_id": "s", "session_ttl_seconds": float("nan")},
    {"session_ttl_seconds": 5},  # hints without a session
    {"session_end": True},
])
async def test_bad_hints_are_invalid_argument_and_the_worker_keeps_serving(whole, kw):
    prefill, decode, client = whole
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.generate(prompt_of(20, seed=1), **kw)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "session" in err.value.details()
    ok = await client.generate(prompt_of(20, seed=1))
    assert len(ok.output) == 8


async def test_end_session_needs_an_id(whole):
    _, _, client = whole
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.decode.EndSession(common_pb2.EndSessionRequest())
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
