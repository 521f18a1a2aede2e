"""Per-chunk KV sends (prefill_service/kv_stream.py): each prefill step's full blocks are
pushed while the next chunk computes, outputs stay token-exact, and an abort or a failed
push mid-way leaves both pools whole (the decode worker recomputes)."""
from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest

from tests.reference import hf_greedy
from tests.services.helpers import FORCE_REMOTE, BLOCK, engine_config, pools_whole, request

CHUNK = 2 * BLOCK  # the prefill worker's per-request chunk cap: 2 blocks a step


def prompt_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 380) for _ in range(n)]


def sample(server, name: str, **labels) -> float:
    return server.metrics.registry.get_sample_value(name, labels or None) or 0.0


async def pair(cluster, model, transport: str, **prefill_kw):
    prefill = await cluster.prefill(model, transport, **prefill_kw,
                                    engine=engine_config(model, long_prefill_token_threshold=CHUNK))
    decode = await cluster.decode(model, transport, prefill.address, **FORCE_REMOTE)
    return prefill, decode, cluster.client(decode)


def record_pushes(monkeypatch, prefill, fail_at: int | None = None) -> list[tuple[int, bool]]:
    """(blocks, prompt still being prefilled) per push; push number `fail_at` raises."""
    log: list[tuple[int, bool]] = []
    real = prefill.sender.push

    def push(tid, src):
        live = bool(prefill.engine.requests)  # engine thread: the prompt is not done yet
        if len(log) == fail_at:
            raise RuntimeError("injected push failure")
        log.append((len(src), live))
        return real(tid, src)

    monkeypatch.setattr(prefill.sender, "push", push)
    return log


async def wait_for(pred, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


@pytest.mark.parametrize("transport", ["grpc", "inproc", "nixl"])
async def test_chunks_are_sent_as_prefill_progresses(cluster, model, monkeypatch, transport):
    """60 tokens in 4 chunks of ≤ 16: 3 pushes of 2 blocks during the prefill, then the
    remainder (block 6 and the partial block 7) after it; output equals transformers."""
    prefill, decode, client = await pair(cluster, model, transport)
    pushes = record_pushes(monkeypatch, prefill)
    prompt = prompt_of(60, 1)
    res = await client.generate(prompt)
    assert res.output == hf_greedy(model, prompt, 8)
    assert res.fin.timings.remote_prefill
    assert pushes == [(2, True), (2, True), (2, True), (2, False)]
    assert sample(prefill, "baton_kv_transferred_blocks_total") == 8
    await pools_whole(prefill, decode)


async def test_second_turn_streams_only_blocks_decode_lacks(cluster, model, monkeypatch):
    """Turn 2 hits 7 blocks on decode and 7 on prefill: blocks 7.. stream, in order."""
    prefill, decode, client = await pair(cluster, model, "grpc")
    turn1 = prompt_of(60, 2)
    out1 = (await client.generate(turn1)).output
    pushes = record_pushes(monkeypatch, prefill)
    turn2 = turn1 + out1 + prompt_of(40, 3)  # 108 tokens, 14 blocks; decode holds 8 full
    res = await client.generate(turn2)
    assert res.output == hf_greedy(model, turn2, 8)
    assert sum(n for n, _ in pushes) == 14 - 8
    assert [live for _, live in pushes][-1] is False and len(pushes) > 1
    await pools_whole(prefill, decode)


@pytest.mark.parametrize("transport", ["grpc", "inproc", "nixl"])
async def test_off_sends_once_at_the_end(cluster, model, monkeypatch, transport):
    prefill, decode, client = await pair(cluster, model, transport, kv_send_per_chunk=False)
    assert prefill.streams is None
    pushes = record_pushes(monkeypatch, prefill)
    prompt = prompt_of(60, 4)
    res = await client.generate(prompt)
    assert res.output == hf_greedy(model, prompt, 8) and res.fin.timings.remote_prefill
    assert pushes == [] and sample(prefill, "baton_kv_transferred_blocks_total") == 8
    await pools_whole(prefill, decode)


@pytest.mark.parametrize("transport", ["grpc", "inproc", "nixl"])
async def test_abort_with_chunks_in_flight_leaves_pools_whole(cluster, model, monkeypatch,
                                                               transport):
    """The client goes away after the first push, while the prefill engine is held before
    its next step (inproc: pushed blocks are never copied, so they stay in flight): the
    stream is cancelled, the pinned blocks come back, both pools end whole."""
    prefill, decode, client = await pair(cluster, model, transport)
    if transport == "inproc":
        prefill.sender.auto_complete = False
    pushes = record_pushes(monkeypatch, prefill)
    gate, real_step = threading.Event(), prefill.engine.step

    def step():
        if pushes:
            assert gate.wait(30)
        return real_step()

    monkeypatch.setattr(prefill.engine, "step", step)
    call = client.decode.Generate(request(prompt_of(60, 6)), timeout=30)
    task = asyncio.ensure_future(call.read())
    try:
        await wait_for(lambda: pushes)
        seq = next(iter(prefill.worker.entries.values()))
        assert pushes == [(2, True)] and seq.stream is not None and seq.stream.pinned
        call.cancel()
        await wait_for(lambda: seq.aborted.is_set())
    finally:
        gate.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_for(lambda: seq.task.done())
    assert seq.stream is None
    await pools_whole(prefill, decode)
    assert not prefill.worker.entries and not decode.worker.jobs


@pytest.mark.parametrize("how", ["push raises", "transfer fails"])
@pytest.mark.parametrize("transport", ["grpc", "inproc", "nixl"])
async def test_failure_mid_stream_recomputes_exactly(cluster, model, monkeypatch, transport,
                                                     how):
    """The second push raises (or the transfer fails after the first): the prefill replies
    TRANSFER_FAILED, the decode worker recomputes the prompt, pools end whole."""
    prefill, decode, client = await pair(cluster, model, transport)
    if how == "push raises":
        record_pushes(monkeypatch, prefill, fail_at=1)
    else:
        real = prefill.sender.push
        calls = []

        def push(tid, src):
            real(tid, src)
            calls.append(tid)
            if len(calls) == 1:
                fail_transfer(prefill.sender, transport, tid)

        monkeypatch.setattr(prefill.sender, "push", push)
    prompt = prompt_of(60, 7)
    res = await client.generate(prompt)
    assert res.output == hf_greedy(model, prompt, 8)
    assert not res.fin.timings.remote_prefill
    assert sample(decode, "baton_decode_remote_prefills_total", outcome="recompute") == 1
    assert sample(prefill, "baton_prefill_requests_total", status="PREFILL_STATUS_TRANSFER_FAILED") == 1
    await pools_whole(prefill, decode)


def fail_transfer(sender, transport: str, tid: str) -> None:
    """End a live streamed transfer as a broken transport would (gRPC: the stream breaks)."""
    if transport == "inproc":
        sender.fail(tid)
    else:
        sender.cancel(tid)
