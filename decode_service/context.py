"""What a decode sequence needs of its worker besides the engine: the config, the KV
receiver, the prefill peers, the metrics, a way to run a task in the background (a remote
phase that must outlive its caller, a hold's release, a ReleaseBlocks) and the P/D chooser
(decode_service/pd_choice.py: local or remote prefill, per request). The worker
builds one DecodeContext and hands it to every sequence; nothing here knows of either.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass

from baton.transfer import KVReceiver
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
    spawn: Callable[[Coroutine], asyncio.Task]
    pd: PDChooser


class BackgroundTasks:
    """Tasks kept alive until done; an exception is logged, not lost."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro: Coroutine) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def cancel_all(self) -> None:
        for task in list(self._tasks):
            task.cancel()

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.debug("background task ended: %r", task.exception())
