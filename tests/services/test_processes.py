"""Real worker processes (`python -m prefill_service` / `python -m decode_service`): output
equals transformers, health, metrics over HTTP, graceful SIGTERM (prefill drains an
in-flight transfer), and a prefill worker killed mid-transfer (recompute, or a clear error
under `fail`) with nothing leaked on the decode side."""
from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from baton.worker.process import parse_ready
from protos import common_pb2
from tests.reference import hf_greedy
from tests.services.helpers import FORCE_REMOTE, Client, pools_whole, start_decode

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]
ROOT = Path(__file__).resolve().parents[2]
ENGINE_ARGS = ["--dtype", "float32", "--block-size", "8", "--num-blocks", "96",
               "--host", "127.0.0.1", "--port", "0", "--log-level", "WARNING"]


def prompt_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 380) for _ in range(n)]


class Proc:
    """A worker process; `port` once it printed READY; stdout lines collected."""

    def __init__(self, module: list[str], args: list[str]) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        self.p = subprocess.Popen([sys.executable, "-m", *module, *args], cwd=ROOT, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.port = self.metrics_port = 0
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.p.stdout:
            self.lines.append(line.strip())
            ready = parse_ready(line)
            if ready is not None:
                self.port, self.metrics_port = ready.port, ready.metrics_port or 0
                self.ready.set()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def wait_ready(self, timeout: float = 90) -> "Proc":
        ok = await asyncio.get_running_loop().run_in_executor(None, self.ready.wait, timeout)
        assert ok, f"worker not ready: {self.p.poll()} {self.lines}"
        return self

    async def wait_line(self, prefix: str, timeout: float = 30) -> None:
        for _ in range(int(timeout / 0.01)):
            if any(line.startswith(prefix) for line in self.lines):
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"no line {prefix!r}: {self.lines}")

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(10)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def procs(model):
    """Started together (their start-ups overlap): a decode worker and two prefill workers
    (all NIXL) whose "slow*" transfers hang: one to stop with SIGTERM, one to kill."""
    m = ["--model", str(model), *ENGINE_ARGS, "--transport", "nixl"]
    decode = Proc(["decode_service"], [*m, "--metrics-port", "0", "--min-remote-tokens", "16",
                                       "--prefill-timeout-seconds", "3",
                                       "--prefill-max-seconds", "3",
                                       "--quarantine-grace-seconds", "0.2"])
    prefills = [Proc(["tests.services.slow_prefill", seconds], m) for seconds in ("1.0", "60")]
    for p in (decode, *prefills):
        await p.wait_ready()
    yield decode, prefills
    for p in (decode, *prefills):
        p.stop()


async def health_status(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        resp = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5)
        return resp.status


async def test_processes_end_to_end_and_graceful_sigterm(procs, model):
    decode, (prefill, _) = procs
    client = Client(decode.address, prefill.address)
    try:
        for address in (decode.address, prefill.address):
            assert await health_status(address) == health_pb2.HealthCheckResponse.SERVING
        prompt = prompt_of(37, 1)
        res = await client.generate(prompt, prefill_address=prefill.address)
        assert res.output == hf_greedy(model, prompt, 8) and res.fin.timings.remote_prefill
        body = urllib.request.urlopen(
            f"http://127.0.0.1:{decode.metrics_port}/metrics", timeout=5).read().decode()
        assert "baton_ttft_seconds_count" in body and "baton_kv_received_bytes_total" in body
        assert "vllm:time_to_first_token_seconds_count{" in body
        assert (await client.stats()).metrics_port == decode.metrics_port  # /metrics/workers
        # SIGTERM while a transfer is in flight: prefill drains it, then exits cleanly.
        prompt2 = prompt_of(45, 2)
        task = asyncio.create_task(client.generate(prompt2, rid="slow-drain",
                                                   prefill_address=prefill.address))
        await prefill.wait_line("SENDING slow-drain@")
        prefill.p.send_signal(signal.SIGTERM)
        res2 = await task
        assert res2.output == hf_greedy(model, prompt2, 8) and res2.fin.timings.remote_prefill
        assert await asyncio.to_thread(prefill.p.wait, 30) == 0
        stats = await client.stats()
        assert stats.num_free_blocks == stats.num_total_blocks
    finally:
        await client.close()


async def test_prefill_killed_mid_transfer(procs, model):
    """Two decode workers wait on one prefill process's transfers when it is killed: the
    decode process (recompute) completes its request correctly, an in-process one under
    `fail` reports a clear error. Neither leaks: their pools are whole once the unconfirmed
    NIXL transfers' quarantine ends. SIGTERM then stops the decode process cleanly."""
    decode, (_, victim) = procs
    failing = await start_decode(model, "nixl", victim.address, on_prefill_failure="fail",
                                 quarantine_grace_seconds=0.2, prefill_timeout_seconds=3,
                                 prefill_max_seconds=3, abort_timeout_seconds=1,
                                 **FORCE_REMOTE)
    client, fclient = Client(decode.address), Client(failing.address)
    try:
        prompt = prompt_of(40, 3)
        task = asyncio.create_task(client.generate(prompt, rid="slow-kill",
                                                   prefill_address=victim.address))
        ftask = asyncio.create_task(fclient.generate(prompt_of(40, 4), rid="slow-fail"))
        await victim.wait_line("SENDING slow-kill@")
        await victim.wait_line("SENDING slow-fail@")
        victim.p.send_signal(signal.SIGKILL)
        res, fres = await task, await ftask
        assert res.output == hf_greedy(model, prompt, 8) and not res.fin.timings.remote_prefill
        assert fres.fin.finish_reason == common_pb2.FINISH_REASON_ERROR and not fres.output
        assert "Prefill call failed: UNAVAILABLE" in fres.fin.error
        await pools_whole(failing, timeout=10)
        for _ in range(200):
            stats = await client.stats()
            if stats.num_free_blocks == stats.num_total_blocks:
                break
            await asyncio.sleep(0.05)
        assert stats.num_free_blocks == stats.num_total_blocks and stats.num_waiting == 0
    finally:
        await client.close()
        await fclient.close()
        await failing.stop(drain_s=0)
    decode.p.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(decode.p.wait, 30) == 0
