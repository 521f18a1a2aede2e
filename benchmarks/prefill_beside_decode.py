"""Prompts prefilled beside running decodes: TTFT of fresh prompts and the ITL of the streams
they interrupt, on several `baton up` configurations started in turn (A B A B ...).

    python benchmarks/prefill_beside_decode.py [--configs "default|;colocated|--mode colocated"]
                                               [--rounds 2] [--prompts 25] [--streams 3]
                                               [--prompt-words 380] [--port 8610]

Each configuration is `name|baton up flags` (the first is the reference). Per round and
configuration: start `baton up` on the default model, warm it with a few streams, then run
`--streams` chat streams of 200 tokens each (ignore_eos, restarted as they end) while one
client sends `--prompts` fresh prompts of `--prompt-words` random words (no prefix hit, the
same prompts for every configuration in a round) one after the other, 0.3 s apart, with
max_tokens 2. It prints per run: TTFT p50/p90 of those prompts (request sent → first content
chunk), ITL p50/p90/p99 of the streams (gaps between content chunks, so a step that holds a
prompt's prefill shows as one long gap), the load average at start; then each
configuration's medians over the rounds and their ratio to the reference's.

Why: on one host the default cluster (a prefill and a decode worker sharing the cores,
`--pin share`) prefills these prompts on the decode worker, as colocated serving does, yet
its TTFT and ITL trailed `--mode colocated` (BENCHMARKS.md, ninth pass); this isolates the
turns where a prefill runs beside decodes from a whole agent replay.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi "
         "rho sigma tau upsilon").split()


def quantile(xs: list[float], q: float) -> float:
    """The q-quantile of xs by nearest rank below (ms in, ms out); nan when empty."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[int(q * (len(s) - 1))]


async def stream_forever(c: httpx.AsyncClient, url: str, i: int, stop: asyncio.Event,
                         gaps: list[float]) -> None:
    """Chat streams of 200 tokens one after another until `stop`; appends ms between chunks."""
    while not stop.is_set():
        body = {"model": "smollm2-135m", "stream": True, "max_tokens": 200, "ignore_eos": True,
                "messages": [{"role": "user", "content": f"Story {i} {random.random()}: go on."}]}
        last = None
        async with c.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    now = time.monotonic()
                    if last is not None:
                        gaps.append((now - last) * 1e3)
                    last = now


async def first_content_ms(c: httpx.AsyncClient, url: str, text: str) -> float:
    """ms from sending a streamed chat request to its first content chunk."""
    body = {"model": "smollm2-135m", "stream": True, "max_tokens": 2,
            "messages": [{"role": "user", "content": text}]}
    t0 = time.monotonic()
    async with c.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"content":"' in line:
                return (time.monotonic() - t0) * 1e3
    raise RuntimeError("no content chunk")


async def load(url: str, a: argparse.Namespace, seed: int) -> dict[str, float]:
    """The measured workload against a ready gateway at `url`."""
    rng, stop, gaps = random.Random(seed), asyncio.Event(), []
    async with httpx.AsyncClient() as c:
        bg = [asyncio.create_task(stream_forever(c, url, i, stop, gaps))
              for i in range(a.streams)]
        await asyncio.sleep(3.0)
        gaps.clear()
        ttfts = []
        for k in range(a.prompts):
            words = " ".join(rng.choice(WORDS) for _ in range(a.prompt_words))
            ttfts.append(await first_content_ms(c, url, f"{seed} {k} {words}"))
            await asyncio.sleep(0.3)
        stop.set()
        await asyncio.gather(*bg)
    return {"ttft_p50": quantile(ttfts, .5), "ttft_p90": quantile(ttfts, .9),
            "itl_p50": quantile(gaps, .5), "itl_p90": quantile(gaps, .9),
            "itl_p99": quantile(gaps, .99)}


def run_config(flags: str, a: argparse.Namespace, seed: int) -> dict[str, float]:
    """Start `baton up FLAGS`, warm it, measure, stop it (SIGINT, then wait)."""
    cmd = [sys.executable, "-m", "baton.cli", "up", "--model", "smollm2-135m",
           "--port", str(a.port), *flags.split()]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + 300
        for line in proc.stdout:
            if "ready:" in line:
                break
            if time.monotonic() > deadline:
                raise RuntimeError("baton up did not get ready in 300 s")
        else:
            raise RuntimeError(f"baton up exited ({proc.wait()})")
        url = f"http://127.0.0.1:{a.port}"
        asyncio.run(warm(url))
        return asyncio.run(load(url, a, seed))
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


async def warm(url: str) -> None:
    """Four short streams: the first steps of every kind, before anything is timed."""
    stop, gaps = asyncio.Event(), []
    async with httpx.AsyncClient() as c:
        tasks = [asyncio.create_task(stream_forever(c, url, i, stop, gaps)) for i in range(4)]
        await asyncio.sleep(5.0)
        stop.set()
        await asyncio.gather(*tasks)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="default|;colocated|--mode colocated")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prompts", type=int, default=25)
    p.add_argument("--streams", type=int, default=3)
    p.add_argument("--prompt-words", type=int, default=380)
    p.add_argument("--port", type=int, default=8610)
    a = p.parse_args()
    configs = [c.split("|", 1) for c in a.configs.split(";")]
    keys = ("ttft_p50", "ttft_p90", "itl_p50", "itl_p90", "itl_p99")
    results: dict[str, list[dict[str, float]]] = {name: [] for name, _ in configs}
    for r in range(1, a.rounds + 1):
        for name, flags in configs:
            la = os.getloadavg()[0]
            res = run_config(flags, a, seed=r)
            results[name].append(res)
            print(f"{name:>14} round {r} (load {la:.2f}): " +
                  "  ".join(f"{k} {res[k]:.1f}" for k in keys) + " ms", flush=True)
    ref = configs[0][0]
    med = {n: {k: statistics.median(x[k] for x in rs) for k in keys} for n, rs in results.items()}
    print("medians over rounds (ms), ratio to", ref)
    for name, m in med.items():
        print(f"{name:>14}: " + "  ".join(
            f"{k} {m[k]:.1f} ({m[k] / med[ref][k]:.2f}x)" for k in keys))


if __name__ == "__main__":
    main()
