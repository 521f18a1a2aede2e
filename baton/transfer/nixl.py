"""NIXL transport: one-sided UCX WRITEs from the prefill kv_cache straight into the decode one.
This file: the shared agent helpers and `NixlReceiver`; `NixlSender` is in nixl_sender.py.

    decode (NixlReceiver)                        prefill (NixlSender)
    agent registers the whole kv_cache           agent registers its whole kv_cache and
    endpoint() = agent metadata + base address   prepares one local descriptor per block
                 ─────── TransferEndpoint (in PrefillRequest) ───────▶
                                                 per peer, once: add_remote_agent(metadata),
                                                 prepare one remote descriptor per block
                                                 send(): make_prepped_xfer(WRITE, src idx,
                 ◀══════ block bytes ════════    dst idx, notif) + transfer()
                                                 streamed (begin/push): one WRITE per push,
                 ◀══════ block bytes ════════    no notif; the last push's WRITE carries it,
                                                 posted once every earlier one completed
    poll(): notification "baton-kv:<tid>"  ◀──── NIXL sends it after the data is written

NIXL merges runs of adjacent blocks (on both sides) into one descriptor. Between processes of
one host UCX moves a WRITE with CMA (process_vm_writev) inside the posting call itself, so a
256 MiB post takes tens of milliseconds (with the GIL released).

Threads: NIXL's own progress thread is off (nixl 1.5.1 runs it without pause: about half a
core even when idle, which slows everything else on a small CPU machine). Each side has one
daemon thread instead that drives NIXL every TICK_S seconds while it has live transfers and
sleeps on an event otherwise. The callers' threads drive NIXL too, without ever waiting for
a copy: send() and push() post a small write themselves (up to INLINE_BYTES, about a
millisecond of copying) and leave larger ones to the thread; poll() checks the transfer
itself when the agent is free. (A background Python thread alone would add milliseconds per transfer
whenever the caller's thread keeps the GIL busy.) The receiver's poll() collects
notifications itself as well.

Errors (peer gone, UCX failure, deadline) end a transfer FAILED, and cancel() CANCELLED, only
after every NIXL request of it was released (NIXL cancels what is still in flight): a
transfer in a final state does not keep writing. A peer that failed is reloaded on the next
transfer. The receiver needs nothing for streams: it sees one notification per transfer.
"""
from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from baton.transfer.base import KVReceiver, TransferState
from protos import common_pb2, transfer_pb2

log = logging.getLogger(__name__)

NOTIF_PREFIX = b"baton-kv:"
TICK_S = 5e-4  # progress period while transfers are live (about 6% of a core)
INLINE_BYTES = 4 << 20  # send() posts transfers up to this size in the caller's thread


def ucx_env_without_rdma(environ=os.environ, sysfs: str = "/sys/class/infiniband") -> None:
    """Keep UCX from loading its InfiniBand modules on a host with no RDMA device (sets
    `UCX_MODULES=^ib` unless the caller set UCX_MODULES).

    Why: the nixl wheels bundle their own libibverbs and libnl. Where the system has
    libibverbs1 too (Mooncake Store needs it), UCX's ib module loads both copies of libnl
    into one process, and libnl-route's exit-time destructor then segfaults
    (`rtnl_tc_unregister`): every process that made a NIXL agent exits with 139. With no
    RDMA device the ib transports have nothing to drive anyway; with one, nothing changes."""
    if "UCX_MODULES" in environ:
        return
    try:
        has_rdma = bool(os.listdir(sysfs))
    except OSError:
        has_rdma = False
    if not has_rdma:
        environ["UCX_MODULES"] = "^ib"


def make_agent(role: str, name: str | None):
    """A NIXL agent with the UCX backend and no progress thread (see the module docstring)."""
    ucx_env_without_rdma()  # before UCX initialises: it reads its environment once
    from nixl._api import nixl_agent, nixl_agent_config  # heavy: only when NIXL is used

    name = name or f"baton-{role}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    return nixl_agent(name, nixl_agent_config(backends=["UCX"], enable_prog_thread=False))


class Poller:
    """Calls tick() every TICK_S on a daemon thread while it returns True (work is live);
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
                time.sleep(TICK_S)
            else:
                self._wake.wait()


def memory_of(kv_cache: torch.Tensor) -> tuple[str, int]:
    """NIXL memory type and device id of a tensor."""
    return ("VRAM", kv_cache.device.index or 0) if kv_cache.is_cuda else ("DRAM", 0)


def block_descs(base: int, block_bytes: int, num_blocks: int, device_id: int) -> np.ndarray:
    """[num_blocks, 3] rows (address, length, device id): descriptor i is block i."""
    descs = np.empty((num_blocks, 3), dtype=np.uint64)
    descs[:, 0] = base + np.arange(num_blocks, dtype=np.uint64) * np.uint64(block_bytes)
    descs[:, 1] = block_bytes
    descs[:, 2] = device_id
    return descs


@dataclass
class Peer:
    """A loaded remote agent and its prepared per-block descriptor list (sender side)."""

    key: tuple  # everything in the endpoint that the descriptors depend on
    name: bytes
    dlist: object
    healthy: bool = True


def load_peer(agent, peers: dict[str, Peer], endpoint: transfer_pb2.TransferEndpoint,
              block_bytes: int) -> Peer:
    """The receiver of `endpoint` from the cache `peers` (by agent name), loaded into
    `agent` (add_remote_agent + one remote descriptor per block) when absent, changed or
    failed. Raises what NIXL raises."""
    ep = endpoint.nixl
    key = (ep.agent_metadata, ep.base_address, ep.memory_kind, ep.device_id, endpoint.num_blocks)
    peer = peers.get(ep.agent_name)
    if peer is not None and peer.key == key and peer.healthy:
        return peer
    if peer is not None:  # receiver restarted or failed: NIXL refuses to reload a live name
        del peers[ep.agent_name]
        drop_peer(agent, peer)
    name = agent.add_remote_agent(ep.agent_metadata)
    mem = "VRAM" if ep.memory_kind == transfer_pb2.MEMORY_KIND_VRAM else "DRAM"
    descs = block_descs(ep.base_address, block_bytes, endpoint.num_blocks, ep.device_id)
    peer = peers[ep.agent_name] = Peer(key, name, agent.prep_xfer_dlist(name, descs, mem))
    return peer


def drop_peer(agent, peer: Peer) -> None:
    """Release a peer's descriptors and unload its agent (errors logged)."""
    try:
        peer.dlist.release()
        agent.remove_remote_agent(peer.name)
    except Exception as e:
        log.debug("removing NIXL peer %r: %r", peer.name, e)


class NixlReceiver(KVReceiver):
    """Decode side; `name` is the NIXL agent name (unique; generated when None)."""

    refuses_late_writes = False  # one-sided writes land whatever this side forgot

    def __init__(self, kv_cache: torch.Tensor, layout: common_pb2.KVLayout, name: str | None = None) -> None:
        super().__init__(kv_cache, layout)
        self._agent = make_agent("recv", name)
        self._registration = self._agent.register_memory(kv_cache)
        mem, device_id = memory_of(kv_cache)
        self._nixl_endpoint = transfer_pb2.NixlEndpoint(
            agent_name=self._agent.name,
            agent_metadata=self._agent.get_agent_metadata(),  # after registration: carries the keys
            base_address=kv_cache.data_ptr(), device_id=device_id,
            memory_kind=transfer_pb2.MEMORY_KIND_VRAM if mem == "VRAM" else transfer_pb2.MEMORY_KIND_DRAM)
        self._poller = Poller(self._tick, f"{self._agent.name}-progress")

    def endpoint(self) -> transfer_pb2.TransferEndpoint:
        return self._endpoint(nixl=self._nixl_endpoint)

    def expect(self, transfer_id: str, dst_block_ids: Sequence[int], timeout_s: float | None = None,
               src_block_ids: Sequence[int] = ()) -> None:
        super().expect(transfer_id, dst_block_ids, timeout_s, src_block_ids)
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
                if not msg.startswith(NOTIF_PREFIX):
                    continue
                t = self._transfers.get(msg[len(NOTIF_PREFIX):].decode())
                if t is not None and not t.state.finished:  # unknown = forgotten: ignore
                    t.state = TransferState.DONE

    def close(self) -> None:
        self._poller.stop()
        with self._lock:
            if self._agent is None:
                return
            self._agent.deregister_memory(self._registration)
            self._agent = None  # the agent's destructor releases UCX
