"""NIXL transport, prefill side: `NixlSender` (see nixl.py for the whole picture: the
hand-over, the progress threads and how errors end a send).

A transfer is a list of WRITEs into consecutive dst blocks: send() makes one, a streamed
transfer (begin/push) one per push. A pull is one READ of the receiver's blocks into local
ones (NIXL READ over the same registrations and descriptor lists; no notification: the
reader sees its own request complete). Only the last WRITE carries the notification
"baton-kv:<tid>", and it is posted only once every earlier WRITE of the transfer completed:
NIXL notifies per request, and its UCX backend ends each request with an endpoint flush (DONE
= complete at the target), so the receiver sees DONE only when every byte has landed (it
needs to know nothing of streaming). cancel(), an error or the deadline release every
request of the transfer (NIXL cancels what is still in flight) before its state turns final.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from baton.transfer.base import KVSender, TransferState, pull_id
from baton.transfer.nixl import (
    INLINE_BYTES,
    NOTIF_PREFIX,
    Peer,
    Poller,
    block_descs,
    drop_peer,
    load_peer,
    make_agent,
    memory_of,
)
from protos import common_pb2, transfer_pb2

log = logging.getLogger(__name__)


@dataclass
class _Write:
    """One NIXL request between local blocks `src` and remote blocks `dst` (a WRITE into
    dst, or a pull's READ from it); `last` carries a WRITE's notification."""

    src: list[int]
    dst: list[int]
    last: bool
    handle: object | None = None  # posted and not yet complete
    done: bool = False


@dataclass
class _Xfer:
    endpoint: transfer_pb2.TransferEndpoint
    dst: list[int]    # every dst block, in write order
    deadline: float
    writes: list[_Write] = field(default_factory=list)
    pushed: int = 0   # dst blocks given to a write so far
    stopping: bool = False  # cancel() came: release everything, then CANCELLED
    state: TransferState = TransferState.PENDING  # PENDING = nothing posted yet
    peer: Peer | None = field(default=None, repr=False)  # keeps the remote dlist alive
    op: str = "WRITE"  # "READ": a pull

    def busy(self) -> bool:
        """Whether the progress thread has work here (a write to post or to check)."""
        return not self.state.finished and (self.stopping or any(not w.done for w in self.writes))


class NixlSender(KVSender):
    """Prefill side; `name` is the NIXL agent name (unique; generated when None).

    Locks: self._lock guards the Python state (held briefly); self._agent_lock serializes
    every NIXL call (held across a post, i.e. a whole copy); callers only try to take it.
    """

    transport = "nixl"
    streams = True

    def __init__(self, kv_cache: torch.Tensor, layout: common_pb2.KVLayout, name: str | None = None) -> None:
        super().__init__(kv_cache, layout)
        self._agent = make_agent("send", name)
        self._registration = self._agent.register_memory(kv_cache)
        mem, device_id = memory_of(kv_cache)
        descs = block_descs(kv_cache.data_ptr(), self.block_bytes, self.num_blocks, device_id)
        self._local = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", descs, mem)
        self._peers: dict[str, Peer] = {}  # agent lock only
        self._xfers: dict[str, _Xfer] = {}
        self._orphans: list[_Xfer] = []  # forgotten while live: cancelled by the progress thread
        self._closed = False
        self._agent_lock = threading.Lock()
        self._poller = Poller(self._tick, f"{self._agent.name}-progress")

    def _start(self, endpoint, transfer_id, src, dst, request_id, deadline) -> None:
        self._written()
        x = self._open(endpoint, transfer_id, dst, deadline, src)
        self._drive(transfer_id, x)

    def _written(self) -> None:
        """On CUDA, wait until the kernels writing the KV have run: UCX reads the device
        memory directly, outside the stream order (a prefill chunk's step that samples
        nothing ends without any other sync)."""
        if self.kv_cache.is_cuda:
            torch.cuda.synchronize(self.kv_cache.device)

    def _begin(self, endpoint, transfer_id, dst, request_id, deadline) -> None:
        self._open(endpoint, transfer_id, dst, deadline)
        self._poller.wake()  # it loads the peer now, not at the first push (nor in this thread)

    def _start_pull(self, endpoint, transfer_id, src, dst, request_id, deadline) -> None:
        pid = pull_id(transfer_id)  # local blocks `dst` ← remote blocks `src`
        x = self._open(endpoint, pid, src, deadline, dst, op="READ")
        self._drive(pid, x)

    def _push_blocks(self, transfer_id: str, src: list[int]) -> None:
        self._written()
        with self._lock:
            x = self._xfers[transfer_id]
            if len(src) > len(x.dst) - x.pushed:
                raise ValueError(f"{len(src)} blocks pushed, {len(x.dst) - x.pushed} left")
            if x.state.finished or x.stopping or not src:
                return
            self._append(x, src)
        self._drive(transfer_id, x)

    def cancel(self, transfer_id: str) -> None:
        with self._lock:
            x = self._xfers.get(transfer_id)
            if x is None or x.state.finished:
                return
            x.stopping = True
        self._drive(transfer_id, x)

    def poll(self, transfer_id: str) -> TransferState:
        with self._lock:
            x = self._xfers[transfer_id]
        if not x.state.finished:
            self._drive(transfer_id, x, wake=False)
        with self._lock:
            return x.state

    def forget(self, transfer_id: str) -> None:
        with self._lock:
            x = self._xfers.pop(transfer_id, None)
            if x is not None and not x.state.finished:
                x.deadline = -1.0  # the progress thread cancels it
                self._orphans.append(x)
        self._poller.wake()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._poller.stop()
        with self._agent_lock:
            self._shutdown()

    def _open(self, endpoint, transfer_id: str, dst: list[int], deadline: float,
              src: list[int] = (), op: str = "WRITE") -> _Xfer:
        """dst: remote block ids, src: local ones (for a READ too)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("NixlSender is closed")
            if transfer_id in self._xfers:
                raise ValueError(f"transfer {transfer_id!r} is already live")
            x = self._xfers[transfer_id] = _Xfer(endpoint, dst, deadline, op=op)
            if not dst:
                x.state = TransferState.DONE
            elif src:
                self._append(x, src)
            return x

    @staticmethod
    def _append(x: _Xfer, src: list[int]) -> None:
        """The next write: src into the next len(src) dst blocks (self._lock held)."""
        dst = x.dst[x.pushed:x.pushed + len(src)]
        x.pushed += len(src)
        x.writes.append(_Write(src, dst, last=x.pushed == len(x.dst)))

    def _drive(self, tid: str, x: _Xfer, wake: bool = True) -> None:
        """Advance the transfer in the caller's thread when the agent is free (posting no
        more than INLINE_BYTES there), and wake the progress thread for the rest."""
        if self._agent_lock.acquire(blocking=False):
            try:
                if self._agent is not None:
                    self._advance(tid, x, inline=True)
            finally:
                self._agent_lock.release()
        if wake:
            self._poller.wake()

    def _shutdown(self) -> None:
        for x in [*self._xfers.values(), *self._orphans]:
            self._release(x)
            if not x.state.finished:
                x.state = TransferState.CANCELLED
        for peer in self._peers.values():
            drop_peer(self._agent, peer)
        self._peers.clear()
        self._local.release()
        self._agent.deregister_memory(self._registration)
        self._agent = None

    # -- NIXL calls (self._agent_lock held) -------------------------------------------------
    def _tick(self) -> bool:
        with self._agent_lock:
            with self._lock:
                live = [(tid, x) for tid, x in self._xfers.items() if not x.state.finished]
                live += [("(forgotten)", x) for x in self._orphans]
            for tid, x in live:
                if x.peer is None and x.dst and not (x.state.finished or x.stopping) \
                        and time.monotonic() <= x.deadline:
                    self._load_peer(tid, x)  # begun: ready before the first push
                self._advance(tid, x, inline=False)
            with self._lock:
                self._orphans = [x for x in self._orphans if not x.state.finished]
                return any(x.busy() for _, x in live)

    def _advance(self, tid: str, x: _Xfer, inline: bool) -> None:
        """Check the posted writes, post the ones due (the last only after all others
        completed; inline: only while what is due fits INLINE_BYTES), end the transfer
        when the last completed, an error came, cancel() asked or the deadline passed.
        (A stream waiting for its next push has nothing posted: its deadline is checked
        here, at the next push, poll or tick.)"""
        with self._lock:
            if x.state.finished:
                return
            writes, stopping = list(x.writes), x.stopping
        if stopping:
            return self._finish(tid, x, TransferState.CANCELLED)
        for w in writes:
            if w.handle is not None and not self._landed(tid, x, w, self._status(w)):
                return
        late = time.monotonic() > x.deadline
        due = [] if late else [w for w in writes if w.handle is None and not w.done]
        if inline and sum(len(w.src) for w in due) * self.block_bytes > INLINE_BYTES:
            due = []
        for w in due:
            if w.last and not all(v.done for v in writes if v is not w):
                break
            if not self._landed(tid, x, w, self._post(tid, x, w)):
                return
        if writes and writes[-1].last and writes[-1].done:
            self._finish(tid, x, TransferState.DONE)
        elif late:
            self._finish(tid, x, TransferState.FAILED, "timed out or forgotten in flight")

    def _post(self, tid: str, x: _Xfer, w: _Write) -> str:
        """Post one WRITE (or a pull's READ); its status ("DONE", "PROC" or an error)."""
        if x.peer is None and not self._load_peer(tid, x):
            return "peer not loaded"
        if not x.peer.healthy:  # another transfer to it failed: it may be reloaded already
            return "peer failed"
        notif = NOTIF_PREFIX + tid.encode() if w.last and x.op == "WRITE" else b""
        try:
            w.handle = self._agent.make_prepped_xfer(x.op, self._local, w.src, x.peer.dlist,
                                                     w.dst, notif)
            return self._agent.transfer(w.handle)  # between local processes: the whole copy
        except Exception as e:  # NIXL raises one class per status code, all plain Exceptions
            return repr(e)

    def _status(self, w: _Write) -> str:
        try:
            return self._agent.check_xfer_state(w.handle)
        except Exception as e:
            return repr(e)

    def _landed(self, tid: str, x: _Xfer, w: _Write, status: str) -> bool:
        """Record a write's status; False when it ended the transfer (FAILED)."""
        if status in ("DONE", "PROC"):
            if status == "DONE":
                self._release_write(w)
                w.done = True
            with self._lock:
                x.state = TransferState.IN_PROGRESS  # DONE once the last write is
        else:
            if x.peer is not None:
                x.peer.healthy = False
            self._finish(tid, x, TransferState.FAILED, f"transfer error {status}")
            return False
        return True

    def _finish(self, tid: str, x: _Xfer, state: TransferState, why: str = "") -> None:
        self._release(x)  # before the state turns final: no write may follow a final state
        if why:
            log.warning("NIXL transfer %s failed: %s", tid, why)
        with self._lock:
            x.state = state

    def _load_peer(self, tid: str, x: _Xfer) -> bool:
        try:
            x.peer = load_peer(self._agent, self._peers, x.endpoint, self.block_bytes)
            return True
        except Exception as e:
            self._finish(tid, x, TransferState.FAILED, f"loading the peer: {e!r}")
            return False

    @classmethod
    def _release(cls, x: _Xfer) -> None:
        for w in x.writes:
            cls._release_write(w)

    @staticmethod
    def _release_write(w: _Write) -> None:
        """Free the request; NIXL cancels it if still in flight (when it cannot, it keeps the
        handle and retries at agent teardown)."""
        if w.handle is None:
            return
        handle, w.handle = w.handle, None
        try:
            handle.release()
        except Exception as e:
            log.warning("releasing a NIXL transfer request: %r", e)
