"""The decode worker's prefill peers: one channel and one handshake per prefill address.

    get(address):  cached? ─yes─▶ peer
                     │no
                     ▼
                   Handshake(our layout + hash, our transport) ──▶ prefill
                     compatible and layouts agree here too → cache and return the peer
                     refused → Rejected(FAILED_PRECONDITION, "... block_size: 16 != 8 ...")
                     unreachable → Rejected(UNAVAILABLE, ...)
    forget(address) drops a cached handshake (the peer restarted or answered LAYOUT_MISMATCH).
    load(address) / refresh_load(peer): the peer's latest GetStats (PeerLoad, with its age):
    its step count for the progress watchdog and its queue for the P/D decider; one GetStats
    per peer at a time serves both.

A peer is one prefill *process*: its handshake's kv_epoch (random per process) goes into
every Prefill (another process refuses it: STALE_HANDSHAKE) and comes back with every Abort
answer, so abort() tells an answer of the process that may be writing (STOPPED) from one of
a process that restarted on its address (OTHER_PROCESS: it cannot vouch for the old one).
"""
from __future__ import annotations

import asyncio
import enum
import logging
import time
from dataclasses import dataclass

import grpc

from baton.grpc_options import CHANNEL_OPTIONS
from baton.worker.process import Rejected
from baton.transfer import TRANSPORT_KINDS, KVLayoutError, check_compatible, kv_layout_hash
from protos import common_pb2, prefill_pb2, prefill_pb2_grpc

log = logging.getLogger(__name__)


@dataclass
class PrefillPeer:
    address: str
    stub: prefill_pb2_grpc.PrefillServiceStub
    worker_id: str
    kv_epoch: int = 0  # the process that shook hands (0: it did not say)


@dataclass(frozen=True)
class PeerLoad:
    """The latest GetStats answer of a peer (time.monotonic() `at`): its engine's step count
    (remote prefills' progress watchdog) and its queue (the P/D decider's input)."""

    at: float
    num_steps: int
    num_waiting: int
    num_waiting_tokens: int
    num_running: int
    load: float


class AbortAnswer(enum.Enum):
    STOPPED = enum.auto()        # the peer's process answered: none of its transfers writes
    UNANSWERED = enum.auto()     # no answer in time (busy, paused, unreachable): ask again
    OTHER_PROCESS = enum.auto()  # a restarted process answered: proves nothing of the old


class PrefillPeers:
    def __init__(self, layout: common_pb2.KVLayout, transport: str, worker_id: str,
                 handshake_timeout_s: float, call_timeout_s: float) -> None:
        self.layout, self.worker_id = layout, worker_id
        self.layout_hash = kv_layout_hash(layout)
        self.transport = TRANSPORT_KINDS[transport]
        self.handshake_timeout_s, self.call_timeout_s = handshake_timeout_s, call_timeout_s
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._peers: dict[str, PrefillPeer] = {}
        self._loads: dict[str, PeerLoad] = {}
        self._stats_calls: dict[str, asyncio.Future] = {}

    async def get(self, address: str) -> PrefillPeer:
        """A handshaken peer. Raises Rejected (FAILED_PRECONDITION or UNAVAILABLE)."""
        peer = self._peers.get(address)
        if peer is not None:
            return peer
        stub = prefill_pb2_grpc.PrefillServiceStub(self._channel(address))
        hello = prefill_pb2.HandshakeRequest(kv_layout=self.layout, layout_hash=self.layout_hash,
                                             worker_id=self.worker_id,
                                             transports=[self.transport])
        try:
            resp = await stub.Handshake(hello, timeout=self.handshake_timeout_s)
        except grpc.aio.AioRpcError as e:
            raise Rejected(grpc.StatusCode.UNAVAILABLE, f"prefill worker {address} did not "
                           f"answer the handshake: {e.code().name} {e.details()}") from None
        error = resp.error if not resp.compatible else ""
        if not error:
            try:
                check_compatible(self.layout, resp.kv_layout)
            except KVLayoutError as e:
                error = f"{e} [decode {self.worker_id} != prefill {address}]"
        if error:
            raise Rejected(grpc.StatusCode.FAILED_PRECONDITION,
                           f"prefill worker {address} is incompatible: {error}")
        peer = self._peers[address] = PrefillPeer(address, stub, resp.worker_id, resp.kv_epoch)
        log.info("handshake ok", extra={"peer": address})
        return peer

    def forget(self, address: str) -> None:
        self._peers.pop(address, None)

    async def abort(self, peer: PrefillPeer, request_id: str,
                    again: bool = False) -> AbortAnswer:
        """Abort on the prefill worker. STOPPED once the peer's process answered (found or
        not, none of its transfers for the request can still be writing, and it refuses a
        late Prefill of the id: prefill_service/worker.py). `again`: a re-sent Abort, whose
        failure is only logged at debug level (the first one's was a warning)."""
        extra = {"request_id": request_id, "peer": peer.address}
        try:
            resp = await peer.stub.Abort(common_pb2.AbortRequest(request_id=request_id),
                                         timeout=self.call_timeout_s)
        except grpc.aio.AioRpcError as e:
            log.log(logging.DEBUG if again else logging.WARNING, "prefill Abort failed: %s",
                    e.code().name, extra=extra)
            return AbortAnswer.UNANSWERED
        if resp.kv_epoch != peer.kv_epoch:
            log.warning("prefill Abort answered by another process (kv_epoch %016x, "
                        "handshake %016x): it restarted", resp.kv_epoch, peer.kv_epoch,
                        extra=extra)
            return AbortAnswer.OTHER_PROCESS
        return AbortAnswer.STOPPED

    async def num_steps(self, peer: PrefillPeer, timeout_s: float,
                        max_age_s: float = 0.0) -> int | None:
        """The prefill engine's step count (GetStats), or None when it did not answer.
        One GetStats per peer at a time, and an answer younger than `max_age_s` is reused, so
        many remote prefills waiting on one peer do not each poll it."""
        seen = self._loads.get(peer.address)
        if seen is not None and time.monotonic() - seen.at <= max_age_s:
            return seen.num_steps
        load = await asyncio.shield(self._stats_call(peer, timeout_s))
        return None if load is None else load.num_steps

    def load(self, address: str) -> PeerLoad | None:
        """The peer's latest answered GetStats (any age; None before the first answer)."""
        return self._loads.get(address)

    def refresh_load(self, peer: PrefillPeer, timeout_s: float) -> None:
        """Ask for a fresh GetStats in the background (joins one already on its way)."""
        self._stats_call(peer, timeout_s)

    def _stats_call(self, peer: PrefillPeer, timeout_s: float) -> asyncio.Future:
        task = self._stats_calls.get(peer.address)
        if task is None or task.done():
            task = self._stats_calls[peer.address] = asyncio.ensure_future(
                self._fetch_stats(peer, timeout_s))
        return task

    async def _fetch_stats(self, peer: PrefillPeer, timeout_s: float) -> PeerLoad | None:
        try:
            s = await peer.stub.GetStats(common_pb2.GetStatsRequest(), timeout=timeout_s)
        except Exception:  # noqa: BLE001 - any failure is "no answer" (a closed channel too)
            return None
        load = self._loads[peer.address] = PeerLoad(
            time.monotonic(), s.num_steps, s.num_waiting, s.num_waiting_tokens, s.num_running,
            s.load)
        return load

    async def release(self, peer: PrefillPeer, request_id: str) -> bool:
        """ReleaseBlocks; False when the lease had already ended (or the call failed)."""
        try:
            resp = await peer.stub.ReleaseBlocks(
                prefill_pb2.ReleaseBlocksRequest(request_id=request_id),
                timeout=self.call_timeout_s)
            return resp.released
        except grpc.aio.AioRpcError as e:
            log.info("ReleaseBlocks failed: %s", e.code().name,
                     extra={"request_id": request_id, "peer": peer.address})
            return False

    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        return self._channels[address]

    async def close(self) -> None:
        await asyncio.gather(*(c.close(grace=None) for c in self._channels.values()))
        self._channels.clear()
        self._peers.clear()
