"""NIXL transport over UCX on loopback: bit-exact moves, layout refusal, bounded failures."""
from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("nixl._api")

from baton.transfer import KVLayoutError, TransferState, kv_layout, make_receiver, make_sender  # noqa: E402
from baton.transfer.nixl import INLINE_BYTES  # noqa: E402
from protos import transfer_pb2  # noqa: E402
from tests.transfer.helpers import MODEL, SHAPE, RemoteReceiver, assert_moved, random_cache  # noqa: E402

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def pair():
    """(receiver, sender, decode kv_cache, prefill kv_cache) in this process."""
    dst, src = torch.zeros(SHAPE), random_cache(0)
    receiver = make_receiver("nixl", dst, kv_layout(MODEL, dst))
    sender = make_sender("nixl", src, kv_layout(MODEL, src))
    yield receiver, sender, dst, src
    sender.close()
    receiver.close()


@pytest.mark.parametrize("src_ids, dst_ids", [
    ([0, 1, 2, 3], [10, 11, 12, 13]),       # one contiguous run on both sides
    ([5, 9, 2, 31, 30], [0, 7, 8, 3, 31]),   # scattered, partly adjacent
    ([4], [4]),
])
def test_moves_chosen_blocks_bit_exact(pair, src_ids, dst_ids):
    receiver, sender, dst, src = pair
    before = dst.clone()
    tid = f"t-{src_ids}-{dst_ids}"
    receiver.expect(tid, dst_ids, timeout_s=10)
    assert receiver.poll(tid) == TransferState.PENDING
    sender.send(receiver.endpoint(), tid, src_ids, dst_ids, timeout_s=10)
    assert sender.wait(tid, 10) == TransferState.DONE
    deadline = time.monotonic() + 10
    while receiver.poll(tid) != TransferState.DONE and time.monotonic() < deadline:
        time.sleep(0.001)
    assert receiver.poll(tid) == TransferState.DONE
    assert_moved(dst, before, src, src_ids, dst_ids)
    receiver.forget(tid)
    sender.forget(tid)
    with pytest.raises(KeyError):
        receiver.poll(tid)


def test_concurrent_transfers(pair):
    receiver, sender, dst, src = pair
    before = dst.clone()
    plan = {"ca": ([0, 1, 2], [20, 21, 22]), "cb": ([3], [5]), "cc": ([10, 11], [1, 30])}
    ep = receiver.endpoint()
    for tid, (s_ids, d_ids) in plan.items():
        receiver.expect(tid, d_ids, timeout_s=10)
        sender.send(ep, tid, s_ids, d_ids, timeout_s=10)
    for tid in plan:
        assert sender.wait(tid, 10) == TransferState.DONE
    deadline = time.monotonic() + 10
    while any(receiver.poll(t) != TransferState.DONE for t in plan) and time.monotonic() < deadline:
        time.sleep(0.001)
    assert all(receiver.poll(t) == TransferState.DONE for t in plan)
    assert_moved(dst, before, src, sum((p[0] for p in plan.values()), []), sum((p[1] for p in plan.values()), []))


def test_large_transfer_posted_by_the_progress_thread():
    """Over INLINE_BYTES: send() returns before the copy, the progress thread posts it."""
    shape = (12, 2, 2, 64, 8, 128)  # 1 MiB blocks
    dst, src = torch.zeros(shape), random_cache(4, shape=shape)
    receiver = make_receiver("nixl", dst, kv_layout(MODEL, dst))
    sender = make_sender("nixl", src, kv_layout(MODEL, src))
    try:
        src_ids, dst_ids = [0, 1, 2, 3, 4, 9], [11, 10, 3, 4, 5, 0]
        assert len(src_ids) * sender.block_bytes > INLINE_BYTES
        receiver.expect("big", dst_ids, timeout_s=20)
        sender.send(receiver.endpoint(), "big", src_ids, dst_ids, timeout_s=20)
        assert sender.wait("big", 20) == TransferState.DONE
        deadline = time.monotonic() + 10
        while receiver.poll("big") != TransferState.DONE and time.monotonic() < deadline:
            time.sleep(0.001)
        assert receiver.poll("big") == TransferState.DONE
        assert_moved(dst, torch.zeros(shape), src, src_ids, dst_ids)
    finally:
        sender.close()
        receiver.close()


def test_empty_transfer_is_done_at_once(pair):
    receiver, sender, _, _ = pair
    receiver.expect("empty", [])
    sender.send(receiver.endpoint(), "empty", [], [])
    assert receiver.poll("empty") == sender.poll("empty") == TransferState.DONE


def test_layout_mismatch_is_refused(pair):
    receiver, _, _, _ = pair
    other = random_cache(1)
    sender = make_sender("nixl", other, kv_layout("another-model", other))
    try:
        with pytest.raises(KVLayoutError):
            sender.send(receiver.endpoint(), "x", [0], [0])
    finally:
        sender.close()


def test_bad_arguments_raise(pair):
    receiver, sender, _, _ = pair
    ep = receiver.endpoint()
    with pytest.raises(ValueError):
        sender.send(ep, "bad", [0, 1], [2])
    with pytest.raises(ValueError):
        sender.send(ep, "bad", [0], [SHAPE[0]])
    with pytest.raises(ValueError):
        sender.send(transfer_pb2.TransferEndpoint(
            layout_hash=ep.layout_hash, block_bytes=ep.block_bytes, num_blocks=ep.num_blocks,
            grpc=transfer_pb2.GrpcEndpoint(address="x:1")), "bad", [0], [0])
    with pytest.raises(ValueError):
        receiver.expect("dup", [1, 1])


def test_receiver_times_out_without_a_sender(pair):
    receiver, _, _, _ = pair
    receiver.expect("nobody", [3], timeout_s=0.05)
    time.sleep(0.1)
    assert receiver.poll("nobody") == TransferState.FAILED


def test_absent_receiver_fails_fast(pair):
    _, sender, _, _ = pair
    gone = torch.zeros(SHAPE)
    receiver = make_receiver("nixl", gone, kv_layout(MODEL, gone))
    ep = receiver.endpoint()
    receiver.close()
    del receiver
    t0 = time.monotonic()
    sender.send(ep, "to-nobody", [0, 1], [0, 1], timeout_s=5)
    assert sender.wait("to-nobody", 10) == TransferState.FAILED
    assert time.monotonic() - t0 < 5.5


def test_cross_process_then_receiver_dies():
    src = random_cache(2)
    sender = make_sender("nixl", src, kv_layout(MODEL, src))
    remote = RemoteReceiver("nixl")
    try:
        ep = transfer_pb2.TransferEndpoint.FromString(remote.endpoint_bytes)
        src_ids, dst_ids = [3, 4, 5, 20, 7], [30, 31, 0, 1, 16]
        remote.expect("x1", dst_ids, timeout_s=20)
        sender.send(ep, "x1", src_ids, dst_ids, timeout_s=20)
        assert sender.wait("x1", 20) == TransferState.DONE
        state, remote_cache = remote.wait("x1", 20)
        assert state == "DONE"
        assert_moved(remote_cache, torch.zeros(SHAPE), src, src_ids, dst_ids)

        remote.stop()  # the peer is cached and connected; now it is gone
        t0 = time.monotonic()
        sender.send(ep, "x2", [1], [1], timeout_s=3)
        assert sender.wait("x2", 10) == TransferState.FAILED
        assert time.monotonic() - t0 < 3.5
    finally:
        remote.stop()
        sender.close()


def _until(pred, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred() and time.monotonic() < deadline:
        time.sleep(0.001)


class _HoldFirstWrite:
    """The sender's agent, except that its first WRITE reports PROC (in flight) until
    `held` is cleared; records every WRITE made as (dst ids, notification, handle)."""

    def __init__(self, agent) -> None:
        self.agent, self.held, self.writes = agent, True, []

    def __getattr__(self, name):
        return getattr(self.agent, name)

    def make_prepped_xfer(self, op, local, src, remote, dst, notif=b""):
        handle = self.agent.make_prepped_xfer(op, local, src, remote, dst, notif)
        self.writes.append((list(dst), notif, handle))
        return handle

    def _first(self, handle) -> bool:
        return self.held and handle is self.writes[0][2]

    def transfer(self, handle):
        status = self.agent.transfer(handle)
        return "PROC" if self._first(handle) else status

    def check_xfer_state(self, handle):
        return "PROC" if self._first(handle) else self.agent.check_xfer_state(handle)


def test_streamed_pushes_land_bit_exact_and_done_after_the_last(pair):
    receiver, sender, dst, src = pair
    before = dst.clone()
    src_ids, dst_ids = [5, 9, 2, 31, 30], [0, 7, 8, 3, 31]
    receiver.expect("s1", dst_ids, timeout_s=10)
    sender.begin(receiver.endpoint(), "s1", dst_ids, timeout_s=10)
    assert sender.poll("s1") == TransferState.PENDING
    sender.push("s1", src_ids[:2])
    sender.push("s1", src_ids[2:3])
    _until(lambda: all(w.done for w in sender._xfers["s1"].writes))
    assert sender.poll("s1") == TransferState.IN_PROGRESS  # 2 blocks still to come
    assert receiver.poll("s1") == TransferState.PENDING    # no notification before the last
    assert_moved(dst, before, src, src_ids[:3], dst_ids[:3])
    with pytest.raises(ValueError):
        sender.push("s1", [1, 2, 3])  # more than the transfer has left
    with pytest.raises(KeyError):
        sender.push("nobody", [1])
    sender.push("s1", src_ids[3:])
    assert sender.wait("s1", 10) == TransferState.DONE
    _until(lambda: receiver.poll("s1") == TransferState.DONE)
    assert receiver.poll("s1") == TransferState.DONE
    assert_moved(dst, before, src, src_ids, dst_ids)
    sender.push("s1", [])  # ignored once final
    sender.forget("s1")
    receiver.forget("s1")


def test_last_write_waits_for_every_earlier_one(pair):
    """The notifying WRITE is posted only after the earlier ones completed, so the
    receiver's DONE means every byte landed."""
    receiver, sender, dst, src = pair
    before = dst.clone()
    agent = sender._agent
    sender._agent = hold = _HoldFirstWrite(agent)
    try:
        receiver.expect("s3", [12, 13, 14], timeout_s=10)
        sender.begin(receiver.endpoint(), "s3", [12, 13, 14], timeout_s=10)
        sender.push("s3", [1, 2])
        sender.push("s3", [3])  # the last: due, held back
        for _ in range(20):
            assert sender.poll("s3") == TransferState.IN_PROGRESS
            time.sleep(0.002)  # the progress thread ticks meanwhile
        assert [(d, n) for d, n, _ in hold.writes] == [([12, 13], b"")]
        assert receiver.poll("s3") == TransferState.PENDING
        hold.held = False
        assert sender.wait("s3", 10) == TransferState.DONE
        assert [(d, n) for d, n, _ in hold.writes] == [([12, 13], b""), ([14], b"baton-kv:s3")]
        _until(lambda: receiver.poll("s3") == TransferState.DONE)
        assert receiver.poll("s3") == TransferState.DONE
        assert_moved(dst, before, src, [1, 2, 3], [12, 13, 14])
    finally:
        sender._agent = agent


@pytest.mark.parametrize("pushed", [0, 2])
def test_cancelled_stream_ends_on_both_sides(pair, pushed):
    """cancel() releases the in-flight WRITE before CANCELLED; no notification ever goes,
    so the receiver ends FAILED at its own timeout."""
    receiver, sender, _, _ = pair
    tid = f"s2-{pushed}"
    agent = sender._agent
    sender._agent = hold = _HoldFirstWrite(agent)
    try:
        receiver.expect(tid, [1, 2, 3], timeout_s=0.5)
        sender.begin(receiver.endpoint(), tid, [1, 2, 3], timeout_s=10)
        if pushed:
            sender.push(tid, [4, 5])  # in flight (held) when the cancel comes
            assert sender.poll(tid) == TransferState.IN_PROGRESS
        sender.cancel(tid)
        assert sender.wait(tid, 10) == TransferState.CANCELLED
        assert all(w.handle is None for w in sender._xfers[tid].writes)  # released
        sender.push(tid, [6])  # ignored once final
        assert [n for _, n, _ in hold.writes] == [b""] * (pushed > 0)
    finally:
        sender._agent = agent
    _until(lambda: receiver.poll(tid) == TransferState.FAILED)
    assert receiver.poll(tid) == TransferState.FAILED
    sender.forget(tid)
    receiver.forget(tid)


def test_empty_stream_is_done_at_once(pair):
    receiver, sender, _, _ = pair
    receiver.expect("s-empty", [])
    sender.begin(receiver.endpoint(), "s-empty", [])
    assert sender.poll("s-empty") == receiver.poll("s-empty") == TransferState.DONE


def test_a_process_with_a_nixl_agent_exits_cleanly():
    """The nixl wheels bundle libibverbs/libnl; with the system's libibverbs1 installed too
    (Mooncake Store needs it) UCX's ib module used to load both libnl copies and the process
    segfaulted at exit (rc 139, which fails a pytest run that passed). make_agent avoids it."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "UCX_MODULES"}
    code = "from baton.transfer.nixl import make_agent; make_agent('exit-test', None)"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr.decode()[-2000:]


def test_ucx_ib_modules_are_kept_off_only_without_an_rdma_device(tmp_path):
    from baton.transfer.nixl import ucx_env_without_rdma
    env: dict[str, str] = {}
    ucx_env_without_rdma(env, sysfs=str(tmp_path / "absent"))
    assert env == {"UCX_MODULES": "^ib"}
    (tmp_path / "ib").mkdir()
    (tmp_path / "ib" / "mlx5_0").mkdir()
    env = {}
    ucx_env_without_rdma(env, sysfs=str(tmp_path / "ib"))
    assert env == {}                      # a real HCA: UCX loads its ib transports
    env = {"UCX_MODULES": "all"}
    ucx_env_without_rdma(env, sysfs=str(tmp_path / "absent"))
    assert env == {"UCX_MODULES": "all"}  # the operator's choice wins
