"""A prefill worker process SIGKILLed in the middle of a KV pull (it was reading the decode
worker's blocks of the prompt's prefix: PrefillRequest.src_block_ids) and restarted on its
port (issue 27). The request is recomputed on decode with the right tokens, the decode
worker's src blocks stay held until the dead process's deadline (nobody can vouch that its
reads stopped), its pool is whole afterwards, and the restarted process serves the next
remote prefill: outcome ok, not a recompute.

    turn 1 ───────▶ prefill A (computes, sends)           decode holds turn 1's blocks
    restart ──────▶ prefill B (its pool is empty)
    turn 2 "slow" ▶ prefill B pulls turn 1's blocks ── SIGKILL mid-pull
                    decode: Prefill UNAVAILABLE, no Abort answer → recompute; the
                    blocks a READ may still touch are held until the deadline
    restart ──────▶ prefill C ◀── turn 3: ok on C
"""
from __future__ import annotations

import asyncio
import signal
import urllib.request

import pytest

from tests.load_helpers import free_port
from tests.reference import hf_greedy
from tests.restart_helpers import parse_samples, remote_outcomes
from tests.services.helpers import Client
from tests.services.test_processes import ENGINE_ARGS, Proc, prompt_of

pytestmark = [pytest.mark.slow, pytest.mark.asyncio]


def outcomes(decode: Proc) -> dict[str, float]:
    """The decode process's remote prefills by outcome (its own /metrics)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{decode.metrics_port}/metrics",
                                  timeout=5).read().decode()
    return remote_outcomes(parse_samples(text))


async def test_prefill_killed_mid_pull_then_restarted_serves_again(model):
    port = free_port()
    m = ["--model", str(model), *ENGINE_ARGS, "--transport", "nixl"]

    def prefill() -> Proc:  # slow_prefill: "slow*" transfers and pulls hang for 60 s
        return Proc(["tests.services.slow_prefill", "60"], [*m, "--port", str(port)])
    decode = Proc(["decode_service"], [*m, "--metrics-port", "0", "--min-remote-tokens", "16",
                                       "--prefill-timeout-seconds", "3",
                                       "--prefill-max-seconds", "3",
                                       "--quarantine-grace-seconds", "0.2"])
    procs = [decode, prefill()]
    client = None
    try:
        for p in procs:
            await p.wait_ready()
        address = f"127.0.0.1:{port}"
        client = Client(decode.address)
        turn1 = prompt_of(48, 11)
        first = await client.generate(turn1, prefill_address=address)
        assert first.fin.timings.remote_prefill
        procs[1].stop()  # prefill A goes; B starts with an empty pool
        procs.append(prefill())
        await procs[-1].wait_ready()

        turn2 = turn1 + first.output + prompt_of(20, 12)
        task = asyncio.create_task(client.generate(turn2, rid="slow-pull",
                                                   prefill_address=address))
        await procs[-1].wait_line("SENDING slow-pull@")  # the pull: ".../pull"
        assert any(line.endswith("/pull") for line in procs[-1].lines if "slow-pull" in line)
        procs[-1].p.send_signal(signal.SIGKILL)
        res = await task
        assert res.output == hf_greedy(model, turn2, 8) and not res.fin.timings.remote_prefill
        assert outcomes(decode)["recompute"] == 1

        procs.append(prefill())  # C, on the same port; nothing was sent while it was down
        await procs[-1].wait_ready()
        # the next remote prefill is ok on C (a request sent while the decode worker's
        # channel still waits out its reconnect backoff, ≤ 0.5 s, is prefilled here: no
        # remote prefill; bounded in count)
        for seed in range(13, 33):
            turn3 = prompt_of(40, seed)
            res = await client.generate(turn3, prefill_address=address)
            assert res.output == hf_greedy(model, turn3, 8)
            if res.fin.timings.remote_prefill or outcomes(decode)["recompute"] > 1:
                break
        assert res.fin.timings.remote_prefill
        assert outcomes(decode) == {**outcomes(decode), "ok": 2, "recompute": 1}
        for _ in range(200):  # the held src blocks come back at the deadline (3 s + 0.2 s)
            stats = await client.stats()
            if stats.num_free_blocks == stats.num_total_blocks:
                break
            await asyncio.sleep(0.05)
        assert stats.num_free_blocks == stats.num_total_blocks and not stats.num_waiting
    finally:
        if client is not None:
            await client.close()
        for p in procs:
            p.stop()
