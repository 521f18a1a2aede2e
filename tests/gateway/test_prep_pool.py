"""The preparation pool (gateway/prep_pool.py): jobs run in other processes, errors keep their
field, a job past its deadline is a 400 naming the field it was on and its child is replaced,
a cancelled job's child too, a dead child is a 500, a session keeps to its child, and with
every child busy a request waits at most the timeout (then 503)."""
from __future__ import annotations

import asyncio
import os
import time

import pytest

from gateway.errors import GatewayError
from gateway.prep_pool import PrepContext, PrepPool, PrepSettings

SETTINGS = PrepSettings(frozenset({"tiny"}), "hermes")


def pid_job(ctx: PrepContext, x: int) -> tuple[int, int]:
    return os.getpid(), x * ctx.prompts.max_model_len


def failing_job(ctx: PrepContext) -> None:
    raise GatewayError(400, "bad parameters", param="tools[2].function.parameters",
                       code="invalid_request")


def endless_job(ctx: PrepContext, param: str) -> None:
    ctx.note("messages")
    ctx.note(param)
    time.sleep(3600)


def dying_job(ctx: PrepContext) -> None:
    os._exit(3)


@pytest.fixture
async def pool(prompts):
    # 3 s: a job's deadline, and the longest wait for a free child (a replacement starts in
    # about 0.3 s, seconds on a busy machine)
    pool = PrepPool(prompts, SETTINGS, processes=2, timeout_s=3.0)
    await pool.start()
    yield pool
    await pool.close()


async def pids(pool: PrepPool, count: int = 8) -> set[int]:
    """The children's pids, seen by `count` jobs run two at a time."""
    out = set()
    for _ in range(count // 2):
        for pid, _ in await asyncio.gather(pool.run(pid_job, 1), pool.run(pid_job, 1)):
            out.add(pid)
    return out


async def test_jobs_run_in_child_processes_and_errors_keep_their_field(pool, prompts):
    pid, value = await pool.run(pid_job, 3)
    assert pid != os.getpid() and value == 3 * prompts.max_model_len
    with pytest.raises(GatewayError) as e:
        await pool.run(failing_job)
    assert (e.value.status, e.value.param, e.value.code) == \
        (400, "tools[2].function.parameters", "invalid_request")
    assert len(await pids(pool)) == 2


async def test_past_the_deadline_a_400_names_the_field_and_the_child_is_replaced(pool):
    before = await pids(pool)
    with pytest.raises(GatewayError) as e:
        await pool.run(endless_job, "response_format.json_schema.schema")
    err = e.value
    assert (err.status, err.code, err.param) == \
        (400, "request_too_complex", "response_format.json_schema.schema")
    assert "--prep-timeout-s" in err.message
    after = await pids(pool)  # waits for the replacement (the other child serves meanwhile)
    while len(after) < 2:
        after |= await pids(pool)
    assert len(after & before) == 1  # one child killed, one new
    (gone,) = before - after
    with pytest.raises(ProcessLookupError):
        os.kill(gone, 0)


async def test_a_cancelled_job_kills_its_child(pool):
    before = await pids(pool)
    job = asyncio.ensure_future(pool.run(endless_job, "messages"))
    await asyncio.sleep(0.3)
    job.cancel()
    with pytest.raises(asyncio.CancelledError):
        await job
    after = set()
    while len(after) < 2:
        after |= await pids(pool)
    assert len(after & before) == 1


async def test_a_child_that_dies_is_a_500_and_replaced(pool):
    with pytest.raises(GatewayError) as e:
        await pool.run(dying_job)
    assert e.value.status == 500
    assert len(await pids(pool)) >= 1


async def test_a_session_keeps_to_its_child_when_it_is_free(pool):
    seen = {s: {(await pool.run(pid_job, 1, affinity=s))[0] for _ in range(4)}
            for s in (f"session-{i}" for i in range(6))}
    assert all(len(p) == 1 for p in seen.values())  # one child per session
    assert len(set().union(*seen.values())) == 2  # and both children are used


async def test_with_every_child_busy_a_request_waits_the_timeout_then_503(prompts,
                                                                        monkeypatch):
    pool = PrepPool(prompts, SETTINGS, processes=1, timeout_s=0.5)
    await pool.start()
    restart = asyncio.Event()
    spawn = pool._spawn

    async def held_spawn(slot: int) -> None:  # the killed child comes back when we say
        await restart.wait()
        await spawn(slot)

    monkeypatch.setattr(pool, "_spawn", held_spawn)
    try:
        stuck = asyncio.ensure_future(pool.run(endless_job, "tools"))
        await asyncio.sleep(0.1)
        with pytest.raises(GatewayError) as e:
            await pool.run(pid_job, 1)
        assert e.value.status == 503 and e.value.retry_after == 1
        with pytest.raises(GatewayError):
            await stuck  # past its deadline: 400
        restart.set()
        assert (await pool.run(pid_job, 2))[1] == 2 * prompts.max_model_len
    finally:
        await pool.close()
