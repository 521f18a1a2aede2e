"""The chaos run's hands on a `baton up` cluster (tests/test_chaos.py): find a child by role
and address, kill it while a chosen activity is under way, read `baton up`'s restart lines,
and time how long a restarted process takes to serve its role again.

    Output (restart_helpers.py)   baton up's stdout, each line timed
    Target(module, address)       one child; .pid() finds it (its listening ports)
    moving(read, timeout_s)       True once the counter `read()` grew (the activity runs)
    until(check, timeout_s)       seconds until `check()` was true (None: never)
    probe_decode(decode, prefill) a remote-prefill Generate straight to a decode worker

Every wait is bounded in time; every blocking call is run off the event loop, so the load's
streams keep flowing meanwhile.
"""
from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import NamedTuple

import grpc
import psutil

from baton.sampling_params import SamplingParams
from baton.worker.wire import sampling_params_to_proto
from protos import decode_pb2, decode_pb2_grpc


class Target(NamedTuple):
    """One child of `baton up` (`parent`): its role module and the port it serves on."""

    parent: int
    module: str  # prefill_service | decode_service | gateway | mooncake_master
    port: int

    def pid(self) -> int | None:
        """The child serving `port` now (None while it is restarting)."""
        for pid in Path(f"/proc/{self.parent}/task/{self.parent}/children").read_text().split():
            try:
                p = psutil.Process(int(pid))
                if self.module not in " ".join(p.cmdline()):
                    continue
                if any(c.status == psutil.CONN_LISTEN and c.laddr.port == self.port
                       for c in p.net_connections(kind="tcp")):
                    return p.pid
            except (psutil.Error, ValueError):
                continue
        return None

    @property
    def back_line(self) -> str:
        """What baton up prints once the restarted child printed READY."""
        return f"is back on port {self.port} "


async def moving(read: Callable[[], float], timeout_s: float, pause_s: float = 0.1) -> bool:
    """True as soon as the counter `read()` (blocking: run in a thread) grew; False when it
    did not within `timeout_s` (or could not be read)."""
    end = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < end:
        try:
            now = await asyncio.to_thread(read)
        except Exception:  # noqa: BLE001 - not readable now: no sign of the activity
            now = None
        if last is not None and now is not None and now > last:
            return True
        last = now if now is not None else last
        await asyncio.sleep(pause_s)
    return False


async def until(check: Callable[[], Awaitable[bool]], timeout_s: float,
                pause_s: float = 0.1) -> float | None:
    """Seconds until `check()` answered True (a raise counts as False); None past
    `timeout_s`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        try:
            if await check():
                return time.monotonic() - t0
        except Exception:  # noqa: BLE001 - still down or starting
            pass
        await asyncio.sleep(pause_s)
    return None


def probe_decode(decode: str, prefill: str, timeout_s: float = 5.0) -> bool:
    """One Generate of a 40-token prompt straight to `decode`, prefilled by `prefill`
    (PREFILL_MODE_REMOTE): True when it finished with tokens and no error."""
    rng = random.Random()
    req = decode_pb2.GenerateRequest(
        request_id=f"chaos-probe-{rng.getrandbits(32):08x}",
        prompt_token_ids=[rng.randrange(3, 300) for _ in range(40)],
        sampling_params=sampling_params_to_proto(SamplingParams(temperature=0.0, max_tokens=2,
                                                                ignore_eos=True)),
        prefill_address=prefill, prefill_mode=decode_pb2.PREFILL_MODE_REMOTE)
    tokens, error = 0, ""
    with grpc.insecure_channel(decode) as channel:
        for msg in decode_pb2_grpc.DecodeServiceStub(channel).Generate(req, timeout=timeout_s):
            if msg.HasField("tokens"):
                tokens += len(msg.tokens.token_ids)
            else:
                error = error or msg.finished.error
    return tokens > 0 and not error
