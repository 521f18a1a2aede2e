"""The GetStats RPC, answered the same way by every worker role: a WorkerStats snapshot taken
on the engine thread (`LLMEngine.stats`, as a message by baton/worker/wire.py::worker_stats) plus the engine's step count.

    servicer.stats = StatsRpc(worker.ae, common_pb2.WORKER_ROLE_DECODE, worker_id, layout)
    async def GetStats(self, request, context): return await self.stats(request)
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from baton.worker.async_engine import AsyncEngine
from baton.worker.wire import worker_stats
from protos import common_pb2


@dataclass
class StatsRpc:
    """One worker's GetStats. kv_epoch is random per process, so a caller that sees it
    change knows the worker restarted (its cached block hashes are new). metrics_port: the
    worker's Prometheus port once it serves (0 = none), reported for GET /metrics/workers.
    settings: what the worker runs with and never changes (prefill_target_tokens, a decode
    worker's pd_policy), merged into every reply."""

    ae: AsyncEngine
    role: int  # common_pb2.WORKER_ROLE_*
    worker_id: str
    layout: common_pb2.KVLayout
    kv_epoch: int = field(default_factory=lambda: secrets.randbits(64))
    metrics_port: int = 0
    settings: common_pb2.WorkerStats = field(default_factory=common_pb2.WorkerStats)

    async def __call__(self, request: common_pb2.GetStatsRequest) -> common_pb2.WorkerStats:
        """The WorkerStats reply to `request` (block hashes only if it asks for them)."""
        snap = await self.ae.call(lambda eng: eng.stats(request.include_block_hashes))
        stats = worker_stats(snap, self.role, self.worker_id, self.layout, self.kv_epoch)
        stats.num_steps = self.ae.num_steps
        stats.metrics_port = self.metrics_port
        stats.MergeFrom(self.settings)
        return stats
