"""Abort and client cancellation in every state free both pools: waiting for remote KV
(prefill computing), mid-transfer, mid-decode; also a burst of early disconnects."""
from __future__ import annotations

import asyncio
import random
import time

import grpc
import pytest

from baton.sampling_params import SamplingParams
from baton.transfer import KVSender
from prefill_service.sequence import PrefillState
from protos import common_pb2, decode_pb2
from tests.services.helpers import pools_whole, request

pytestmark = pytest.mark.asyncio(loop_scope="module")
LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)


def prompt_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 380) for _ in range(n)]


async def wait_for(pred, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


def slow_prefill_steps(monkeypatch, prefill, seconds: float) -> None:
    real = prefill.engine.runner.execute

    def slow(batch):
        time.sleep(seconds)
        return real(batch)

    monkeypatch.setattr(prefill.engine.runner, "execute", slow)


def slow_transfer(monkeypatch, prefill, seconds: float, log: list) -> None:
    """The prefill side sees its transfer in flight for `seconds` (state SENDING_KV)."""
    real = KVSender.wait_async

    async def slow(self, tid, timeout_s):
        await asyncio.sleep(seconds)
        state = await real(self, tid, timeout_s)
        log.append(("transfer ended", time.monotonic()))
        return state

    monkeypatch.setattr(type(prefill.sender), "wait_async", slow)


def assert_whole_now(*servers) -> None:
    for s in servers:
        assert s.engine.kv.num_free_blocks == s.engine.kv.num_blocks
        assert s.engine.num_unfinished_requests == 0


def prefill_state(prefill, rid):
    e = prefill.worker.entries.get(rid)
    return e.state if e is not None else None


async def test_abort_while_waiting_for_remote_kv(whole, monkeypatch):
    prefill, decode, client = whole
    slow_prefill_steps(monkeypatch, prefill, 0.3)
    call = client.decode.Generate(request(prompt_of(40, 1), rid="wait-kv"), timeout=30)
    await wait_for(lambda: prefill_state(prefill, "wait-kv") == PrefillState.PREFILLING)
    assert (await client.decode.Abort(common_pb2.AbortRequest(request_id="wait-kv"))).found
    assert_whole_now(prefill, decode)
    msgs = [m async for m in call]
    assert len(msgs) == 1 and msgs[0].finished.finish_reason == common_pb2.FINISH_REASON_ABORT


async def test_abort_mid_transfer_waits_it_out(whole, monkeypatch):
    prefill, decode, client = whole
    events: list = []
    slow_transfer(monkeypatch, prefill, 0.5, events)
    call = client.decode.Generate(request(prompt_of(40, 2), rid="mid-xfer"), timeout=30)
    await wait_for(lambda: prefill_state(prefill, "mid-xfer") == PrefillState.SENDING_KV)
    assert (await client.decode.Abort(common_pb2.AbortRequest(request_id="mid-xfer"))).found
    answered = time.monotonic()
    assert_whole_now(prefill, decode)
    assert events and events[0][1] <= answered  # decode's Abort returned after the transfer
    msgs = [m async for m in call]
    assert msgs[-1].finished.finish_reason == common_pb2.FINISH_REASON_ABORT
    assert not any(m.HasField("tokens") for m in msgs)


async def test_abort_mid_decode(whole):
    prefill, decode, client = whole
    call = client.decode.Generate(request(prompt_of(40, 3), LONG, rid="mid-decode"), timeout=30)
    got = []
    async for msg in call:
        got.append(msg)
        if len(got) == 2:
            found = await client.decode.Abort(common_pb2.AbortRequest(request_id="mid-decode"))
            assert found.found
            assert_whole_now(decode)
    assert got[-1].finished.finish_reason == common_pb2.FINISH_REASON_ABORT
    assert got[-1].finished.usage.completion_tokens < 200
    assert not (await client.decode.Abort(common_pb2.AbortRequest(request_id="mid-decode"))).found


async def test_client_cancel_while_waiting_for_kv_aborts_prefill(whole, monkeypatch):
    prefill, decode, client = whole
    slow_prefill_steps(monkeypatch, prefill, 0.3)
    call = client.decode.Generate(request(prompt_of(48, 4), rid="cancel-kv"), timeout=30)
    await wait_for(lambda: prefill_state(prefill, "cancel-kv") == PrefillState.PREFILLING)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call.read()
    await wait_for(lambda: not prefill.worker.entries and not decode.worker.jobs)


async def test_burst_of_disconnects_after_first_chunk(whole):
    """Issue 7 case 12 at the worker: clients leaving after their first chunk, all at once."""
    prefill, decode, client = whole

    async def one(i: int) -> None:
        call = client.decode.Generate(request(prompt_of(20 + i, 100 + i), LONG), timeout=30)
        async for msg in call:
            assert msg.HasField("tokens")
            call.cancel()
            break

    await asyncio.gather(*(one(i) for i in range(20)))
    await pools_whole(prefill, decode)
    stats = await client.stats()
    assert stats.num_running == stats.num_waiting == 0


async def test_unknown_abort_and_generate_after_aborts(whole, model):
    from tests.reference import hf_greedy

    _, _, client = whole
    assert not (await client.decode.Abort(common_pb2.AbortRequest(request_id="nope"))).found
    prompt = prompt_of(33, 5)
    assert (await client.generate(prompt)).output == hf_greedy(model, prompt, 8)


async def test_generate_call_deadline_frees(whole, monkeypatch):
    prefill, decode, client = whole
    slow_prefill_steps(monkeypatch, prefill, 0.4)
    call = client.decode.Generate(request(prompt_of(40, 6)), timeout=0.2)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        [m async for m in call]
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


async def test_cancel_while_admitting_a_later_choice_stops_the_earlier_ones(whole, monkeypatch):
    """n > 1: a client leaving while choice 1 is being admitted (choice 0 already in the
    engine) stops choice 0 too; it used to generate on to max_tokens, out of reach of Abort."""
    from decode_service.sequence import DecodeSequence

    prefill, decode, client = whole
    real, blocked = DecodeSequence.admit, asyncio.Event()

    async def admit(self, peer, min_remote_tokens):
        if self.index == 1:
            blocked.set()
            await asyncio.sleep(60)  # the call is cancelled here
        return await real(self, peer, min_remote_tokens)

    monkeypatch.setattr(DecodeSequence, "admit", admit)
    many = SamplingParams(temperature=0.8, n=2, max_tokens=700, ignore_eos=True)
    local = decode_pb2.PREFILL_MODE_LOCAL
    call = client.decode.Generate(request(prompt_of(40, 7), many, rid="n2-cancel",
                                          prefill_mode=local), timeout=30)
    await wait_for(blocked.is_set)
    first = decode.worker.jobs["n2-cancel"].sequences[0]
    assert first.engine_request is not None  # in the engine, generating
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call.read()
    await wait_for(lambda: decode.engine.num_unfinished_requests == 0)
    assert len(first.engine_request.output_token_ids) < 700  # stopped, not run to the end
    await pools_whole(prefill, decode)
