"""In-process transport, for unit tests only: a block copy between two kv_caches of one process.

Receivers register under a name (InprocEndpoint.name); a sender copies with pack/unpack and
marks both sides DONE. A streamed transfer (begin/push) is copied a push at a time, in order;
the receiver turns DONE with the last dst block. With auto_complete=False a transfer stays IN_PROGRESS until the test
calls complete(tid) or fail(tid), so scheduler tests can hold a request in its
waiting-for-KV state for exactly as many steps as they like. The receiver also checks that the
sender's dst blocks are exactly the next ones it expected, which catches block bookkeeping bugs.
"""
from __future__ import annotations

import time
import uuid
import weakref
from dataclasses import dataclass

import torch

from baton.transfer.base import KVReceiver, KVSender, TransferState, pull_id
from kernels.block_copy import pack_blocks, unpack_blocks
from protos import common_pb2, transfer_pb2

_RECEIVERS: weakref.WeakValueDictionary[str, InprocReceiver] = weakref.WeakValueDictionary()


class InprocReceiver(KVReceiver):
    """Decode side; found by senders under `name` (generated when None)."""

    refuses_late_writes = True  # a delivery for a forgotten transfer fails

    def __init__(self, kv_cache: torch.Tensor, layout: common_pb2.KVLayout, name: str | None = None) -> None:
        super().__init__(kv_cache, layout)
        self.name = name or f"inproc-{uuid.uuid4().hex[:8]}"
        if self.name in _RECEIVERS:
            raise ValueError(f"an inproc receiver named {self.name!r} exists")
        _RECEIVERS[self.name] = self
        self._landed: dict[str, int] = {}  # transfer id -> dst blocks written so far

    def forget(self, transfer_id: str) -> None:
        with self._lock:
            self._transfers.pop(transfer_id, None)
            self._landed.pop(transfer_id, None)

    def endpoint(self) -> transfer_pb2.TransferEndpoint:
        return self._endpoint(inproc=transfer_pb2.InprocEndpoint(name=self.name))

    def close(self) -> None:
        if _RECEIVERS.get(self.name) is self:
            del _RECEIVERS[self.name]

    def _deliver(self, tid: str, src_cache: torch.Tensor, src: list[int], dst: list[int]) -> TransferState:
        """Copy the next part of a transfer (dst: the next expected dst blocks, in order)."""
        with self._lock:
            t = self._transfers.get(tid)
            off = self._landed.get(tid, 0)
            if t is None or t.state.finished or t.dst_block_ids[off:off + len(dst)] != dst:
                if t is not None and not t.state.finished:
                    t.state = TransferState.FAILED
                return TransferState.FAILED
            packed = pack_blocks(src_cache, torch.tensor(src, dtype=torch.int64, device=src_cache.device))
            dst_ids = torch.tensor(dst, dtype=torch.int64, device=self.kv_cache.device)
            unpack_blocks(packed.to(self.kv_cache.device), self.kv_cache, dst_ids)
            self._landed[tid] = off = off + len(dst)
            done = off == len(t.dst_block_ids)
            t.state = TransferState.DONE if done else TransferState.IN_PROGRESS
            return t.state

    def _fail(self, tid: str) -> None:
        with self._lock:
            t = self._transfers.get(tid)
            if t is not None and not t.state.finished:
                t.state = TransferState.FAILED

    def _read(self, tid: str, src: list[int], dst_cache: torch.Tensor, dst: list[int]) -> bool:
        """Copy readable blocks of a live transfer into another kv_cache; False if refused."""
        if not self.readable(tid, src):
            return False
        packed = pack_blocks(self.kv_cache, torch.tensor(src, dtype=torch.int64,
                                                         device=self.kv_cache.device))
        unpack_blocks(packed.to(dst_cache.device), dst_cache,
                      torch.tensor(dst, dtype=torch.int64, device=dst_cache.device))
        return True


@dataclass
class _Held:
    receiver: str
    src: list[int]     # pushed so far (all of them for send())
    dst: list[int]     # every dst block of the transfer
    deadline: float
    state: TransferState = TransferState.IN_PROGRESS
    copied: int = 0    # blocks delivered to the receiver


class InprocSender(KVSender):
    """Prefill side. auto_complete=False holds every transfer until complete()/fail()."""

    transport = "inproc"
    streams = True

    def __init__(self, kv_cache: torch.Tensor, layout: common_pb2.KVLayout, auto_complete: bool = True) -> None:
        super().__init__(kv_cache, layout)
        self.auto_complete = auto_complete
        self._xfers: dict[str, _Held] = {}

    def _start(self, endpoint, transfer_id, src, dst, request_id, deadline) -> None:
        with self._lock:
            if transfer_id in self._xfers:
                raise ValueError(f"transfer {transfer_id!r} is already live")
            x = self._xfers[transfer_id] = _Held(endpoint.inproc.name, src, dst, deadline)
            if not src:
                x.state = TransferState.DONE
        if self.auto_complete:
            self.complete(transfer_id)

    def _begin(self, endpoint, transfer_id, dst, request_id, deadline) -> None:
        with self._lock:
            if transfer_id in self._xfers:
                raise ValueError(f"transfer {transfer_id!r} is already live")
            x = self._xfers[transfer_id] = _Held(endpoint.inproc.name, [], dst, deadline)
            if not dst:
                x.state = TransferState.DONE

    def _start_pull(self, endpoint, transfer_id, src, dst, request_id, deadline) -> None:
        """Read at once (auto_complete or not: a pull precedes the compute)."""
        pid = pull_id(transfer_id)
        with self._lock:
            if pid in self._xfers:
                raise ValueError(f"transfer {pid!r} is already live")
            receiver = _RECEIVERS.get(endpoint.inproc.name)
            ok = receiver is not None and receiver._read(transfer_id, src, self.kv_cache, dst)
            state = TransferState.DONE if ok else TransferState.FAILED
            self._xfers[pid] = _Held(endpoint.inproc.name, src, dst, deadline, state,
                                     len(src))

    def _push_blocks(self, transfer_id: str, src: list[int]) -> None:
        with self._lock:
            x = self._xfers[transfer_id]
            if len(src) > len(x.dst) - len(x.src):
                raise ValueError(f"{len(src)} blocks pushed, {len(x.dst) - len(x.src)} left")
            if x.state.finished:
                return
            x.src.extend(src)
        if self.auto_complete:
            self.complete(transfer_id)

    def complete(self, transfer_id: str) -> TransferState:
        """Copy the blocks pushed and not yet copied now; DONE once all are, FAILED when the
        receiver is gone or disagrees."""
        with self._lock:
            x = self._xfers[transfer_id]
            if x.state.finished or x.copied == len(x.src):
                return x.state
            receiver = _RECEIVERS.get(x.receiver)
            part = slice(x.copied, len(x.src))
            x.state = TransferState.FAILED if receiver is None else receiver._deliver(
                transfer_id, self.kv_cache, x.src[part], x.dst[part])
            x.copied = len(x.src)
            return x.state

    def cancel(self, transfer_id: str) -> None:
        with self._lock:
            x = self._xfers.get(transfer_id)
            if x is not None and not x.state.finished:
                x.state = TransferState.CANCELLED
                if (receiver := _RECEIVERS.get(x.receiver)) is not None:
                    receiver._fail(transfer_id)

    def fail(self, transfer_id: str) -> None:
        """End the transfer FAILED on both sides, copying nothing."""
        with self._lock:
            x = self._xfers[transfer_id]
            if not x.state.finished:
                x.state = TransferState.FAILED
                if (receiver := _RECEIVERS.get(x.receiver)) is not None:
                    receiver._fail(transfer_id)

    def poll(self, transfer_id: str) -> TransferState:
        with self._lock:
            x = self._xfers[transfer_id]
            if not x.state.finished and time.monotonic() > x.deadline:
                x.state = TransferState.FAILED
            return x.state

    def forget(self, transfer_id: str) -> None:
        with self._lock:
            self._xfers.pop(transfer_id, None)

    def close(self) -> None:
        with self._lock:
            for x in self._xfers.values():
                if not x.state.finished:
                    x.state = TransferState.CANCELLED
