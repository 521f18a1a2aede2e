"""NIXL transport, prefill side: `NixlSender` (see nixl.py for the whole picture: the
hand-over, the progress threads and how errors end a send)."""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from baton.transfer.base import KVSender, TransferState
from baton.transfer.nixl import (
    INLINE_BYTES,
    NOTIF_PREFIX,
    block_descs,
    make_agent,
    memory_of,
    Poller,
)
from protos import common_pb2, transfer_pb2

log = logging.getLogger(__name__)


@dataclass
class _Peer:
    """A loaded remote agent and its prepared per-block descriptor list."""

    key: tuple  # everything in the endpoint that the descriptors depend on
    name: bytes
    dlist: object
    healthy: bool = True


@dataclass
class _Xfer:
    endpoint: transfer_pb2.TransferEndpoint
    src: list[int]
    dst: list[int]
    deadline: float
    state: TransferState = TransferState.PENDING  # PENDING = not posted yet
    handle: object | None = None
    peer: _Peer | None = field(default=None, repr=False)  # keeps the remote dlist alive


class NixlSender(KVSender):
    """Prefill side; `name` is the NIXL agent name (unique; generated when None).

    Locks: self._lock guards the Python state (held briefly); self._agent_lock serializes
    every NIXL call (held across a post, i.e. a whole copy); callers only try to take it.
    """

    transport = "nixl"

    def __init__(self, kv_cache: torch.Tensor, layout: common_pb2.KVLayout, name: str | None = None) -> None:
        super().__init__(kv_cache, layout)
        self._agent = make_agent("send", name)
        self._registration = self._agent.register_memory(kv_cache)
        mem, device_id = memory_of(kv_cache)
        descs = block_descs(kv_cache.data_ptr(), self.block_bytes, self.num_blocks, device_id)
        self._local = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", descs, mem)
        self._peers: dict[str, _Peer] = {}  # progress thread only
        self._xfers: dict[str, _Xfer] = {}
        self._orphans: list[_Xfer] = []  # forgotten while live: cancelled by the progress thread
        self._closed = False
        self._agent_lock = threading.Lock()
        self._poller = Poller(self._tick, f"{self._agent.name}-progress")

    def _start(self, endpoint, transfer_id, src, dst, request_id, deadline) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("NixlSender is closed")
            if transfer_id in self._xfers:
                raise ValueError(f"transfer {transfer_id!r} is already live")
            x = self._xfers[transfer_id] = _Xfer(endpoint, src, dst, deadline)
            if not src:
                x.state = TransferState.DONE
        if len(src) * self.block_bytes <= INLINE_BYTES and self._agent_lock.acquire(blocking=False):
            try:
                if x.state == TransferState.PENDING:
                    self._post(transfer_id, x)
            finally:
                self._agent_lock.release()
        self._poller.wake()

    def poll(self, transfer_id: str) -> TransferState:
        with self._lock:
            x = self._xfers[transfer_id]
        if x.state == TransferState.IN_PROGRESS and self._agent_lock.acquire(blocking=False):
            try:
                if x.state == TransferState.IN_PROGRESS and self._agent is not None:
                    self._check(transfer_id, x)
            finally:
                self._agent_lock.release()
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

    def _shutdown(self) -> None:
        for x in [*self._xfers.values(), *self._orphans]:
            self._release(x)
            if not x.state.finished:
                x.state = TransferState.CANCELLED
        for peer in self._peers.values():
            self._drop(peer)
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
                if x.state == TransferState.PENDING:
                    self._post(tid, x)
                elif not x.state.finished:
                    self._check(tid, x)
            with self._lock:
                self._orphans = [x for x in self._orphans if not x.state.finished]
            return bool(live)

    def _post(self, tid: str, x: _Xfer) -> None:
        status = "PROC"  # past its deadline already: _update fails it
        if time.monotonic() <= x.deadline:
            try:
                x.peer = self._peer(x.endpoint)
                x.handle = self._agent.make_prepped_xfer(
                    "WRITE", self._local, x.src, x.peer.dlist, x.dst, NOTIF_PREFIX + tid.encode())
                status = self._agent.transfer(x.handle)  # between local processes: the whole copy
            except Exception as e:  # NIXL raises one class per status code, all plain Exceptions
                status = repr(e)
        self._update(tid, x, status)

    def _check(self, tid: str, x: _Xfer) -> None:
        try:
            status = self._agent.check_xfer_state(x.handle)
        except Exception as e:
            status = repr(e)
        self._update(tid, x, status)

    def _update(self, tid: str, x: _Xfer, status: str) -> None:
        if status == "DONE":
            self._finish(tid, x, TransferState.DONE)
        elif status != "PROC":
            if x.peer is not None:
                x.peer.healthy = False
            self._finish(tid, x, TransferState.FAILED, f"transfer error {status}")
        elif time.monotonic() > x.deadline:
            self._finish(tid, x, TransferState.FAILED, "timed out or forgotten in flight")
        else:
            with self._lock:
                x.state = TransferState.IN_PROGRESS

    def _finish(self, tid: str, x: _Xfer, state: TransferState, why: str = "") -> None:
        self._release(x)  # before the state turns final: no write may follow a final state
        if why:
            log.warning("NIXL transfer %s failed: %s", tid, why)
        with self._lock:
            x.state = state

    def _peer(self, endpoint: transfer_pb2.TransferEndpoint) -> _Peer:
        ep = endpoint.nixl
        key = (ep.agent_metadata, ep.base_address, ep.memory_kind, ep.device_id, endpoint.num_blocks)
        peer = self._peers.get(ep.agent_name)
        if peer is not None and peer.key == key and peer.healthy:
            return peer
        if peer is not None:  # receiver restarted or failed: NIXL refuses to reload a live name
            del self._peers[ep.agent_name]
            self._drop(peer)
        name = self._agent.add_remote_agent(ep.agent_metadata)
        mem = "VRAM" if ep.memory_kind == transfer_pb2.MEMORY_KIND_VRAM else "DRAM"
        descs = block_descs(ep.base_address, self.block_bytes, endpoint.num_blocks, ep.device_id)
        peer = _Peer(key, name, self._agent.prep_xfer_dlist(name, descs, mem))
        self._peers[ep.agent_name] = peer
        return peer

    def _drop(self, peer: _Peer) -> None:
        try:
            peer.dlist.release()
            self._agent.remove_remote_agent(peer.name)
        except Exception as e:
            log.debug("removing NIXL peer %r: %r", peer.name, e)

    @staticmethod
    def _release(x: _Xfer) -> None:
        """Free the transfer request; NIXL cancels it if still in flight (when it cannot, it
        keeps the handle and retries at agent teardown)."""
        if x.handle is None:
            return
        handle, x.handle = x.handle, None
        try:
            handle.release()
        except Exception as e:
            log.warning("releasing a NIXL transfer request: %r", e)
