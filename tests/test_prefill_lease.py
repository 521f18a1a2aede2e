"""Prefill leases and tombstones (prefill_service/lease.py) on a hand-driven clock, and the
PrefillSequence state machine (prefill_service/sequence.py)."""
from __future__ import annotations

import asyncio
import time

import pytest

from prefill_service.lease import Leases
from prefill_service.sequence import PrefillEnded, PrefillSequence, PrefillState
from protos import prefill_pb2


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return Clock()


def leases(clock, lease_s=30.0, tombstone_s=120.0) -> Leases[str]:
    return Leases(lease_s, tombstone_s, clock=clock)


def test_lease_is_the_workers_unless_the_request_asks_less(clock):
    ls = leases(clock, lease_s=30.0)
    assert ls.hold("a") == 130.0            # 0 = the worker's lease
    assert ls.hold("b", 5.0) == 105.0       # shorter: honoured
    assert ls.hold("c", 60.0) == 130.0      # longer: capped
    assert len(ls) == 3 and "a" in ls


def test_lease_expires_strictly_after_its_deadline_in_start_order(clock):
    ls = leases(clock, lease_s=10.0)
    ls.hold("a")
    clock.now += 1
    ls.hold("b")
    ls.hold("c", 1.0)                       # deadline 102, before a's 110
    clock.now = 110.0
    assert ls.expired() == ["c"]            # a's deadline is now: not yet past
    clock.now = 110.001
    assert ls.expired() == ["a", "c"]
    ls.hold("a")                            # restarted: counts from now, last in order
    assert ls.expired() == ["c"]
    assert ls.expired(now=1000.0) == ["b", "c", "a"]


def test_ended_lease_never_expires_and_end_is_idempotent(clock):
    ls = leases(clock, lease_s=1.0)
    ls.hold("a")
    ls.end("a")
    ls.end("a")
    ls.end("never held")
    clock.now += 10
    assert ls.expired() == [] and len(ls) == 0


async def test_reap_expires_passed_leases_and_sweeps_tombstones(clock):
    ls = leases(clock, lease_s=5.0, tombstone_s=3.0)
    ls.hold("old")
    ls.bury("gone")
    clock.now += 4
    ls.hold("new")
    ls.bury("recent")
    expired = []

    async def expire(key):
        expired.append(key)
        ls.end(key)

    await ls.reap(expire)                   # now 104: nothing past yet
    assert expired == [] and ls.buried("gone") is False and ls.buried("recent")
    assert list(ls._tombstones) == ["recent"]  # swept: "gone" (103); kept: "recent" (107)
    clock.now += 2                          # 106: "old" (105) past, "new" (109) not
    await ls.reap(expire)
    assert expired == ["old"] and "new" in ls and "old" not in ls


async def test_reap_skips_nothing_when_expire_releases_elsewhere(clock):
    """The callback may find the hold already gone (released meanwhile); the pass goes on."""
    ls = leases(clock, lease_s=1.0)
    for k in "abc":
        ls.hold(k)
    clock.now += 2
    seen = []

    async def expire(key):
        seen.append(key)
        for k in "abc":                     # one release ends them all
            ls.end(k)

    await ls.reap(expire)
    assert seen == ["a", "b", "c"] and len(ls) == 0


def test_tombstone_refuses_the_id_until_its_time_passes(clock):
    ls = leases(clock, tombstone_s=120.0)
    assert not ls.buried("r")
    ls.bury("r")
    assert ls.buried("r") and not ls.buried("other")
    clock.now += 119.9
    assert ls.buried("r")
    clock.now += 0.1                        # deadline reached: refused no longer
    assert not ls.buried("r")
    ls.bury("r")                            # a second Abort starts a fresh tombstone
    clock.now += 60
    assert ls.buried("r")
    ls.sweep()
    assert ls.buried("r")


async def test_reaper_runs_every_quarter_lease_until_stopped(clock):
    ls = leases(clock, lease_s=0.2)         # pause min(1 s, 0.2 / 4) = 0.05 s
    ls.hold("a")
    clock.now += 1
    expired = asyncio.Event()

    async def expire(key):
        ls.end(key)
        expired.set()

    ls.start(expire)
    try:
        await asyncio.wait_for(expired.wait(), timeout=0.2)
    finally:
        ls.stop()
    assert len(ls) == 0
    ls.hold("b")
    clock.now += 1
    await asyncio.sleep(0.1)                # two pauses: a running reaper would expire it
    assert "b" in ls


# ---- PrefillSequence ------------------------------------------------------------------------
def seq(deadline: float = 1e18) -> PrefillSequence:
    return PrefillSequence(prefill_pb2.PrefillRequest(request_id="r"), deadline)


@pytest.mark.parametrize("path", [
    ["SENDING_KV", "HELD", "RELEASED"],
    ["RELEASED"],
    ["SENDING_KV", "RELEASED"],
])
async def test_legal_paths(path):
    s = seq()
    for name in path:
        s.move(PrefillState[name])
    assert s.state == PrefillState.RELEASED


@pytest.mark.parametrize("path", [
    ["HELD"],                               # skips the transfer
    ["SENDING_KV", "PREFILLING"],           # backwards
    ["SENDING_KV", "SENDING_KV"],
    ["RELEASED", "RELEASED"],               # released twice
    ["RELEASED", "SENDING_KV"],
])
async def test_illegal_moves_are_refused(path):
    s = seq()
    with pytest.raises(AssertionError):
        for name in path:
            s.move(PrefillState[name])


async def test_until_ends_on_abort_or_deadline():
    s = seq()
    assert await s.until(asyncio.sleep(0, result=7)) == 7
    s.abort("Abort call")
    s.abort("a later reason")               # the first reason is kept
    with pytest.raises(PrefillEnded) as e:
        await s.until(asyncio.sleep(10))
    assert (e.value.status, e.value.error) == (prefill_pb2.PREFILL_STATUS_ABORTED, "Abort call")
    late = seq(deadline=time.monotonic() - 1)
    with pytest.raises(PrefillEnded) as e:
        await late.until(asyncio.sleep(10))
    assert e.value.status == prefill_pb2.PREFILL_STATUS_TIMEOUT
