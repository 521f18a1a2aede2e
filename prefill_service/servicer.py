"""PrefillService over gRPC: protos in, worker calls, protos out; errors → status codes.

    Handshake      compare the decode worker's KV layout and transports with ours
    Prefill        PrefillWorker.prefill (ValueError → INVALID_ARGUMENT, Rejected → its code);
                   a kv_epoch of another process (a restart since the handshake) → STALE_HANDSHAKE
    Abort          PrefillWorker.abort: answers once no transfer of the request can write;
                   with this process's kv_epoch, so the caller knows who answered
    ReleaseBlocks  PrefillWorker.release: the lease ends, blocks go to the prefix cache
    GetStats       a WorkerStats snapshot taken on the engine thread
"""
from __future__ import annotations

import logging

import grpc

from baton.worker.process import Rejected
from baton.transfer import TRANSPORT_KINDS, KVLayoutError, check_compatible, kv_layout_hash
from baton.worker.stats_rpc import StatsRpc
from prefill_service.worker import PrefillWorker
from protos import common_pb2, prefill_pb2, prefill_pb2_grpc

log = logging.getLogger(__name__)


class PrefillServicer(prefill_pb2_grpc.PrefillServiceServicer):
    """PrefillService of one prefill worker (`worker_id`: its advertised address)."""

    def __init__(self, worker: PrefillWorker, layout: common_pb2.KVLayout, transport: str,
                 worker_id: str) -> None:
        self.worker, self.layout, self.worker_id = worker, layout, worker_id
        self.layout_hash = kv_layout_hash(layout)
        self.transport = TRANSPORT_KINDS[transport]
        settings = common_pb2.WorkerStats(
            prefill_target_tokens=worker.config.engine.scheduler.prefill_target_tokens)
        self.stats = StatsRpc(worker.ae, common_pb2.WORKER_ROLE_PREFILL, worker_id, layout,
                              settings=settings)

    async def Handshake(self, request: prefill_pb2.HandshakeRequest, context):
        resp = prefill_pb2.HandshakeResponse(
            kv_layout=self.layout, layout_hash=self.layout_hash, worker_id=self.worker_id,
            transports=[self.transport], kv_epoch=self.stats.kv_epoch)
        try:
            check_compatible(self.layout, request.kv_layout)
            if request.layout_hash != kv_layout_hash(request.kv_layout):
                raise KVLayoutError("layout_hash does not match kv_layout (protocol skew?)")
        except KVLayoutError as e:
            resp.error = f"{e} [prefill {self.worker_id} != decode {request.worker_id}]"
        else:
            if self.transport not in request.transports:
                names = [prefill_pb2.TransportKind.Name(t) for t in request.transports]
                resp.error = (f"transport: prefill sends over "
                              f"{prefill_pb2.TransportKind.Name(self.transport)}, decode "
                              f"receives over {names}")
        resp.compatible = not resp.error
        if resp.error:
            log.warning("handshake refused: %s", resp.error, extra={"peer": request.worker_id})
        return resp

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context):
        if request.kv_epoch and request.kv_epoch != self.stats.kv_epoch:
            # shaken hands with another process (this one restarted): a decode worker trusts
            # Abort answers from that one alone, so this one must write nothing
            return prefill_pb2.PrefillResponse(
                request_id=request.request_id, status=prefill_pb2.PREFILL_STATUS_STALE_HANDSHAKE,
                error=f"kv_epoch {request.kv_epoch:016x} is not this process's; handshake again")
        try:
            return await self.worker.prefill(request)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except Rejected as e:
            await context.abort(e.code, e.details)

    async def Abort(self, request: common_pb2.AbortRequest, context):
        found = await self.worker.abort(request.request_id)
        return common_pb2.AbortResponse(found=found, kv_epoch=self.stats.kv_epoch)

    async def ReleaseBlocks(self, request: prefill_pb2.ReleaseBlocksRequest, context):
        released = await self.worker.release(request.request_id)
        return prefill_pb2.ReleaseBlocksResponse(released=released)

    async def GetStats(self, request: common_pb2.GetStatsRequest, context):
        return await self.stats(request)

    async def EndSession(self, request: common_pb2.EndSessionRequest, context):
        if not request.session_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "session_id is required")
        n = await self.worker.ae.call(lambda eng: eng.end_session(request.session_id))
        return common_pb2.EndSessionResponse(num_blocks=n)
