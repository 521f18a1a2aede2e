"""What a decode sequence needs of its worker besides the engine: the config, the KV
receiver, the prefill peers, the metrics, a way to run a task in the background (a remote
phase that must outlive its caller, a hold's release, a ReleaseBlocks) and the P/D chooser
(decode_service/pd_choice.py: local or remote prefill, per request). The worker
builds one DecodeContext and hands it to every sequence; nothing here knows of either. A
background task that fails unexpectedly is logged at WARNING with its request id.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass

from baton.transfer import KVReceiver
from baton.worker.process import Rejected
from decode_service.config import DecodeConfig
from decode_service.metrics import DecodeMetrics
from decode_service.pd_choice import PDChooser
from decode_service.peers import PrefillPeers

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecodeContext:
    config: DecodeConfig
    receiver: KVReceiver
    peers: PrefillPeers
    metrics: DecodeMetrics
    spawn: Callable[[Coroutine, str], asyncio.Task]  # (coroutine, request id)
    pd: PDChooser


# What a background task may end in without anything being wrong: the request was refused
# (its caller, if still there, reports it).
EXPECTED = (ValueError, Rejected)


class BackgroundTasks:
    """Tasks kept alive until done. One that fails unexpectedly (a hold not released would
    leak its blocks) is logged at WARNING with its request id and traceback; an expected
    refusal (EXPECTED) at DEBUG."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro: Coroutine, request_id: str) -> asyncio.Task:
        """Run `coro` for request `request_id` in the background."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._done(t, request_id))
        return task

    def cancel_all(self) -> None:
        for task in list(self._tasks):
            task.cancel()

    def _done(self, task: asyncio.Task, request_id: str) -> None:
        self._tasks.discard(task)
        if task.cancelled() or (error := task.exception()) is None:
            return
        extra = {"request_id": request_id, "task": task.get_coro().__qualname__}
        if isinstance(error, EXPECTED):
            log.debug("background task refused: %r", error, extra=extra)
        else:
            log.warning("background task failed: %r", error, extra=extra,
                        exc_info=(type(error), error, error.__traceback__))
