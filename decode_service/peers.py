"""The decode worker's prefill peers: one channel and one handshake per prefill address.

    get(address):  cached? ─yes─▶ peer
                     │no
                     ▼
                   Handshake(our layout + hash, our transport) ──▶ prefill   (one at a time
                     compatible and layouts agree here too → cache and return the peer   per
                     refused → Rejected(FAILED_PRECONDITION, "... block_size: 16 != 8 ...") address:
                     unreachable → Rejected(UNAVAILABLE, ...)                  callers share it)
    forget(peer) drops a cached handshake (the peer went away, answered STALE_HANDSHAKE or
    LAYOUT_MISMATCH), unless a newer one replaced it already.
    load(address) / refresh_load(peer): the peer's latest GetStats (PeerLoad, with its age):
    its step count for the progress watchdog and its queue for the P/D decider; one GetStats
    per peer at a time serves both.

A peer is one prefill *process*: its handshake's kv_epoch (random per process) goes into
every Prefill (another process refuses it: STALE_HANDSHAKE) and comes back with every Abort
answer, so abort() tells an answer of the process that may be writing (STOPPED) from one of
a process that restarted on its address (OTHER_PROCESS: it cannot vouch for the old one).

Restarts: every kv_epoch a peer shows (Handshake, GetStats) is compared with the last one
seen at its address. Another one means the process restarted: the cached handshake is
dropped, a new one starts at once (in the background; the next request finds it done or
joins it), and the watchers (`watch_epochs`: the P/D rates, which restart from their priors)
are told. A Prefill that still went to the old epoch answers STALE_HANDSHAKE having done
nothing, and remote_prefill.py sends it again to the new process.
"""
from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable
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
    (remote prefills' progress watchdog) and its queue (the P/D decider's input), from the
    process `kv_epoch` (0: it did not say)."""

    at: float
    num_steps: int
    num_waiting: int
    num_waiting_tokens: int
    num_running: int
    load: float
    kv_epoch: int = 0
    prefill_tokens_per_s: float = 0.0  # its per-step rate (prefill_rate.py; 0: not measured)


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
        self._handshakes: dict[str, asyncio.Future] = {}  # one handshake per address at once
        self._epochs: dict[str, int] = {}  # the last kv_epoch seen per address
        self._epoch_watchers: list[Callable[[str, int], None]] = []
        self._background: set[asyncio.Future] = set()
        self._closed = False

    async def get(self, address: str) -> PrefillPeer:
        """A handshaken peer. Raises Rejected (FAILED_PRECONDITION or UNAVAILABLE)."""
        peer = self._peers.get(address)
        if peer is not None:
            return peer
        task = self._handshakes.get(address)
        if task is None or task.done():
            task = self._handshakes[address] = asyncio.ensure_future(self._handshake(address))
            task.add_done_callback(_retrieve)
        return await asyncio.shield(task)

    async def _handshake(self, address: str) -> PrefillPeer:
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
        self._seen(address, resp.kv_epoch, handshake=False)
        peer = self._peers[address] = PrefillPeer(address, stub, resp.worker_id, resp.kv_epoch)
        log.info("handshake ok", extra={"peer": address})
        return peer

    def forget(self, peer: PrefillPeer) -> None:
        """Drop `peer`'s handshake (the next get() shakes hands again); a newer one that
        already replaced it stays."""
        if self._peers.get(peer.address) is peer:
            del self._peers[peer.address]

    def watch_epochs(self, callback: Callable[[str, int], None]) -> None:
        """Call `callback(address, kv_epoch)` whenever a peer shows a new process."""
        self._epoch_watchers.append(callback)

    def _seen(self, address: str, kv_epoch: int, handshake: bool = True) -> None:
        """A process of `address` answered as `kv_epoch`: a new one (it restarted) drops
        the old handshake, starts a new one (`handshake`) and tells the watchers."""
        last = self._epochs.get(address)
        if not kv_epoch or kv_epoch == last:
            return
        self._epochs[address] = kv_epoch
        if last is None:
            return
        log.warning("prefill worker restarted (kv_epoch %016x, was %016x): handshaking again",
                    kv_epoch, last, extra={"peer": address})
        peer = self._peers.get(address)
        if peer is not None and peer.kv_epoch != kv_epoch:
            del self._peers[address]
        if handshake and not self._closed:
            self.get_later(address)
        for callback in self._epoch_watchers:
            callback(address, kv_epoch)

    def get_later(self, address: str) -> None:
        """Start a handshake in the background (a failure is only logged: the next get()
        tries again)."""
        async def shake() -> None:
            try:
                await self.get(address)
            except Exception as e:  # noqa: BLE001 - Rejected, or the channel closed meanwhile
                log.info("background handshake failed: %r", e, extra={"peer": address})
        task = asyncio.ensure_future(shake())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

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
        self._seen(peer.address, resp.kv_epoch)
        if resp.kv_epoch != peer.kv_epoch:
            log.warning("prefill Abort answered by another process (kv_epoch %016x, "
                        "handshake %016x): it restarted", resp.kv_epoch, peer.kv_epoch,
                        extra=extra)
            return AbortAnswer.OTHER_PROCESS
        return AbortAnswer.STOPPED

    async def num_steps(self, peer: PrefillPeer, timeout_s: float,
                        max_age_s: float = 0.0) -> int | None:
        """The prefill engine's step count (GetStats), or None when `peer`'s process did
        not answer (another process on its address is no answer: its steps are not the
        peer's progress). One GetStats per peer at a time, and an answer younger than
        `max_age_s` is reused, so many remote prefills waiting on one peer do not each
        poll it."""
        seen = self._loads.get(peer.address)
        if seen is None or time.monotonic() - seen.at > max_age_s:
            seen = await asyncio.shield(self._stats_call(peer, timeout_s))
        if seen is None or (seen.kv_epoch and peer.kv_epoch and seen.kv_epoch != peer.kv_epoch):
            return None
        return seen.num_steps

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
            s.load, s.kv_epoch, s.prefill_tokens_per_s)
        self._seen(peer.address, s.kv_epoch)
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
        self._closed = True
        for task in self._background:
            task.cancel()
        await asyncio.gather(*(c.close(grace=None) for c in self._channels.values()))
        self._channels.clear()
        self._peers.clear()


def _retrieve(task: asyncio.Future) -> None:
    """Mark a shared handshake's failure as seen (every caller may have gone meanwhile)."""
    if not task.cancelled():
        task.exception()
