"""Pulls on every transport: the prefill side reads blocks the decode side made readable
(KVReceiver.expect(..., src_block_ids)) into its own blocks, bit exact; on the transports
that serve reads themselves (gRPC, in-process) nothing else can be read, and nothing at all
once the decode side forgot the transfer."""
from __future__ import annotations

import importlib.util

import grpc
import pytest
import torch

from baton.transfer import TransferState, kv_layout, make_receiver, make_sender, pull_id
from tests.transfer.helpers import MODEL, SHAPE, random_cache

pytestmark = pytest.mark.timeout(60)
KINDS = ["inproc", "grpc", pytest.param("nixl", marks=pytest.mark.skipif(
    importlib.util.find_spec("nixl") is None, reason="nixl is not installed"))]


class Pair:
    """A decode-side receiver (its cache random: the blocks it holds) and a prefill-side
    sender (its cache zeros), on `kind`."""

    async def start(self, kind: str) -> Pair:
        self.kind, self.held, self.own = kind, random_cache(3), torch.zeros(SHAPE)
        self.receiver = make_receiver(kind, self.held, kv_layout(MODEL, self.held))
        self.server = None
        if kind == "grpc":
            self.server = grpc.aio.server()
            self.receiver.add_to_server(self.server)
            port = self.server.add_insecure_port("127.0.0.1:0")
            await self.server.start()
            self.receiver.set_address(f"127.0.0.1:{port}")
        self.sender = make_sender(kind, self.own, kv_layout(MODEL, self.own))
        return self

    async def stop(self) -> None:
        self.sender.close()
        if self.server is not None:
            await self.server.stop(0)
        self.receiver.close()


@pytest.fixture(params=KINDS)
async def pair(request):
    p = await Pair().start(request.param)
    yield p
    await p.stop()


@pytest.mark.parametrize("chunk_bytes", [None, 300])  # whole blocks / slices of one
async def test_a_pull_reads_the_readable_blocks_bit_exact(pair, chunk_bytes):
    if chunk_bytes and pair.kind != "grpc":
        pytest.skip("chunking is the gRPC transport's")
    if chunk_bytes:
        pair.sender.chunk_bytes = chunk_bytes
    held_ids, own_ids = [7, 3, 30, 31], [0, 1, 12, 5]
    pair.receiver.expect("t", [20, 21], timeout_s=10, src_block_ids=held_ids)
    before = pair.own.clone()
    pair.sender.pull(pair.receiver.endpoint(), "t", held_ids, own_ids, request_id="r",
                     timeout_s=10)
    assert await pair.sender.wait_async(pull_id("t"), 10) == TransferState.DONE
    for h, o in zip(held_ids, own_ids):
        assert torch.equal(pair.own[o].view(torch.uint8), pair.held[h].view(torch.uint8))
    others = [b for b in range(SHAPE[0]) if b not in own_ids]
    assert torch.equal(pair.own[others], before[others])
    assert pair.receiver.poll("t") == TransferState.PENDING  # a pull is not the send
    pair.sender.forget(pull_id("t"))


async def test_unreadable_or_forgotten_blocks_are_refused(pair):
    if pair.kind == "nixl":
        pytest.skip("a NIXL READ is one-sided: the decode side keeps its blocks instead")
    pair.receiver.expect("t", [20], timeout_s=10, src_block_ids=[7])
    ep = pair.receiver.endpoint()
    pair.sender.pull(ep, "t", [8], [0], timeout_s=10)  # block 8 was not made readable
    assert await pair.sender.wait_async(pull_id("t"), 10) == TransferState.FAILED
    pair.sender.forget(pull_id("t"))
    pair.receiver.forget("t")
    pair.sender.pull(ep, "t", [7], [0], timeout_s=10)  # readable once, forgotten since
    assert await pair.sender.wait_async(pull_id("t"), 10) == TransferState.FAILED
    assert not pair.own.any()  # nothing was written


async def test_pull_checks_its_arguments(pair):
    ep = pair.receiver.endpoint()
    with pytest.raises(ValueError):
        pair.sender.pull(ep, "t", [1, 2], [3], timeout_s=1)
    with pytest.raises(ValueError):
        pair.sender.pull(ep, "t", [SHAPE[0]], [3], timeout_s=1)
