"""gRPC transport: bit-exact moves over loopback, split blocks, refusals, bounded failures."""
from __future__ import annotations

import asyncio
import socket
import time

import grpc
import pytest
import torch

from baton.transfer import KVLayoutError, TransferState, kv_layout, make_receiver, make_sender
from baton.transfer.grpc_sender import GrpcSender
from protos import transfer_pb2, transfer_pb2_grpc
from tests.transfer.helpers import MODEL, SHAPE, RemoteReceiver, assert_moved, random_cache

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def decode():
    """(receiver, its kv_cache) served by a grpc.aio server on this test's loop."""
    kv_cache = torch.zeros(SHAPE)
    receiver = make_receiver("grpc", kv_cache, kv_layout(MODEL, kv_cache))
    server = grpc.aio.server()
    receiver.add_to_server(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    receiver.set_address(f"127.0.0.1:{port}")
    yield receiver, kv_cache
    await server.stop(0)
    receiver.close()


@pytest.fixture
def prefill():
    kv_cache = random_cache(0)
    sender = make_sender("grpc", kv_cache, kv_layout(MODEL, kv_cache))
    yield sender, kv_cache
    sender.close()


@pytest.mark.parametrize("chunk_bytes", [None, 3 * 1024, 300])  # many blocks / 3 blocks / slices of one
async def test_moves_chosen_blocks_bit_exact(decode, prefill, chunk_bytes):
    (receiver, dst), (sender, src) = decode, prefill
    if chunk_bytes:
        sender.chunk_bytes = chunk_bytes
    before = dst.clone()
    src_ids, dst_ids = [5, 9, 2, 31, 30, 0, 1], [0, 7, 8, 3, 31, 12, 13]
    receiver.expect("t1", dst_ids, timeout_s=10)
    sender.send(receiver.endpoint(), "t1", src_ids, dst_ids, request_id="r1", timeout_s=10)
    assert await sender.wait_async("t1", 10) == TransferState.DONE
    assert receiver.poll("t1") == TransferState.DONE  # the sender is DONE only after the receiver
    assert_moved(dst, before, src, src_ids, dst_ids)


async def test_concurrent_transfers(decode, prefill):
    (receiver, dst), (sender, src) = decode, prefill
    before = dst.clone()
    plan = {"a": ([0, 1, 2], [20, 21, 22]), "b": ([3], [5]), "c": ([10, 11], [1, 30])}
    for tid, (s_ids, d_ids) in plan.items():
        receiver.expect(tid, d_ids, timeout_s=10)
        sender.send(receiver.endpoint(), tid, s_ids, d_ids, timeout_s=10)
    for tid in plan:
        assert await sender.wait_async(tid, 10) == TransferState.DONE
        assert receiver.poll(tid) == TransferState.DONE
    assert_moved(dst, before, src, sum((p[0] for p in plan.values()), []), sum((p[1] for p in plan.values()), []))


async def test_bf16_and_empty(decode):
    receiver, _ = decode
    src = random_cache(3, dtype=torch.bfloat16)
    dst = torch.zeros(SHAPE, dtype=torch.bfloat16)
    recv16 = make_receiver("grpc", dst, kv_layout(MODEL, dst), address="unused:1")
    sender = make_sender("grpc", src, kv_layout(MODEL, src))
    try:
        with pytest.raises(KVLayoutError):  # fp32 receiver, bf16 sender
            sender.send(receiver.endpoint(), "t", [0], [0])
        recv16.expect("e", [])
        sender.send(recv16.endpoint(), "e", [], [])
        assert sender.poll("e") == recv16.poll("e") == TransferState.DONE
    finally:
        sender.close()


async def test_layout_mismatch_refused_by_receiver(decode):
    receiver, dst = decode
    other = random_cache(1)
    sender = make_sender("grpc", other, kv_layout("another-model", other))
    try:
        ep = receiver.endpoint()
        with pytest.raises(KVLayoutError):  # the sender refuses a known mismatch itself
            sender.send(ep, "t", [0], [0])
        ep.layout_hash = sender.layout_hash  # a forged/stale endpoint: the receiver must refuse
        receiver.expect("t", [4], timeout_s=10)
        sender.send(ep, "t", [0], [4], timeout_s=10)
        assert await sender.wait_async("t", 10) == TransferState.FAILED
        assert receiver.poll("t") == TransferState.FAILED
        assert not dst[4].any()
    finally:
        sender.close()


async def test_unexpected_and_partial_streams_are_refused(decode):
    receiver, dst = decode
    async with grpc.aio.insecure_channel(receiver.address) as channel:
        stub = transfer_pb2_grpc.KVTransferStub(channel)
        first = dict(layout_hash=receiver.layout_hash, block_bytes=receiver.block_bytes)
        one_block = bytes(receiver.block_bytes)

        async def push(*chunks):
            async def gen():
                for c in chunks:
                    yield c
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.PushBlocks(gen(), timeout=10)
            return e.value.code()

        assert await push(transfer_pb2.KVChunk(transfer_id="nobody", dst_block_ids=[0], data=one_block,
                                               **first)) == grpc.StatusCode.NOT_FOUND
        receiver.expect("p", [1, 2], timeout_s=10)
        # only half of what was expected, then the stream ends: refused, transfer FAILED
        assert await push(transfer_pb2.KVChunk(transfer_id="p", dst_block_ids=[1], data=one_block,
                                               **first)) == grpc.StatusCode.INVALID_ARGUMENT
        assert receiver.poll("p") == TransferState.FAILED
        receiver.expect("q", [3], timeout_s=10)
        # a block the transfer does not expect
        assert await push(transfer_pb2.KVChunk(transfer_id="q", dst_block_ids=[9], data=one_block,
                                               **first)) == grpc.StatusCode.INVALID_ARGUMENT
        assert receiver.poll("q") == TransferState.FAILED
        assert not dst.any()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_absent_receiver_fails_fast(prefill):
    sender, _ = prefill
    ep = transfer_pb2.TransferEndpoint(
        layout_hash=sender.layout_hash, block_bytes=sender.block_bytes, num_blocks=SHAPE[0],
        grpc=transfer_pb2.GrpcEndpoint(address=f"127.0.0.1:{_free_port()}"))
    t0 = time.monotonic()
    sender.send(ep, "gone", [0, 1], [0, 1], timeout_s=3)
    assert sender.wait("gone", 10) == TransferState.FAILED
    assert time.monotonic() - t0 < 3.5


async def test_stalled_receiver_times_out(prefill):
    """A server that accepts the stream and never answers: FAILED at the send timeout."""
    sender, _ = prefill

    class Stalled(transfer_pb2_grpc.KVTransferServicer):
        async def PushBlocks(self, request_iterator, context):
            await asyncio.sleep(60)

    server = grpc.aio.server()
    transfer_pb2_grpc.add_KVTransferServicer_to_server(Stalled(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        ep = transfer_pb2.TransferEndpoint(
            layout_hash=sender.layout_hash, block_bytes=sender.block_bytes, num_blocks=SHAPE[0],
            grpc=transfer_pb2.GrpcEndpoint(address=f"127.0.0.1:{port}"))
        t0 = time.monotonic()
        sender.send(ep, "stall", [0], [0], timeout_s=0.5)
        assert await sender.wait_async("stall", 5) == TransferState.FAILED
        assert time.monotonic() - t0 < 2.0
    finally:
        await server.stop(0)


def test_cross_process():
    src = random_cache(2)
    sender = GrpcSender(src, kv_layout(MODEL, src), chunk_bytes=5 * 1024)
    remote = RemoteReceiver("grpc")
    try:
        ep = transfer_pb2.TransferEndpoint.FromString(remote.endpoint_bytes)
        src_ids, dst_ids = list(range(0, 24, 2)), list(range(31, 19, -1))
        remote.expect("x1", dst_ids, timeout_s=20)
        sender.send(ep, "x1", src_ids, dst_ids, timeout_s=20)
        assert sender.wait("x1", 20) == TransferState.DONE
        state, remote_cache = remote.wait("x1", 20)
        assert state == "DONE"
        assert_moved(remote_cache, torch.zeros(SHAPE), src, src_ids, dst_ids)
    finally:
        remote.stop()
        sender.close()


@pytest.mark.parametrize("chunk_bytes", [None, 300])  # whole blocks / slices of one
async def test_streamed_pushes_land_bit_exact_and_done_after_the_last(decode, prefill, chunk_bytes):
    (receiver, dst), (sender, src) = decode, prefill
    if chunk_bytes:
        sender.chunk_bytes = chunk_bytes
    before = dst.clone()
    src_ids, dst_ids = [5, 9, 2, 31, 30], [0, 7, 8, 3, 31]
    receiver.expect("s1", dst_ids, timeout_s=10)
    sender.begin(receiver.endpoint(), "s1", dst_ids, request_id="r1", timeout_s=10)
    sender.push("s1", src_ids[:2])
    deadline = time.monotonic() + 10
    while receiver.poll("s1") != TransferState.IN_PROGRESS and time.monotonic() < deadline:
        await asyncio.sleep(0.005)
    assert sender.poll("s1") == TransferState.IN_PROGRESS  # 3 blocks still to come
    with pytest.raises(ValueError):
        sender.push("s1", [1, 2, 3, 4])  # more than the transfer has left
    sender.push("s1", src_ids[2:3])
    sender.push("s1", src_ids[3:])
    assert await sender.wait_async("s1", 10) == TransferState.DONE
    assert receiver.poll("s1") == TransferState.DONE
    assert_moved(dst, before, src, src_ids, dst_ids)


@pytest.mark.parametrize("pushed", [0, 2])
async def test_cancelled_stream_ends_on_both_sides(decode, prefill, pushed):
    (receiver, dst), (sender, src) = decode, prefill
    receiver.expect("s2", [1, 2, 3], timeout_s=10)
    sender.begin(receiver.endpoint(), "s2", [1, 2, 3], timeout_s=10)
    deadline = time.monotonic() + 10
    if pushed:  # cancelled once the receiver has the first blocks
        sender.push("s2", [4, 5])
        while receiver.poll("s2") != TransferState.IN_PROGRESS and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
    sender.cancel("s2")
    assert await sender.wait_async("s2", 10) == TransferState.CANCELLED
    sender.push("s2", [6])  # ignored once final
    while pushed and receiver.poll("s2") != TransferState.FAILED and time.monotonic() < deadline:
        await asyncio.sleep(0.005)
    assert receiver.poll("s2") == (TransferState.FAILED if pushed else TransferState.PENDING)
