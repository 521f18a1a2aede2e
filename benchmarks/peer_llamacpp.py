"""Baton against a peer OpenAI-compatible server (llama.cpp's llama-server) in one run (issue 17).

    python benchmarks/peer_llamacpp.py --peer-url http://127.0.0.1:8081 \
        [--baton-url http://127.0.0.1:8000]  [--rounds 3] [--output peer-run.json]

Without --baton-url a colocated cluster is started for the run (`baton up --mode colocated
--threads 1 --num-decode 1`, a small KV pool) and stopped after. Per round, each measurement
runs on both servers back to back, the order alternating by round (peer, baton / baton, peer):
  1. batch-1 ITL: one ~242-token prompt, greedy, 128 output tokens, `ignore_eos`; ITL =
     (last text chunk − first text chunk) / (usage.completion_tokens − 1). A run that did not
     produce all 128 tokens is flagged.
  2. 8 concurrent streams of distinct ~242-token prompts, 128 tokens each: output tok/s over
     the wall time from the first request to the last end.
  3. agentic: 4 sessions × 6 turns at once, each session closed-loop; turn k = turn k−1's
     prompt + its reply + a synthetic tool result (baton/bench/peer.py). TTFT p50/p90 over all
     turns. Prefix reuse: Baton gets `X-Session-ID`; llama-server `cache_prompt: true` and the
     session's own slot (`id_slot`, with `-np` ≥ sessions).
Both servers get the same raw text on /v1/completions (no chat template can differ). Prints
the medians over rounds, Baton/peer ratios against the targets, and the load average with every
measurement; writes every run to --output as JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402

from baton.bench import peer as P  # noqa: E402


@dataclass(frozen=True)
class Server:
    name: str
    url: str
    model: str
    kind: str  # "baton" | "llamacpp" | "openai"

    def body(self, prompt: str, max_tokens: int, session: int | None) -> dict:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0.0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        if self.kind == "llamacpp":
            body["cache_prompt"] = True
            if session is not None:
                body["id_slot"] = session
        return body

    def headers(self, session: int | None, tag: str) -> dict:
        return {} if session is None else {"X-Session-ID": f"{tag}-s{session}"}


@dataclass
class Result:
    start: float
    first: float | None = None
    last: float | None = None
    end: float | None = None
    chunks: int = 0
    tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    text: str = ""
    error: str | None = None


def _take(res: Result, chunk: dict) -> None:
    text = "".join(c.get("text") or "" for c in chunk.get("choices") or [])
    if text:
        res.last = time.perf_counter()
        res.first = res.first or res.last
        res.chunks += 1
        res.text += text
    usage = chunk.get("usage") or {}
    if usage.get("completion_tokens") is not None:
        res.tokens = int(usage["completion_tokens"])
        res.prompt_tokens = usage.get("prompt_tokens")
        res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    elif chunk.get("timings"):  # llama-server's own counters, if usage is missing
        res.tokens = res.tokens or int(chunk["timings"].get("predicted_n") or 0)


async def stream(client: httpx.AsyncClient, server: Server, prompt: str, max_tokens: int,
                 session: int | None = None, tag: str = "") -> Result:
    """POST one streamed completion; errors land in `Result.error`. A keep-alive connection
    the server closed just as it was reused (no response at all) is retried once, fresh."""
    res = await _stream(client, server, prompt, max_tokens, session, tag)
    if res.error and res.error.startswith("RemoteProtocolError") and res.first is None:
        res = await _stream(client, server, prompt, max_tokens, session, tag)
    return res


async def _stream(client, server: Server, prompt: str, max_tokens: int, session: int | None,
                  tag: str) -> Result:
    res = Result(start=time.perf_counter())
    try:
        async with client.stream("POST", f"{server.url}/v1/completions",
                                 json=server.body(prompt, max_tokens, session),
                                 headers=server.headers(session, tag)) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
            async for line in r.aiter_lines():
                if line.startswith("data:") and line[5:].strip() != "[DONE]":
                    _take(res, json.loads(line[5:]))
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
    res.end = time.perf_counter()
    res.tokens = res.tokens or res.chunks
    return res


def _brief(res: Result) -> dict:
    d = asdict(res)
    d["text"] = d["text"][:80]
    return d


async def run_itl(client, server: Server, tag: str, a) -> dict:
    res = await stream(client, server, P.base_prompt(tag, a.prompt_words), a.itl_tokens)
    itl = P.decode_itl(res.first or 0, res.last or 0, res.tokens)
    return {"itl_ms": None if itl is None else itl * 1e3, "full": res.tokens == a.itl_tokens,
            "requests": [_brief(res)]}


async def run_streams(client, server: Server, tag: str, a) -> dict:
    prompts = [P.base_prompt(f"{tag}/{i}", a.prompt_words) for i in range(a.streams)]
    rs = await asyncio.gather(*(stream(client, server, p, a.itl_tokens) for p in prompts))
    ok = [r for r in rs if r.error is None]
    tps = P.throughput([r.start for r in ok], [r.end for r in ok], [r.tokens for r in ok])
    return {"streams_tok_s": tps if len(ok) == len(rs) else None,
            "full": all(r.tokens == a.itl_tokens for r in rs), "requests": list(map(_brief, rs))}


async def _session(client, server: Server, s: P.AgenticSession, a, out: list[Result]) -> None:
    for _ in range(a.turns):
        res = await stream(client, server, s.prompt, a.turn_tokens, s.index, s.tag)
        out.append(res)
        if res.error:
            return
        s.add_reply(res.text)


async def run_agentic(client, server: Server, tag: str, a) -> dict:
    sessions = [P.AgenticSession(tag, i, a.prompt_words, a.tool_words) for i in range(a.sessions)]
    rs: list[Result] = []
    await asyncio.gather(*(_session(client, server, s, a, rs) for s in sessions))
    ttfts = [(r.first - r.start) * 1e3 for r in rs if r.error is None and r.first]
    errors = sum(r.error is not None for r in rs)
    return {"agentic_ttft_p50_ms": P.percentile(ttfts, 50) if not errors else None,
            "agentic_ttft_p90_ms": P.percentile(ttfts, 90) if not errors else None,
            "full": len(rs) == a.sessions * a.turns and not errors,
            "requests": list(map(_brief, rs))}


MEASURES = {"itl": run_itl, "streams": run_streams, "agentic": run_agentic}


async def warm_up(client, server: Server, a) -> None:
    """Untimed: first use builds kernels, compiles graphs, fills allocators."""
    await stream(client, server, P.base_prompt(f"warm-{server.name}", a.prompt_words), 16)
    await asyncio.gather(*(stream(client, server, P.base_prompt(f"warm{i}", 64), 8)
                           for i in range(a.streams)))


async def run_all(servers: list[Server], a) -> list[dict]:
    runs = []
    limits = httpx.Limits(keepalive_expiry=1.0)  # under llama-server's 5 s keep-alive
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        for s in servers:
            await warm_up(client, s, a)
        run_id = f"{time.time_ns() & 0xffffffff:08x}"
        for r in range(a.rounds):
            for name in a.measures:
                order = servers if r % 2 == 0 else servers[::-1]
                for s in order:
                    out = await MEASURES[name](client, s, f"{run_id}-r{r}-{name}", a)
                    out |= {"round": r, "measure": name, "server": s.name,
                            "loadavg": os.getloadavg()}
                    runs.append(out)
                    print(_line(out), flush=True)
    return runs


def _line(out: dict) -> str:
    vals = " ".join(f"{k}={v:.2f}" for k, v in out.items()
                    if k in P.TARGETS and v is not None)
    la = " ".join(f"{x:.2f}" for x in out["loadavg"])
    warn = "" if out["full"] else "  (INCOMPLETE: not every request gave its tokens)"
    return f"round {out['round']} {out['measure']:8s} {out['server']:6s} {vals}  load {la}{warn}"


def summary(runs: list[dict], server: str) -> dict:
    vals: dict[str, list[float]] = {k: [] for k in P.TARGETS}
    for run in runs:
        if run["server"] == server:
            for k in vals:
                if run.get(k) is not None:
                    vals[k].append(run[k])
    return P.summarize(vals)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--peer-url", required=True, help="OpenAI-compatible base URL (no /v1)")
    p.add_argument("--peer-kind", choices=["llamacpp", "openai"], default="llamacpp",
                   help="llamacpp: also send cache_prompt and id_slot (session affinity)")
    p.add_argument("--baton-url", default=None, help="a running Baton (default: start one)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--measures", default="itl,streams,agentic")
    p.add_argument("--prompt-words", type=int, default=211, help="~242 tokens with the tag")
    p.add_argument("--itl-tokens", type=int, default=128)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--sessions", type=int, default=4)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--turn-tokens", type=int, default=32, help="reply tokens per agentic turn")
    p.add_argument("--tool-words", type=int, default=250, help="synthetic tool result words")
    p.add_argument("--threads", type=int, default=1, help="started Baton: threads per worker")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=512 << 20)
    p.add_argument("--output", default="peer-run.json")
    a = p.parse_args(argv)
    a.measures = [m for m in a.measures.split(",") if m]
    return a


def _report(a, servers: list[Server], runs: list[dict], argv: list[str]) -> None:
    sums = {s.name: summary(runs, s.name) for s in servers}
    lines = P.table(sums["peer"], sums["baton"])
    print(f"\nmedians over {a.rounds} rounds; load now {os.getloadavg()}")
    print("\n".join(lines))
    prompt_tokens = {s.name: sorted({q["prompt_tokens"] for run in runs for q in run["requests"]
                                     if run["server"] == s.name and run["measure"] == "itl"})
                     for s in servers}
    print(f"ITL prompt tokens per server (should match): {prompt_tokens}")
    doc = {"command": " ".join(argv), "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
           "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
           "args": vars(a), "servers": [asdict(s) for s in servers], "summary": sums,
           "table": lines, "runs": runs}
    Path(a.output).write_text(json.dumps(doc, indent=1))
    print(f"wrote {a.output}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    peer = Server("peer", a.peer_url.rstrip("/"), a.model, a.peer_kind)

    def go(baton_url: str) -> None:
        servers = [peer, Server("baton", baton_url.rstrip("/"), a.model, "baton")]
        print(f"load at start {os.getloadavg()}", flush=True)
        _report(a, servers, asyncio.run(run_all(servers, a)), argv)

    if a.baton_url:
        go(a.baton_url)
        return 0
    from baton.bench.local import ServerSpec, running_server
    spec = ServerSpec(name="baton", mode="colocated", num_decode=1, extra_args=(
        "--threads", str(a.threads), "--kv-cache-memory-bytes", str(a.kv_cache_memory_bytes)))
    with running_server(spec, a.model, Path(a.output).with_suffix(".baton.log")) as url:
        go(url)
    return 0


if __name__ == "__main__":
    sys.exit(main())
