"""One remote prefill, decode side: from allocated blocks to "the KV is all here" (or not).

    plan, _ = RemoteKV.add(...)               blocks allocated, WAITING_FOR_REMOTE_KV
    RemotePrefill(plan).run():
      1. receiver.expect(transfer_id, plan.dst_block_ids, src_block_ids=plan.src_block_ids)
      2. Prefill(prompt, num_cached_on_decode, src_block_ids, dst_block_ids, endpoint)
         ─▶ prefill worker (it reads the src blocks it lacks instead of computing them);
         answered STALE_HANDSHAKE (a restarted process on the address: it did nothing), it
         is sent once more, to that process, as soon as it answered a new handshake;
         raced against the request's abort event and a progress watchdog: it is given up
         when the prefill worker's engine runs no step (GetStats `num_steps`) for
         prefill_timeout_seconds, however long its queue; prefill_max_seconds caps the call
      3. OK → poll the receiver until DONE (≤ kv_wait_seconds): every block has landed
      4. always: receiver.forget(transfer_id)
    → RemoteResult(outcome, error, response, deadline, arrival_seconds, peer)

    outcome                   the prefill worker ...                 a late write may land
    OK                        answered OK, the receiver saw DONE     no
    REJECTED                  refused the arguments before any work  no
    FAILED                    failed, timed out or went away         no
    FAILED_WRITES_MAY_LAND    ... and never confirmed it stopped     yes (NIXL only)
    ABORTED                   was stopped by the request's abort     no
    ABORTED_WRITES_MAY_LAND   ... and never answered the Abort       yes (NIXL only)

"May land" answers the one question the caller must ask before touching the blocks: can a
transfer still be writing into them? No once the prefill worker answered the Prefill or an
Abort (it answers only once its transfer stopped; an Abort answer counts only from the
process that shook hands, peers.py), or when the receiver refuses late writes
after forget() (`KVReceiver.refuses_late_writes`: the gRPC and in-process transports). Yes
only for one-sided writes (NIXL) when the prefill worker went silent: the caller then has the
engine hold the blocks (quarantine.py) until a re-sent Abort is answered, at the latest
until the prefill deadline (+ grace) has passed.
Never decode from partial KV: only OK (prefill said OK *and* the receiver saw every block)
lets the sequence run on transferred blocks.
"""
from __future__ import annotations

import asyncio
import enum
import logging
import time
import uuid
from dataclasses import dataclass

import grpc

from baton.engine.remote_kv import RemotePrefillPlan
from baton.session_hints import SessionHint, hint_fields
from baton.transfer import KVReceiver, TransferState
from baton.worker.process import Rejected
from decode_service.config import DecodeConfig
from decode_service.peers import AbortAnswer, PrefillPeer, PrefillPeers
from protos import common_pb2, prefill_pb2

log = logging.getLogger(__name__)
_STATUS = prefill_pb2.PrefillStatus


class RemoteOutcome(enum.Enum):
    """How one remote prefill ended (see the table in the module docstring)."""

    OK = enum.auto()
    REJECTED = enum.auto()
    FAILED = enum.auto()
    FAILED_WRITES_MAY_LAND = enum.auto()
    ABORTED = enum.auto()
    ABORTED_WRITES_MAY_LAND = enum.auto()

    @classmethod
    def failure(cls, *, aborted: bool, writes_may_land: bool) -> RemoteOutcome:
        if aborted:
            return cls.ABORTED_WRITES_MAY_LAND if writes_may_land else cls.ABORTED
        return cls.FAILED_WRITES_MAY_LAND if writes_may_land else cls.FAILED

    @property
    def writes_may_land(self) -> bool:
        """A transfer may still write into the plan's blocks: hold them, never reuse them."""
        return self in (RemoteOutcome.FAILED_WRITES_MAY_LAND,
                        RemoteOutcome.ABORTED_WRITES_MAY_LAND)

    @property
    def aborted(self) -> bool:
        return self in (RemoteOutcome.ABORTED, RemoteOutcome.ABORTED_WRITES_MAY_LAND)


@dataclass
class RemoteResult:
    """response: the prefill worker's answer, if any (with OK: the first token). deadline:
    when the prefill worker promised to have stopped (time.monotonic()); arrival_seconds:
    receiver wait after OK; peer: the process the last Prefill went to (a restarted one
    after STALE_HANDSHAKE), the one to release, abort or wait for."""

    outcome: RemoteOutcome
    error: str = ""
    response: prefill_pb2.PrefillResponse | None = None
    deadline: float = 0.0
    arrival_seconds: float = 0.0
    peer: PrefillPeer | None = None

    @property
    def ok(self) -> bool:
        return self.outcome is RemoteOutcome.OK


class RemotePrefill:
    def __init__(self, config: DecodeConfig, receiver: KVReceiver, peers: PrefillPeers,
                 peer: PrefillPeer, plan: RemotePrefillPlan, prompt: list[int],
                 params: common_pb2.SamplingParams, aborted: asyncio.Event,
                 session: SessionHint | None = None) -> None:
        self.config, self.receiver, self.peers, self.peer = config, receiver, peers, peer
        self.session = session
        self.plan, self.prompt, self.params, self.aborted = plan, prompt, params, aborted
        self.rid = plan.request_id
        self.transfer_id = f"{self.rid}@{uuid.uuid4().hex[:12]}"

    async def run(self) -> RemoteResult:
        """Never raises for prefill-side trouble; the result says what happened."""
        cfg, plan = self.config, self.plan
        timeout = cfg.prefill_max_seconds
        src = plan.src_block_ids if cfg.kv_pull else []
        self.receiver.expect(self.transfer_id, plan.dst_block_ids,
                             timeout_s=timeout + cfg.kv_wait_seconds, src_block_ids=src)
        request = prefill_pb2.PrefillRequest(
            request_id=self.rid, prompt_token_ids=self.prompt, sampling_params=self.params,
            num_cached_on_decode=plan.num_cached_tokens, dst_block_ids=plan.dst_block_ids,
            src_block_ids=src,
            transfer_id=self.transfer_id, endpoint=self.receiver.endpoint(),
            timeout_seconds=timeout, kv_epoch=self.peer.kv_epoch, **hint_fields(self.session))
        self.deadline = time.monotonic() + timeout
        try:
            result = await self._send(request)
            if result.ok:
                result = await self._await_arrival(result)
        finally:
            self.receiver.forget(self.transfer_id)
        result.deadline, result.peer = self.deadline, self.peer
        if not result.ok:
            log.warning("remote prefill failed: %s", result.error,
                        extra={"request_id": self.rid, "peer": self.peer.address,
                               "outcome": result.outcome.name})
        return result

    def _failed(self, error: str, *, stopped: bool, aborted: bool = False,
                response: prefill_pb2.PrefillResponse | None = None) -> RemoteResult:
        """stopped: the prefill worker confirmed that none of its transfers for the request
        still writes. Otherwise a write may still land unless the receiver refuses it once
        run() has forgotten the transfer (it does before returning)."""
        may_land = not stopped and not self.receiver.refuses_late_writes
        return RemoteResult(RemoteOutcome.failure(aborted=aborted, writes_may_land=may_land),
                            error, response)

    async def _send(self, request: prefill_pb2.PrefillRequest) -> RemoteResult:
        """The Prefill call; one a restarted process refused (STALE_HANDSHAKE: it did
        nothing, so no block was read or written) goes again, once, to that process as soon
        as it answered a handshake."""
        result = await self._call(request)
        resp = result.response
        if resp is None or resp.status != _STATUS.PREFILL_STATUS_STALE_HANDSHAKE or \
                self.aborted.is_set():
            return result
        try:
            self.peer = await self.peers.get(self.peer.address)
        except Rejected as e:
            log.info("no new handshake with the restarted prefill worker: %s", e.details,
                     extra={"request_id": self.rid, "peer": self.peer.address})
            return result
        log.info("prefill worker restarted: Prefill sent again to its new process",
                 extra={"request_id": self.rid, "peer": self.peer.address})
        request.kv_epoch = self.peer.kv_epoch
        self.deadline = time.monotonic() + self.config.prefill_max_seconds
        return await self._call(request)

    async def _call(self, request: prefill_pb2.PrefillRequest) -> RemoteResult:
        call = self.peer.stub.Prefill(request, timeout=self.config.prefill_max_seconds)
        reply = asyncio.ensure_future(_await(call))
        stop = asyncio.ensure_future(self.aborted.wait())
        stalled = asyncio.ensure_future(self._stalled())
        try:
            await asyncio.wait({reply, stop, stalled}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            stalled.cancel()
        if not reply.done():  # aborted or stalled: stop the call, make sure nothing writes
            call.cancel()
            reply.cancel()
            confirmed = await self._abort()
            if stalled.done() and not stalled.cancelled() and not self.aborted.is_set():
                self.peers.forget(self.peer)  # re-handshake: it may have restarted
                return self._failed("Prefill call failed: DEADLINE_EXCEEDED the prefill "
                                    f"worker ran no step for "
                                    f"{self.config.prefill_timeout_seconds:g} s",
                                    stopped=confirmed)
            return self._failed("aborted while waiting for remote KV", stopped=confirmed,
                                aborted=True)
        try:
            resp = reply.result()
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as e:
            return await self._rpc_failed(e)
        if resp.status != _STATUS.PREFILL_STATUS_OK:
            if resp.status in (_STATUS.PREFILL_STATUS_LAYOUT_MISMATCH,
                               _STATUS.PREFILL_STATUS_STALE_HANDSHAKE):
                self.peers.forget(self.peer)
            return self._failed(f"prefill worker answered {_STATUS.Name(resp.status)}: "
                                f"{resp.error}", stopped=True, response=resp)
        return RemoteResult(RemoteOutcome.OK, response=resp)

    async def _abort(self) -> bool:
        """True once the process that took the Prefill confirmed that nothing writes."""
        return await self.peers.abort(self.peer, self.rid) is AbortAnswer.STOPPED

    async def _stalled(self) -> None:
        """Returns once the prefill worker's engine has run no forward step (or GetStats has
        not answered) for prefill_timeout_seconds; runs forever while it keeps stepping."""
        budget = self.config.prefill_timeout_seconds
        pause = min(2.0, budget / 4)
        last_steps, last_progress = None, time.monotonic()
        while True:
            await asyncio.sleep(pause)
            steps = await self.peers.num_steps(self.peer, timeout_s=max(pause, 0.5),
                                               max_age_s=pause / 2)
            now = time.monotonic()
            if steps is not None and steps != last_steps:
                last_steps, last_progress = steps, now
            if now - last_progress >= budget:
                log.warning("prefill worker made no progress", extra={
                    "request_id": self.rid, "peer": self.peer.address, "seconds": budget})
                return

    async def _rpc_failed(self, e: BaseException) -> RemoteResult:
        if not isinstance(e, grpc.aio.AioRpcError):
            code, details = grpc.StatusCode.CANCELLED, "Prefill call cancelled"
        else:
            code, details = e.code(), e.details()
        error = f"Prefill call failed: {code.name} {details}"
        if code == grpc.StatusCode.INVALID_ARGUMENT:  # refused before any work
            return RemoteResult(RemoteOutcome.REJECTED, error)
        if code == grpc.StatusCode.ALREADY_EXISTS:  # refused: nothing was or will be sent
            return self._failed(error, stopped=True)
        self.peers.forget(self.peer)  # re-handshake: it may have restarted
        return self._failed(error, stopped=await self._abort())

    async def _await_arrival(self, result: RemoteResult) -> RemoteResult:
        """Prefill said every block is written: confirm on the receiver before using them."""
        t0 = time.monotonic()
        limit, pause = t0 + self.config.kv_wait_seconds, 0.0005
        while (state := self.receiver.poll(self.transfer_id)) == TransferState.PENDING or \
                state == TransferState.IN_PROGRESS:
            if time.monotonic() > limit:
                break
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.01)
        result.arrival_seconds = time.monotonic() - t0
        if state != TransferState.DONE:  # the prefill worker's transfer ended: it said OK
            return self._failed(f"prefill answered OK but the receiver saw the transfer "
                                f"{state.name}", stopped=True, response=result.response)
        return result


async def _await(call):
    return await call
