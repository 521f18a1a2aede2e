"""Baton against vLLM's CPU build on the same model folder and cores, in one run (issue 24).

    python benchmarks/peer_vllm.py --vllm-python /tmp/vllm-venv/bin/python \
        [--model smollm2-135m] [--rounds 3] [--output peer-vllm.json]

Each round starts vLLM (baton/bench/vllm_server.py: PLATFORM.md's recipe, its OpenMP threads
bound to every core this process may use, from its own venv) and a default `baton up` in
turn, one server up at a time, the order alternating by round (vllm, baton / baton, vllm);
both get the same KV budget (--kv-bytes; Baton's per worker). On each, after an untimed
warm-up (short prompts, 8 streams, one long prompt):
  1. batch-1 ITL: one ~242-token prompt, greedy, 128 output tokens, `ignore_eos`; ITL =
     (last text chunk − first text chunk) / (usage.completion_tokens − 1)
     (benchmarks/peer_llamacpp.py's measure).
  2. cold TTFT: --ttft-requests prompts of ~1,000 tokens the server has never seen (a fresh
     tag first: no prefix-cache hit), one at a time, 4 output tokens each: first text chunk
     − request start; the median per round.
  3. 8 concurrent streams of distinct ~242-token prompts, 128 tokens each: output tok/s over
     the wall time from the first request to the last end.
Both get the same raw text on /v1/completions. Each side runs the dtype it would choose on
this machine (`--dtype auto`: bfloat16 on a CPU with AVX512_BF16 or AMX, else float32; vLLM is
given it explicitly): the CPU model and each side's dtype (Baton's from its GET /version) are
printed and saved. Prints the medians over rounds and the Baton/vLLM ratios against issue 24's
targets (ITL ≤ 0.6×, cold TTFT ≤ 1.0×, 8-stream output ≥ 1.5×) with the load average of every
measurement; writes every run to --output as JSON. --vllm-url / --baton-url measure servers
already running instead (nothing is started for that side).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path

import httpx

import peer_llamacpp as L  # noqa: E402 - this folder is sys.path[0]; it puts the repo on it too
from baton.bench import peer as P  # noqa: E402
from baton.bench.local import ServerSpec, running_server  # noqa: E402
from baton.bench.vllm_server import VllmSpec  # noqa: E402
from baton.dtypes import BF16_CPU_FLAGS, cpu_flags, resolve_dtype  # noqa: E402

SERVERS = ("vllm", "baton")


def cpu_model(path: str = "/proc/cpuinfo") -> str:
    """The first CPU's model name ("?" where there is none)."""
    with contextlib.suppress(OSError):
        for line in Path(path).read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "?"


async def run_ttft(client, server: L.Server, tag: str, a) -> dict:
    """Cold TTFT of ~1,000-token prompts never sent before, one at a time."""
    rs = []
    for i in range(a.ttft_requests):
        rs.append(await L.stream(client, server, P.base_prompt(f"{tag}/{i}", a.ttft_words), 4))
    ttfts = [(r.first - r.start) * 1e3 for r in rs if r.error is None and r.first]
    return {"cold_ttft_ms": P.median(ttfts) if len(ttfts) == len(rs) else None,
            "full": len(ttfts) == len(rs), "requests": list(map(L._brief, rs))}


MEASURES = {"itl": L.run_itl, "ttft": run_ttft, "streams": L.run_streams}


async def measure(server: L.Server, tag: str, a) -> list[dict]:
    """Warm up, then every measure of a.measures once on `server`."""
    runs = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0),
                                 limits=httpx.Limits(keepalive_expiry=1.0)) as client:
        await L.warm_up(client, server, a)
        await L.stream(client, server, P.base_prompt(f"warm-long-{tag}", a.ttft_words), 4)
        for name in a.measures:
            out = await MEASURES[name](client, server, f"{tag}-{name}", a)
            runs.append(out | {"measure": name, "server": server.name,
                               "loadavg": os.getloadavg()})
    return runs


def baton_dtype(url: str) -> str:
    """The dtypes Baton's workers serve in (GET /version's workers_dtype), comma-joined."""
    try:
        body = httpx.get(f"{url}/version", timeout=10).json()
        return ",".join(sorted(set(body.get("workers_dtype", {}).values()))) or "?"
    except (httpx.HTTPError, ValueError):
        return "?"


def spec_of(name: str, a) -> ServerSpec:
    if name == "vllm":
        return ServerSpec("vllm", kind="vllm", vllm=VllmSpec(a.vllm_python, a.vllm_dtype,
                                                             a.kv_bytes))
    return ServerSpec("baton", mode=a.baton_mode, extra_args=(
        "--kv-cache-memory-bytes", str(a.kv_bytes), *shlex.split(a.baton_args)))


def serving(name: str, a, log: Path):
    """The server `name` for one round: its URL if running, else started and stopped."""
    url = a.vllm_url if name == "vllm" else a.baton_url
    if url:
        return contextlib.nullcontext(url.rstrip("/"))
    return running_server(spec_of(name, a), a.model, log, a.startup_timeout)


def _line(out: dict, rnd: int) -> str:
    vals = " ".join(f"{k}={out[k]:.2f}" for k in P.VLLM_TARGETS if out.get(k) is not None)
    la = " ".join(f"{x:.2f}" for x in out["loadavg"])
    warn = "" if out["full"] else "  (INCOMPLETE: not every request gave its tokens)"
    return f"round {rnd} {out['measure']:8s} {out['server']:6s} {vals}  load {la}{warn}"


def run_rounds(a, out_dir: Path) -> tuple[list[dict], dict[str, str]]:
    """Every round's runs (with "round"), and each server's dtype as it served."""
    runs, dtypes = [], {}
    run_id = f"{time.time_ns() & 0xffffffff:08x}"
    for r in range(a.rounds):
        order = a.servers if r % 2 == 0 else a.servers[::-1]
        for name in order:
            with serving(name, a, out_dir / f"{name}-r{r}.log") as url:
                dtypes[name] = baton_dtype(url) if name == "baton" else (
                    spec_of(name, a).vllm.resolved_dtype if not a.vllm_url else a.vllm_dtype)
                server = L.Server(name, url, a.model, "baton" if name == "baton" else "openai")
                for out in asyncio.run(measure(server, f"{run_id}-r{r}", a)):
                    out["round"] = r
                    runs.append(out)
                    print(_line(out, r), flush=True)
    return runs, dtypes


def summary(runs: list[dict], server: str) -> dict:
    vals: dict[str, list] = {k: [] for k in P.VLLM_TARGETS}
    for run in runs:
        if run["server"] == server:
            for k in vals:
                vals[k].append(run.get(k))
    return P.summarize(vals)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-python", default=sys.executable,
                   help="the interpreter of vLLM's venv (vllm_server.py: how to install it)")
    p.add_argument("--vllm-url", default=None, help="a running vLLM (nothing started)")
    p.add_argument("--baton-url", default=None, help="a running Baton (nothing started)")
    p.add_argument("--vllm-dtype", default="auto", choices=("auto", "bfloat16", "float32"))
    p.add_argument("--baton-mode", default="disaggregated",
                   choices=("disaggregated", "colocated"))
    p.add_argument("--baton-args", default="", help="more `baton up` flags, one string")
    p.add_argument("--servers", default=",".join(SERVERS), help="vllm,baton or one of them")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--measures", default="itl,ttft,streams")
    p.add_argument("--prompt-words", type=int, default=211, help="~242 tokens with the tag")
    p.add_argument("--ttft-words", type=int, default=930, help="~1,000 tokens with the tag")
    p.add_argument("--ttft-requests", type=int, default=3)
    p.add_argument("--itl-tokens", type=int, default=128)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--kv-bytes", type=int, default=1 << 30, help="KV cache per server/worker")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--output", default="peer-vllm.json")
    a = p.parse_args(argv)
    a.measures = [m for m in a.measures.split(",") if m]
    a.servers = [s for s in a.servers.split(",") if s]
    bad = sorted(set(a.measures) - set(MEASURES)) + sorted(set(a.servers) - set(SERVERS))
    if bad:
        p.error(f"unknown measures or servers {bad}")
    return a


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    out = Path(a.output)
    log_dir = out.with_suffix(".logs")
    log_dir.mkdir(parents=True, exist_ok=True)
    cpu = cpu_model()
    bf16 = bool(cpu_flags() & BF16_CPU_FLAGS)
    print(f"CPU: {cpu} ({os.cpu_count()} cpus, AVX512_BF16/AMX {'yes' if bf16 else 'no'}: "
          f"--dtype auto = {resolve_dtype('auto', 'cpu')}); load at start {os.getloadavg()}",
          flush=True)
    runs, dtypes = run_rounds(a, log_dir)
    sums = {s: summary(runs, s) for s in a.servers}
    print(f"\nmedians over {a.rounds} rounds on {cpu}; dtypes {dtypes}; load now "
          f"{os.getloadavg()}")
    lines = P.table(sums.get("vllm", {}), sums.get("baton", {}), P.VLLM_TARGETS, "vllm")
    print("\n".join(lines))
    doc = {"command": " ".join(argv), "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
           "cpu": cpu, "cpus": os.cpu_count(), "cpu_bf16": bf16, "dtypes": dtypes,
           "args": vars(a), "servers": {s: asdict(spec_of(s, a)) for s in a.servers},
           "summary": sums, "table": lines, "runs": runs}
    out.write_text(json.dumps(doc, indent=1, default=str))
    print(f"wrote {out} (server logs in {log_dir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
