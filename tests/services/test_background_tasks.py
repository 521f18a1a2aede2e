"""Background tasks of a decode worker (decode_service/context.py, issue 27): an unexpected
failure (a hold's release, a ReleaseBlocks) is logged at WARNING with its request id and
traceback, so a leak shows; an expected refusal stays quiet; none is lost."""
from __future__ import annotations

import asyncio
import logging

import grpc

from baton.worker.process import Rejected
from decode_service.context import BackgroundTasks


async def release_hold() -> None:
    raise KeyError("hold 7")  # e.g. a hold already gone: its blocks would leak


async def refused(error: Exception) -> None:
    raise error


async def test_unexpected_failures_warn_with_the_request_id(caplog):
    tasks = BackgroundTasks()
    caplog.set_level(logging.DEBUG, logger="decode_service.context")
    await asyncio.gather(tasks.spawn(release_hold(), "req-1"), return_exceptions=True)
    await asyncio.sleep(0)  # the done callback
    (record,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert record.request_id == "req-1" and record.task == "release_hold"
    assert "KeyError" in record.getMessage() and record.exc_info[0] is KeyError


async def test_expected_refusals_and_cancellations_stay_quiet(caplog):
    tasks = BackgroundTasks()
    caplog.set_level(logging.DEBUG, logger="decode_service.context")
    sleeper = tasks.spawn(asyncio.sleep(3600), "req-3")
    spawned = [tasks.spawn(refused(ValueError("bad schema")), "req-2"),
               tasks.spawn(refused(Rejected(grpc.StatusCode.ALREADY_EXISTS, "dup")), "req-2"),
               sleeper]
    sleeper.cancel()
    await asyncio.gather(*spawned, return_exceptions=True)
    await asyncio.sleep(0)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [r.request_id for r in caplog.records] == ["req-2", "req-2"]  # at DEBUG
