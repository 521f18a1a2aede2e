"""Faults under load (issue 7), loopback only: a prefill worker, a decode worker (NIXL) and a
gateway as processes on fixed ports; while agent sessions stream through the HTTP API, the
prefill worker is SIGKILLed and restarted on its port, then the decode worker.

    load ──────────────────────────────────────────────────────────────────────────▶
          warm │ kill prefill … restart │ steady │ kill decode … restart │ steady │ idle
               ▼                        ▼        ▼                       ▼        ▼
          in flight: recomputed    prefill used   in flight: error event  pools whole
          new: prefilled locally   again          new: 503 + Retry-After,
                                                  retried until it is back

Pass criteria: no request hangs (each has a 60 s client timeout) or ends without [DONE] or
an error event; around the prefill kill every request completes (decode recomputes); errors
happen only to requests in flight when the decode worker died; 503s carry Retry-After; every
request started once a restarted worker is healthy again succeeds; the restarted prefill
worker serves remote prefills again within seconds; both pools are whole at the end.
"""
from __future__ import annotations

import asyncio
import itertools
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from tests.load_helpers import (
    Proc,
    Tally,
    agent_session,
    free_port,
    get_stats,
    http_client,
    wait_pools_whole,
)

pytestmark = pytest.mark.slow

CLIENTS = 16
TURNS = 3
MAX_TOKENS = 24
STEADY_S = 4.0


class Workers:
    """The three processes; `restart(name)` starts one again on the same port."""

    def __init__(self, model: Path, log_dir: Path) -> None:
        self.model = str(model)
        pp, dp, gp = free_port(), free_port(), free_port()
        self.prefill_address, self.decode_address = f"127.0.0.1:{pp}", f"127.0.0.1:{dp}"
        self.url = f"http://127.0.0.1:{gp}"
        common = ["--model", self.model, "--host", "127.0.0.1", "--block-size", "16",
                  "--num-blocks", "512", "--transport", "nixl", "--log-level", "WARNING",
                  "--drain-seconds", "1"]
        self.procs = {
            "prefill": Proc("prefill", "prefill_service", [
                *common, "--port", str(pp), "--lease-seconds", "3", "--timeout-seconds", "10"],
                log_dir),
            "decode": Proc("decode", "decode_service", [
                *common, "--port", str(dp), "--min-remote-tokens", "16",
                "--prefill-timeout-seconds", "5", "--prefill-max-seconds", "5",
                "--quarantine-grace-seconds", "0.5",
                "--abort-timeout-seconds", "1", "--handshake-timeout-seconds", "1",
                "--metrics-port", "0"], log_dir),
            "gateway": Proc("gateway", "gateway", [
                "--model", self.model, "--host", "127.0.0.1", "--port", str(gp),
                "--decode", self.decode_address, "--prefill", self.prefill_address,
                "--poll-interval-s", "0.2", "--first-token-timeout-s", "20",
                "--stream-idle-timeout-s", "20", "--log-level", "warning"], log_dir),
        }

    @property
    def pools(self) -> dict[str, tuple[str, str]]:
        return {"prefill": ("prefill", self.prefill_address),
                "decode": ("decode", self.decode_address)}

    async def start(self) -> None:
        for name in ("prefill", "decode"):
            self.procs[name].start()
        for name in ("prefill", "decode"):
            await self.procs[name].wait_ready()
        await self.procs["gateway"].start().wait_ready()
        await self.wait_healthy()

    async def restart(self, name: str) -> None:
        await self.procs[name].start().wait_ready()
        await self.wait_healthy()

    async def wait_healthy(self, timeout: float = 60.0) -> None:
        """Until the gateway reports both workers healthy."""
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient(base_url=self.url, timeout=5) as c:
            while True:
                try:
                    body = (await c.get("/health")).json()
                    if all(body["workers"][r]["healthy"] == 1 for r in ("prefill", "decode")):
                        return
                except (httpx.HTTPError, ValueError, KeyError):
                    body = None
                assert time.monotonic() < deadline, f"not healthy: {body}"
                await asyncio.sleep(0.1)

    def stop(self) -> None:
        for name in ("gateway", "decode", "prefill"):
            self.procs[name].stop()


@pytest.fixture
async def workers(tiny_llama):
    with tempfile.TemporaryDirectory(prefix="baton-faults-") as log_dir:
        w = Workers(tiny_llama, Path(log_dir))
        try:
            await w.start()
            yield w
        finally:
            w.stop()


class Load:
    """CLIENTS agents running sessions back to back until stopped; every answer is kept."""

    def __init__(self, client: httpx.AsyncClient, model: str) -> None:
        self.client, self.model = client, model
        self.tally = Tally()
        self.stopping = asyncio.Event()
        self._ids = itertools.count()
        self._tasks = [asyncio.create_task(self._agent()) for _ in range(CLIENTS)]

    async def _agent(self) -> None:
        while not self.stopping.is_set():
            await agent_session(self.client, self.tally, self.model, next(self._ids), TURNS,
                                MAX_TOKENS, think_s=0.2, retry_for_s=120.0)

    async def stop(self) -> None:
        self.stopping.set()
        await asyncio.gather(*self._tasks)

    def between(self, start: float, end: float = float("inf")) -> list:
        """Answers to requests sent in [start, end)."""
        return [o for o in self.tally.outcomes if start <= o.started < end]

    def ended_before(self, t: float) -> list:
        return [o for o in self.tally.outcomes if o.started + o.seconds < t]

    def in_flight_at(self, t: float) -> list:
        return [o for o in self.tally.outcomes if o.started < t < o.started + o.seconds]


async def until_prefill_used(w: Workers, timeout: float) -> float:
    """When the restarted prefill worker first holds computed blocks (it served a remote
    prefill); AssertionError after `timeout`."""
    deadline = time.monotonic() + timeout
    while (await get_stats("prefill", w.prefill_address)).num_cached_blocks == 0:
        assert time.monotonic() < deadline, "the restarted prefill worker is not used"
        await asyncio.sleep(0.1)
    return time.monotonic()


def kinds(outcomes) -> dict[str, int]:
    out: dict[str, int] = {}
    for o in outcomes:
        out[o.kind] = out.get(o.kind, 0) + 1
    return out


async def test_kill_and_restart_prefill_then_decode_under_load(workers):
    w = workers
    async with http_client(w.url, connections=CLIENTS * 2) as client:
        load = Load(client, w.model)
        try:
            async with asyncio.timeout(400):
                await asyncio.sleep(STEADY_S)
                # -- prefill: SIGKILL mid-load, back on the same port
                t_kill_p = time.monotonic()
                w.procs["prefill"].kill()
                await asyncio.sleep(1.0)
                await w.restart("prefill")
                t_back_p = time.monotonic()
                reused_after = await until_prefill_used(w, timeout=30.0) - t_back_p
                await asyncio.sleep(STEADY_S)
                remote = w.procs["decode"].metrics("baton_decode_remote_prefills_total")
                # -- decode: SIGKILL mid-load, back on the same port
                t_kill_d = time.monotonic()
                w.procs["decode"].kill()
                await asyncio.sleep(1.0)
                await w.restart("decode")
                t_back_d = time.monotonic()
                await asyncio.sleep(STEADY_S)
        finally:
            await load.stop()
    stats = await wait_pools_whole(w.pools, settle_s=20)
    t = load.tally
    report = (f"faults: {t.summary()}; in flight at the prefill kill "
              f"{kinds(load.in_flight_at(t_kill_p))}, at the decode kill "
              f"{kinds(load.in_flight_at(t_kill_d))}; prefill down "
              f"{t_back_p - t_kill_p:.1f}s (remote prefills again {reused_after:.1f}s after "
              f"it was back), decode down {t_back_d - t_kill_d:.1f}s; decode's "
              f"remote prefills before its kill {remote}; pools "
              + ", ".join(f"{n} {s.num_free_blocks}/{s.num_total_blocks}"
                          for n, s in stats.items()))
    print(report)
    # every request answered: completed, a clean error, or a 503 that said when to retry
    assert set(t.kinds) <= {"ok", "error", "shed"}, report
    assert all(o.status == 503 for o in t.outcomes if o.kind == "shed"), report
    # around the prefill kill: in-flight remote prefills are recomputed, new ones go local
    before_d = load.ended_before(t_kill_d)
    assert kinds(before_d) == {"ok": len(before_d)}, report
    assert load.in_flight_at(t_kill_p), "no request was in flight at the prefill kill"
    # around the decode kill: errors only for requests in flight at that moment
    in_flight = {id(o) for o in load.in_flight_at(t_kill_d)}
    assert in_flight, "no request was in flight at the decode kill"
    errors = [o for o in t.outcomes if o.kind == "error"]
    assert all(id(o) in in_flight for o in errors), report
    # once back, everything succeeds
    after = load.between(t_back_d)
    assert after and all(o.kind == "ok" for o in after), report
