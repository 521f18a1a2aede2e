"""Prefill-side failures seen from decode: rejection, silence, lost blocks, layout mismatch,
unreachable workers, slow collection; the lease; and bad input. Issue 7 cases 1–5."""
from __future__ import annotations

import asyncio
import dataclasses
import random

import grpc
import pytest

from baton.sampling_params import SamplingParams
from baton.grpc_options import CHANNEL_OPTIONS
from baton.transfer import TransferState, kv_layout_hash
from decode_service.remote_prefill import RemotePrefill
from protos import common_pb2, prefill_pb2, prefill_pb2_grpc, transfer_pb2
from tests.reference import hf_greedy
from tests.services.helpers import (
    FORCE_REMOTE,
    collect,
    engine_config,
    pools_whole,
    request,
)


def prompt_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 380) for _ in range(n)]


def sample(server, name: str, **labels) -> float:
    return server.metrics.registry.get_sample_value(name, labels or None) or 0.0


class SilentPrefill(prefill_pb2_grpc.PrefillServiceServicer):
    """A prefill worker that shakes hands, then never answers Prefill or Abort."""

    async def Handshake(self, request, context):
        return prefill_pb2.HandshakeResponse(
            compatible=True, kv_layout=request.kv_layout, layout_hash=request.layout_hash,
            worker_id="silent", transports=request.transports)

    async def Prefill(self, request, context):
        await asyncio.sleep(3600)

    async def Abort(self, request, context):
        await asyncio.sleep(3600)


@pytest.fixture
async def silent_prefill():
    server = grpc.aio.server(options=CHANNEL_OPTIONS)
    prefill_pb2_grpc.add_PrefillServiceServicer_to_server(SilentPrefill(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield f"127.0.0.1:{port}"
    await server.stop(0)


@pytest.mark.parametrize("transport", ["nixl", "grpc"])
@pytest.mark.parametrize("policy", ["recompute", "fail"])
async def test_silent_prefill_blocks_come_back(cluster, model, silent_prefill, transport, policy):
    """Case 3: no reply, no transfer, no progress (GetStats unanswered): the call is given up
    after the stall budget and the reservation returns (NIXL: quarantined until the prefill
    deadline, prefill_max_seconds, + grace, since a late write cannot be refused)."""
    decode = await cluster.decode(model, transport, silent_prefill, on_prefill_failure=policy,
                                  prefill_timeout_seconds=0.5, prefill_max_seconds=1.0,
                                  abort_timeout_seconds=0.2,
                                  quarantine_grace_seconds=0.3, **FORCE_REMOTE)
    client = cluster.client(decode)
    prompt = prompt_of(40, 1)
    res = await client.generate(prompt)
    if policy == "recompute":
        assert res.output == hf_greedy(model, prompt, 8)
        assert not res.fin.timings.remote_prefill
    else:
        assert res.fin.finish_reason == common_pb2.FINISH_REASON_ERROR
        assert "DEADLINE_EXCEEDED" in res.fin.error and not res.output
    # gRPC refuses late chunks once the transfer is forgotten; NIXL writes cannot be refused
    assert sample(decode, "baton_decode_quarantines_total") == (transport == "nixl")
    await pools_whole(decode, timeout=5)
    assert sample(decode, "baton_decode_quarantined_requests") == 0


def _slow_steps(server, seconds: float, gate=None):
    """Make a prefill server's engine take `seconds` per step (or block on `gate`)."""
    engine = server.engine
    real = engine.step

    def step():
        if gate is not None:
            gate.wait()
        else:
            import time
            time.sleep(seconds)
        return real()

    engine.step = step


@pytest.mark.parametrize("transport", ["nixl", "grpc"])
async def test_slow_prefill_that_keeps_stepping_is_not_cut_off(cluster, model, transport):
    """Issue 5 (c): a remote prefill that takes far longer than prefill_timeout_seconds
    (a long queue on a slow prefill worker) completes remotely while the prefill engine keeps
    stepping; under the old fixed deadline the call hit DEADLINE_EXCEEDED and was recomputed."""
    prefill = await cluster.prefill(model, transport, engine=engine_config(
        model, long_prefill_token_threshold=8, max_num_batched_tokens=8))
    _slow_steps(prefill, 0.2)  # 48 tokens in 8-token chunks: >= 6 steps, >= 1.2 s
    decode = await cluster.decode(model, transport, prefill.address,
                                  prefill_timeout_seconds=0.5, prefill_max_seconds=30,
                                  **FORCE_REMOTE)
    client = cluster.client(decode)
    prompt = prompt_of(48, 11)
    t0 = asyncio.get_running_loop().time()
    res = await client.generate(prompt)
    assert asyncio.get_running_loop().time() - t0 > 1.0  # longer than the stall budget
    assert res.output == hf_greedy(model, prompt, 8)
    assert res.fin.timings.remote_prefill, res.fin
    assert sample(decode, "baton_decode_remote_prefills_total", outcome="ok") == 1
    assert sample(decode, "baton_decode_remote_prefills_total", outcome="recompute") == 0
    await pools_whole(prefill, decode)


async def test_prefill_that_stops_stepping_is_given_up(cluster, model):
    """The other side of the progress watchdog: a prefill engine that runs no step for
    prefill_timeout_seconds is given up (Abort) and the prompt recomputed locally."""
    import threading
    gate = threading.Event()
    prefill = await cluster.prefill(model, "grpc")
    _slow_steps(prefill, 0.0, gate)
    decode = await cluster.decode(model, "grpc", prefill.address,
                                  prefill_timeout_seconds=0.6, prefill_max_seconds=30,
                                  **FORCE_REMOTE)
    client = cluster.client(decode)
    prompt = prompt_of(40, 12)
    t0 = asyncio.get_running_loop().time()
    try:
        res = await client.generate(prompt)
    finally:
        gate.set()
    elapsed = asyncio.get_running_loop().time() - t0
    assert res.output == hf_greedy(model, prompt, 8) and not res.fin.timings.remote_prefill
    assert elapsed < 10, elapsed  # the stall budget, not the 30 s cap
    assert sample(decode, "baton_decode_remote_prefills_total", outcome="recompute") == 1
    await pools_whole(prefill, decode)


async def test_prefill_rejects_after_decode_reserved(cluster, model):
    """Case 2: prompt over the prefill worker's limit: a clear error, reservation freed."""
    prefill = await cluster.prefill(model, "grpc", max_prompt_tokens=20)
    decode = await cluster.decode(model, "grpc", prefill.address, **FORCE_REMOTE)
    client = cluster.client(decode)
    call = client.decode.Generate(request(prompt_of(37, 2)), timeout=30)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        [m async for m in call]
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "--max-prompt-tokens" in e.value.details() and "prefill" in e.value.details()
    await pools_whole(prefill, decode, timeout=0.01)
    short = prompt_of(12, 3)  # still serving (local below the threshold)
    assert (await client.generate(short)).output == hf_greedy(model, short, 8)


@pytest.mark.parametrize("field, decode_kw", [
    ("block_size", {"block_size": 16}),
    ("dtype", {}),
    ("model", {}),
])
async def test_layout_mismatch_is_refused_at_handshake(cluster, model, field, decode_kw):
    """Case 4: a clear FAILED_PRECONDITION naming the differing field; nothing allocated."""
    prefill = await cluster.prefill(model, "nixl")
    extra = {"served_model_name": "other-model"} if field == "model" else {}
    engine = engine_config(model, **decode_kw)
    if field == "dtype":  # a bfloat16 KV cache against the prefill worker's float32 one
        engine = dataclasses.replace(engine, dtype="bfloat16")
    decode = await cluster.decode(model, "nixl", prefill.address, engine=engine, **extra,
                                  **FORCE_REMOTE)
    call = cluster.client(decode).decode.Generate(request(prompt_of(40, 4)), timeout=30)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        [m async for m in call]
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert field in e.value.details()
    await pools_whole(prefill, decode, timeout=0.01)


async def test_handshake_names_dtype_and_transport(cluster, model):
    prefill = await cluster.prefill(model, "nixl")
    stub = cluster.client(prefill, prefill).prefill
    layout = (await stub.GetStats(common_pb2.GetStatsRequest(), timeout=5)).kv_layout
    bad = common_pb2.KVLayout()
    bad.CopyFrom(layout)
    bad.dtype = common_pb2.KV_DTYPE_FLOAT16
    resp = await stub.Handshake(prefill_pb2.HandshakeRequest(
        kv_layout=bad, layout_hash=kv_layout_hash(bad), worker_id="d",
        transports=[prefill_pb2.TRANSPORT_KIND_NIXL]), timeout=5)
    assert not resp.compatible and "dtype" in resp.error
    resp = await stub.Handshake(prefill_pb2.HandshakeRequest(
        kv_layout=layout, layout_hash=kv_layout_hash(layout), worker_id="d",
        transports=[prefill_pb2.TRANSPORT_KIND_GRPC]), timeout=5)
    assert not resp.compatible and "transport" in resp.error
    resp = await stub.Handshake(prefill_pb2.HandshakeRequest(
        kv_layout=layout, layout_hash=kv_layout_hash(layout), worker_id="d",
        transports=[prefill_pb2.TRANSPORT_KIND_NIXL]), timeout=5)
    assert resp.compatible and not resp.error


async def test_lease_expiry_frees_prefill_blocks(cluster, model, monkeypatch):
    prefill = await cluster.prefill(model, "grpc", lease_seconds=0.3)
    decode = await cluster.decode(model, "grpc", prefill.address, **FORCE_REMOTE)

    async def never_release(peer, rid):
        return False

    monkeypatch.setattr(decode.peers, "release", never_release)
    prompt = prompt_of(40, 5)
    res = await cluster.client(decode).generate(prompt)
    assert res.output == hf_greedy(model, prompt, 8)
    assert len(prefill.holds) == 1  # the decode side never confirmed
    await pools_whole(prefill, timeout=3)
    assert sample(prefill, "baton_prefill_leases_expired_total") == 1


@pytest.mark.parametrize("transport", ["nixl", "grpc"])
async def test_slow_collection_after_lease_expiry(cluster, model, monkeypatch, transport):
    """Case 1: decode takes longer than the lease to collect; the prefill blocks are gone
    (and scribbled over here). KV was pushed before the reply, so decode's copy is whole:
    output unchanged, ReleaseBlocks says the lease had ended."""
    prefill = await cluster.prefill(model, transport, lease_seconds=0.2)
    decode = await cluster.decode(model, transport, prefill.address, **FORCE_REMOTE)
    real_arrival, released = RemotePrefill._await_arrival, []

    async def slow_arrival(self, result):
        await pools_whole(prefill, timeout=3)  # lease expired, blocks back in the pool
        prefill.engine.kv_cache.fill_(float("nan"))
        return await real_arrival(self, result)

    real_release = decode.peers.release

    async def record_release(peer, rid):
        released.append(await real_release(peer, rid))
        return released[-1]

    monkeypatch.setattr(RemotePrefill, "_await_arrival", slow_arrival)
    monkeypatch.setattr(decode.peers, "release", record_release)
    prompt = prompt_of(40, 6)
    res = await cluster.client(decode).generate(prompt)
    assert res.output == hf_greedy(model, prompt, 8)
    assert res.fin.timings.remote_prefill
    await asyncio.sleep(0.05)
    assert released == [False]


async def test_transfer_never_confirmed_recomputes(cluster, model, monkeypatch):
    """Prefill says OK but the receiver never sees DONE: never decode from that KV."""
    prefill = await cluster.prefill(model, "nixl")
    decode = await cluster.decode(model, "nixl", prefill.address, kv_wait_seconds=0.2,
                                  **FORCE_REMOTE)
    real_poll = decode.receiver.poll
    monkeypatch.setattr(decode.receiver, "poll", lambda tid: (
        real_poll(tid), TransferState.IN_PROGRESS)[1])
    prompt = prompt_of(40, 7)
    res = await cluster.client(decode).generate(prompt)
    assert res.output == hf_greedy(model, prompt, 8) and not res.fin.timings.remote_prefill
    assert sample(decode, "baton_decode_remote_prefills_total", outcome="recompute") == 1
    await pools_whole(prefill, decode)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
async def test_unreachable_prefill(cluster, model, policy):
    decode = await cluster.decode(model, "grpc", "127.0.0.1:1", on_prefill_failure=policy,
                                  handshake_timeout_seconds=0.5, **FORCE_REMOTE)
    prompt = prompt_of(40, 8)
    call = cluster.client(decode).decode.Generate(request(prompt), timeout=30)
    if policy == "recompute":
        assert (await collect(call)).output == hf_greedy(model, prompt, 8)
    else:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            [m async for m in call]
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    await pools_whole(decode)


async def test_bad_requests_are_invalid_argument(cluster, model):
    prefill = await cluster.prefill(model, "grpc")
    decode = await cluster.decode(model, "grpc", prefill.address, max_prompt_tokens=100,
                                  max_n=4, **FORCE_REMOTE)
    client = cluster.client(decode, prefill)
    ok = SamplingParams(temperature=0.0, max_tokens=4)
    bad = [
        request([], ok),
        request([5, 6, 10_000], ok),
        request(list(range(3, 110)), ok),
        request([5, 6], ok, rid="x" * 300),
        request([5, 6], SamplingParams(temperature=0.0, max_tokens=4, n=5)),
        request([5, 6], SamplingParams(temperature=0.0, max_tokens=2000)),
        request([5, 6], ok, prefill_mode=3, prefill_address=""),
    ]
    bad[0].sampling_params.top_p = 2.0
    for req in bad:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            [m async for m in client.decode.Generate(req, timeout=10)]
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, req
    held = client.decode.Generate(request(prompt_of(20, 9), SamplingParams(
        temperature=0.0, max_tokens=300, ignore_eos=True), rid="dup"), timeout=30)
    await held.read()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        [m async for m in client.decode.Generate(request([5, 6], ok, rid="dup"), timeout=10)]
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
    held.cancel()
    short = prompt_of(10, 10)
    assert (await client.generate(short)).output == hf_greedy(model, short, 8)
    await pools_whole(prefill, decode)


async def test_prefill_validates_and_honours_tombstones(cluster, model):
    prefill = await cluster.prefill(model, "grpc")
    decode = await cluster.decode(model, "grpc", prefill.address, **FORCE_REMOTE)
    stub = cluster.client(decode, prefill).prefill
    ep = decode.receiver.endpoint()
    good = dict(request_id="p1", prompt_token_ids=list(range(5, 25)), transfer_id="t1",
                endpoint=ep, num_cached_on_decode=0, dst_block_ids=[1, 2, 3])
    for change in ({"num_cached_on_decode": 3}, {"dst_block_ids": [1, 2]},
                   {"prompt_token_ids": []}, {"transfer_id": ""},
                   {"endpoint": transfer_pb2.TransferEndpoint(
                       layout_hash=ep.layout_hash, block_bytes=ep.block_bytes,
                       num_blocks=ep.num_blocks, inproc={"name": "x"})}):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Prefill(prefill_pb2.PrefillRequest(**{**good, **change}), timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, change
    assert not (await stub.Abort(common_pb2.AbortRequest(request_id="p1"), timeout=5)).found
    resp = await stub.Prefill(prefill_pb2.PrefillRequest(**good), timeout=10)
    assert resp.status == prefill_pb2.PREFILL_STATUS_ABORTED  # overtaken by its Abort
    wrong = prefill_pb2.PrefillRequest(**{**good, "request_id": "p2"})
    wrong.endpoint.layout_hash ^= 1
    resp = await stub.Prefill(wrong, timeout=10)
    assert resp.status == prefill_pb2.PREFILL_STATUS_LAYOUT_MISMATCH
    await pools_whole(prefill, decode)


async def test_a_fault_while_sending_kv_frees_the_held_blocks(cluster, model, monkeypatch):
    """A bug in SENDING_KV (here: waiting on the transfer raises) must not leave the prompt's
    blocks held forever: the sequence is dropped and its blocks with it; decode recomputes."""
    prefill = await cluster.prefill(model, "grpc")
    decode = await cluster.decode(model, "grpc", prefill.address, **FORCE_REMOTE)

    async def broken(*args, **kwargs):
        raise RuntimeError("injected fault while sending")

    monkeypatch.setattr(prefill.sender, "wait_async", broken)
    prompt = prompt_of(40, 6)
    res = await cluster.client(decode).generate(prompt)
    assert res.output == hf_greedy(model, prompt, 8)
    await pools_whole(prefill, decode, timeout=3)
    assert len(prefill.holds) == 0
