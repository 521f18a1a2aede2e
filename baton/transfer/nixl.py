"""NIXL transport: one-sided UCX WRITEs from the prefill kv_cache straight into the decode one.

    decode (NixlReceiver)                        prefill (NixlSender)
    agent registers the whole kv_cache           agent registers its whole kv_cache and
    endpoint() = agent metadata + base address   prepares one local descriptor per block
                 ─────── TransferEndpoint (in PrefillRequest) ───────▶
                                                 per peer, once: add_remote_agent(metadata),
                                                 prepare one remote descriptor per block
                                                 send(): make_prepped_xfer(WRITE, src idx,
                 ◀══════ block bytes ════════    dst idx, notif) + transfer()
    poll(): notification "baton-kv:<tid>"  ◀──── NIXL sends it after the data is written

NIXL merges runs of adjacent blocks (on both sides) into one descriptor. Between processes of
one host UCX moves a WRITE with CMA (process_vm_writev) inside the posting call itself, so a
256 MiB post takes tens of milliseconds (with the GIL released).

Threads: NIXL's own progress thread is off (nixl 1.5.1 runs it without pause: about half a
core even when idle, which slows everything else on a small CPU machine). Each side has one
daemon thread instead that drives NIXL every _TICK_S seconds while it has live transfers and
sleeps on an event otherwise. The callers' threads drive NIXL too, without ever waiting for
a copy: send() posts a small transfer itself (up to _INLINE_BYTES, about a millisecond of
copying) and leaves larger ones to the thread; poll() checks the transfer itself when the
agent is free. (A background Python thread alone would add milliseconds per transfer
whenever the caller's thread keeps the GIL busy.) The receiver's poll() collects
notifications itself as well.

Errors (peer gone, UCX failure, deadline) end a send FAILED, and only after its NIXL request
was released (NIXL cancels what is still in flight): a FAILED send does not keep writing.
A peer that failed is reloaded on the next send.
"""
from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from baton.transfer.base import KVReceiver, KVSender, TransferState
from protos import common_pb2, transfer_pb2

log = logging.getLogger(__name__)

_NOTIF_PREFIX = b"baton-kv:"
_TICK_S = 5e-4  # progress period while transfers are live (about 6% of a core)
_INLINE_BYTES = 4 << 20  # send() posts transfers up to this size in the caller's thread


def _make_agent(role: str, name: str | None):
    from nixl._api import nixl_agent, nixl_agent_config  # heavy: only when NIXL is used

    name = name or f"baton-{role}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    return nixl_agent(name, nixl_agent_config(backends=["UCX"], enable_prog_thread=False))


class _Poller:
    """Calls tick() every _TICK_S on a daemon thread while it returns True (work is live);
    otherwise sleeps until wake()."""

    def __init__(self, tick: Callable[[], bool], name: str) -> None:
        self._tick, self._wake, self._stopped = tick, threading.Event(), False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        """Stop and join (a copy in progress finishes first)."""
        self._stopped = True
        self._wake.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stopped:
            self._wake.clear()  # before tick: a wake() during tick is not lost
            try:
                live = self._tick()
            except Exception:  # a bug must not silently stop all progress
                log.exception("NIXL progress tick failed")
                live = True
            if live:
                time.sleep(_TICK_S)
            else:
                self._wake.wait()


def _memory_of(kv_cache: torch.Tensor) -> tuple[str, int]:
    """NIXL memory type and device id of a tensor."""
    return ("VRAM", kv_cache.device.index or 0) if kv_cache.is_cuda else ("DRAM", 0)


def _block_descs(base: int, block_bytes: int, num_blocks: int, device_id: int) -> np.ndarray:
    """[num_blocks, 3] rows (address, length, device id): descriptor i is block i."""
    descs = np.empty((num_blocks, 3), dtype=np.uint64)
    descs[:, 0] = base + np.arange(num_blocks, dtype=np.uint64) * np.uint64(block_bytes)
    descs[:, 1] = block_bytes
    descs[:, 2] = device_id
    return descs


class NixlReceiver(KVReceiver):
    """Decode side; `name` is the NIXL agent name (unique; generated when None)."""

    refuses_late_writes = False  # one-sided writes land whatever this side forgot

    def __init__(self, kv_cache: torch.Tensor, layout: common_pb2.KVLayout, name: str | None = None) -> None:
        super().__init__(kv_cache, layout)
        self._agent = _make_agent("recv", name)
        self._registration = self._agent.register_memory(kv_cache)
        mem, device_id = _memory_of(kv_cache)
        self._nixl_endpoint = transfer_pb2.NixlEndpoint(
            agent_name=self._agent.name,
            agent_metadata=self._agent.get_agent_metadata(),  # after registration: carries the keys
            base_address=kv_cache.data_ptr(), device_id=device_id,
            memory_kind=transfer_pb2.MEMORY_KIND_VRAM if mem == "VRAM" else transfer_pb2.MEMORY_KIND_DRAM)
        self._poller = _Poller(self._tick, f"{self._agent.name}-progress")

    def endpoint(self) -> transfer_pb2.TransferEndpoint:
        return self._endpoint(nixl=self._nixl_endpoint)

    def expect(self, transfer_id: str, dst_block_ids: Sequence[int], timeout_s: float | None = None) -> None:
        super().expect(transfer_id, dst_block_ids, timeout_s)
        self._poller.wake()

    def _tick(self) -> bool:
        with self._lock:
            self._progress()
            now = time.monotonic()
            return self._agent is not None and any(
                not t.state.finished and now <= t.deadline for t in self._transfers.values())

    def _progress(self) -> None:
        if self._agent is None:
            return
        for messages in self._agent.get_new_notifs().values():
            for msg in messages:
                if not msg.startswith(_NOTIF_PREFIX):
                    continue
                t = self._transfers.get(msg[len(_NOTIF_PREFIX):].decode())
                if t is not None and not t.state.finished:  # unknown = forgotten: ignore
                    t.state = TransferState.DONE

    def close(self) -> None:
        self._poller.stop()
        with self._lock:
            if self._agent is None:
                return
            self._agent.deregister_memory(self._registration)
            self._agent = None  # the agent's destructor releases UCX


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
        self._agent = _make_agent("send", name)
        self._registration = self._agent.register_memory(kv_cache)
        mem, device_id = _memory_of(kv_cache)
        descs = _block_descs(kv_cache.data_ptr(), self.block_bytes, self.num_blocks, device_id)
        self._local = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", descs, mem)
        self._peers: dict[str, _Peer] = {}  # progress thread only
        self._xfers: dict[str, _Xfer] = {}
        self._orphans: list[_Xfer] = []  # forgotten while live: cancelled by the progress thread
        self._closed = False
        self._agent_lock = threading.Lock()
        self._poller = _Poller(self._tick, f"{self._agent.name}-progress")

    def _start(self, endpoint, transfer_id, src, dst, request_id, deadline) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("NixlSender is closed")
            if transfer_id in self._xfers:
                raise ValueError(f"transfer {transfer_id!r} is already live")
            x = self._xfers[transfer_id] = _Xfer(endpoint, src, dst, deadline)
            if not src:
                x.state = TransferState.DONE
        if len(src) * self.block_bytes <= _INLINE_BYTES and self._agent_lock.acquire(blocking=False):
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
                    "WRITE", self._local, x.src, x.peer.dlist, x.dst, _NOTIF_PREFIX + tid.encode())
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
        descs = _block_descs(ep.base_address, self.block_bytes, endpoint.num_blocks, ep.device_id)
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
