"""DecodeService over gRPC: protos in, worker calls, protos out; errors → status codes.

    Generate  DecodeWorker.generate streams TokenChunk*, then Finished × n. Errors before the
              first message end the call with a status (INVALID_ARGUMENT, naming the refused
              field in the trailing metadata when known (FieldError), ALREADY_EXISTS,
              FAILED_PRECONDITION for a KV layout mismatch with the prefill worker,
              UNAVAILABLE); later failures arrive as Finished{ERROR}. A cancelled call aborts.
    Abort     DecodeWorker.abort: the stream ends with Finished{ABORT}
    GetStats  a WorkerStats snapshot taken on the engine thread
    EndSession  the session's cached blocks become first to evict (engine thread)
"""
from __future__ import annotations

import grpc

from baton.json_schema import FieldError
from baton.worker.process import Rejected
from baton.worker.stats_rpc import StatsRpc
from decode_service.worker import DecodeWorker
from protos import common_pb2, decode_pb2_grpc


class DecodeServicer(decode_pb2_grpc.DecodeServiceServicer):
    """DecodeService of one decode worker (`worker_id`: its advertised address)."""

    def __init__(self, worker: DecodeWorker, layout: common_pb2.KVLayout,
                 worker_id: str) -> None:
        self.worker = worker
        c = worker.config
        policy = common_pb2.PDPolicyInfo(
            itl_budget_ms=c.local_prefill_itl_budget_ms,
            idle_budget_ms=c.local_prefill_idle_budget_ms,
            min_remote_tokens=c.min_remote_tokens or 0,
            remote_stall_fraction=worker.ctx.pd.policy.remote_stall_fraction)
        settings = common_pb2.WorkerStats(
            prefill_target_tokens=c.engine.scheduler.prefill_target_tokens, pd_policy=policy)
        self.stats = StatsRpc(worker.ae, common_pb2.WORKER_ROLE_DECODE, worker_id, layout,
                              settings=settings)

    async def Generate(self, request, context):
        sent = False
        try:
            async for resp in self.worker.generate(request):
                sent = True
                yield resp
        except (ValueError, Rejected) as e:
            if sent:
                raise
            code = e.code if isinstance(e, Rejected) else grpc.StatusCode.INVALID_ARGUMENT
            field = e.trailing_metadata() if isinstance(e, FieldError) else ()
            await context.abort(code, str(e), trailing_metadata=field)

    async def Abort(self, request: common_pb2.AbortRequest, context):
        return common_pb2.AbortResponse(found=await self.worker.abort(request.request_id))

    async def GetStats(self, request: common_pb2.GetStatsRequest, context):
        return await self.stats(request)

    async def EndSession(self, request: common_pb2.EndSessionRequest, context):
        if not request.session_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "session_id is required")
        n = await self.worker.end_session(request.session_id)
        return common_pb2.EndSessionResponse(num_blocks=n)
