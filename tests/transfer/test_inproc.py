"""In-process transport (unit tests only) and the factories."""
from __future__ import annotations

import pytest
import torch

from baton.transfer import KVLayoutError, TransferState, kv_layout, make_receiver, make_sender
from baton.transfer.inproc import InprocSender
from tests.transfer.helpers import MODEL, SHAPE, assert_moved, random_cache


@pytest.fixture
def caches():
    return torch.zeros(SHAPE), random_cache(0)


def test_moves_blocks_and_forgets(caches):
    dst, src = caches
    receiver = make_receiver("inproc", dst, kv_layout(MODEL, dst))
    sender = make_sender("inproc", src, kv_layout(MODEL, src))
    before = dst.clone()
    receiver.expect("t", [3, 1, 30])
    sender.send(receiver.endpoint(), "t", [0, 5, 6], [3, 1, 30])
    assert sender.poll("t") == receiver.poll("t") == TransferState.DONE
    assert_moved(dst, before, src, [0, 5, 6], [3, 1, 30])
    receiver.forget("t")
    sender.forget("t")
    with pytest.raises(KeyError):
        sender.poll("t")
    receiver.close()


def test_held_transfers_complete_or_fail_on_command(caches):
    dst, src = caches
    receiver = make_receiver("inproc", dst, kv_layout(MODEL, dst))
    sender = InprocSender(src, kv_layout(MODEL, src), auto_complete=False)
    ep = receiver.endpoint()
    receiver.expect("a", [1])
    receiver.expect("b", [2])
    sender.send(ep, "a", [4], [1])
    sender.send(ep, "b", [5], [2])
    assert receiver.poll("a") == TransferState.PENDING and sender.poll("a") == TransferState.IN_PROGRESS
    assert not dst[1].any()
    assert sender.complete("a") == TransferState.DONE and receiver.poll("a") == TransferState.DONE
    sender.fail("b")
    assert sender.poll("b") == receiver.poll("b") == TransferState.FAILED
    assert not dst[2].any()
    sender.close()
    receiver.close()


def test_dst_blocks_must_match_what_the_receiver_expects(caches):
    dst, src = caches
    receiver = make_receiver("inproc", dst, kv_layout(MODEL, dst))
    sender = make_sender("inproc", src, kv_layout(MODEL, src))
    receiver.expect("t", [1, 2])
    sender.send(receiver.endpoint(), "t", [0, 1], [2, 1])
    assert sender.poll("t") == receiver.poll("t") == TransferState.FAILED
    assert not dst.any()
    receiver.close()
    sender.send(receiver.endpoint(), "u", [0], [0])  # receiver gone
    assert sender.poll("u") == TransferState.FAILED


def test_factories_check_kind_and_layout(caches):
    dst, _ = caches
    with pytest.raises(ValueError):
        make_receiver("carrier-pigeon", dst, kv_layout(MODEL, dst))
    with pytest.raises(KVLayoutError):
        make_sender("inproc", dst, kv_layout(MODEL, torch.zeros(4, 2, 2, 8, 2, 8)))  # block_size differs
    with pytest.raises(KVLayoutError):
        make_sender("inproc", dst.transpose(3, 4).contiguous().transpose(3, 4), kv_layout(MODEL, dst))


def test_streamed_pushes_copy_in_order_and_cancel_fails_the_receiver(caches):
    dst, src = caches
    receiver = make_receiver("inproc", dst, kv_layout(MODEL, dst))
    sender = make_sender("inproc", src, kv_layout(MODEL, src))
    before = dst.clone()
    receiver.expect("s", [3, 1, 30])
    sender.begin(receiver.endpoint(), "s", [3, 1, 30])
    sender.push("s", [0, 5])
    assert sender.poll("s") == receiver.poll("s") == TransferState.IN_PROGRESS
    assert_moved(dst, before, src, [0, 5], [3, 1])
    with pytest.raises(ValueError):
        sender.push("s", [7, 8])  # one block is left
    sender.push("s", [6])
    assert sender.poll("s") == receiver.poll("s") == TransferState.DONE
    assert_moved(dst, before, src, [0, 5, 6], [3, 1, 30])
    receiver.expect("c", [2, 4])
    sender.begin(receiver.endpoint(), "c", [2, 4])
    sender.push("c", [9])
    sender.cancel("c")
    assert sender.poll("c") == TransferState.CANCELLED and receiver.poll("c") == TransferState.FAILED
    receiver.close()


def test_only_streaming_senders_begin(caches):
    from baton.transfer.inproc import InprocSender

    class WholeOnly(InprocSender):
        streams = False

    dst, src = caches
    receiver = make_receiver("inproc", dst, kv_layout(MODEL, dst))
    sender = WholeOnly(src, kv_layout(MODEL, src))
    try:
        with pytest.raises(NotImplementedError):
            sender.begin(receiver.endpoint(), "n", [1])
    finally:
        sender.close()
        receiver.close()
