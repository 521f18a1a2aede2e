"""`baton bench`: replay agent traffic against a gateway (or a local cluster it starts).

    baton bench --quick                              local cluster, small synthetic run (< 3 min)
    baton bench --url http://127.0.0.1:8000 --workload tau-bench --concurrency 1,2,4
    baton bench --workload mooncake --mode open --block-tokens 16 --time-scale 0.02
    baton bench compare [workload flags]             see compare.py
    baton bench agentx [workload flags]              the AgentX harness sends it (agentx_cli.py)
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import secrets
import sys
from pathlib import Path
from typing import NamedTuple

from baton.bench.args import (
    HelpFormatter,
    add_cluster_args,
    add_run_args,
    add_workload_args,
    cluster_spec,
    counter_for,
    load_workload,
    parse_levels,
)
from baton.bench.local import ServerStartError, running_server
from baton.bench.metrics import Slo, Summary, summarize
from baton.bench.plots import plot_cdfs, plot_tradeoff, plot_turns, plot_workers
from baton.bench.prepare import Preparer
from baton.bench.report import (
    REPORT_VERSION,
    default_output_dir,
    machine,
    print_summary,
    print_turns,
    typed_args,
    write_json,
    write_records,
)
from baton.bench.runner import RunConfig, RunResult, run_workload
from baton.bench.server_info import client_version, probe_server
from baton.bench.tokens import TokenCounter
from baton.bench.worker_poll import WorkerPoller, WorkerSeries
from baton.bench.workload import Session, describe

QUICK = dict(workload="synthetic", concurrency="2", duration=50.0, warmup=5.0, grace=5.0,
             synthetic_sessions=24, max_turns=5, max_output_tokens=16, block_tokens=16,
             time_scale=0.25, max_context_tokens=2048)


class Level(NamedTuple):
    """One concurrency level's run: its records, their summary, the workers' time series."""

    concurrency: int
    result: RunResult
    summary: Summary
    workers: WorkerSeries


async def measure(cfg: RunConfig, sessions: list[Session], preparer: Preparer
                  ) -> tuple[RunResult, WorkerSeries]:
    """One run, with the gateway's worker metrics polled beside it."""
    poller = WorkerPoller(cfg.url)
    polling = asyncio.create_task(poller.run())
    try:
        result = await run_workload(cfg, sessions, preparer)
    finally:
        poller.stop()
        await polling
    return result, poller.series(result.t0)


def run_levels(url: str, args, sessions: list[Session], counter: TokenCounter,
               levels: list[int], salt: str) -> list[Level]:
    """One run per concurrency level against `url`, each with its own cache-bust salt."""
    out = []
    for c in levels:
        cfg = RunConfig(url=url, model=args.model, mode=args.mode, concurrency=c,
                        duration_s=args.duration, warmup_s=args.warmup, grace_s=args.grace,
                        session_rate=args.session_rate, progress=not args.no_progress,
                        seed=args.seed, max_retries=args.max_retries)
        preparer = Preparer(counter, f"{salt}-c{c}", args.prompt_format, args.max_context_tokens)
        result, workers = asyncio.run(measure(cfg, sessions, preparer))
        out.append(Level(c, result, summarize(result.records, result.warmup_s, result.end_s,
                                              Slo(args.slo_ttft, args.slo_itl)), workers))
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="baton bench", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--url", help="a running gateway; without it a local cluster is started")
    p.add_argument("--quick", action="store_true", help="small local run, under 3 minutes")
    add_cluster_args(p)
    add_workload_args(p)
    add_run_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "compare":
        from baton.bench.compare import main as compare_main
        return compare_main(argv[1:])
    if argv and argv[0] == "agentx":
        from baton.bench.agentx_cli import main as agentx_main
        return agentx_main(argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    if args.quick:
        parser.set_defaults(**QUICK)
        args = parser.parse_args(argv)
    levels = parse_levels(args.concurrency)
    out = args.output or default_output_dir()
    counter = counter_for(args)
    sessions = load_workload(args, counter)
    if not sessions:
        raise SystemExit("the workload is empty after scaling (raise --max-context-tokens?)")
    info = describe(args.workload, sessions)
    print(f"[bench] {info.name}: {info.sessions} sessions, {info.requests} requests "
          f"({'chars/4 estimate' if counter.approximate else 'model tokenizer'})", flush=True)
    salt = secrets.token_hex(4)
    start = machine()
    spec = None if args.url else cluster_spec(args)
    try:
        with (running_server(spec, args.model, out / "server.log", args.startup_timeout)
              if spec else contextlib.nullcontext(args.url.rstrip("/"))) as url:
            target = {"url": url, "model": args.model,
                      "server": spec.describe() if spec else None,
                      "answers": probe_server(url)}
            results = run_levels(url, args, sessions, counter, levels, salt)
    except ServerStartError as exc:
        print(f"[bench] {exc}", file=sys.stderr)
        return 1
    write_outputs(out, args, argv, target, info, results, start)
    return 0


def run_title(args, target: dict) -> str:
    """The run's configuration in one line, for the plots' titles."""
    server = target["server"]["name"] if target.get("server") else target["url"]
    return (f"{args.workload} · {args.mode} loop · concurrency {args.concurrency} · "
            f"{args.duration:g} s per level · {server}")


def write_outputs(out: Path, args, argv: list[str], target: dict, info,
                  results: list[Level], start: dict) -> None:
    """report.json, the per-request records, the plots and the printed tables."""
    labels = [f"c={lv.concurrency}" for lv in results]
    report = {
        "version": REPORT_VERSION, "created": dt.datetime.now().isoformat(timespec="seconds"),
        "command": "baton bench " + " ".join(argv), "baton": client_version(),
        "machine": machine(start),
        "target": target,
        "workload": {**vars(info), "args": typed_args(args)},
        "slo": {"ttft_s": args.slo_ttft, "itl_s": args.slo_itl},
        "levels": [{"concurrency": lv.concurrency,
                    "sessions_started": lv.result.sessions_started,
                    "sessions_finished": lv.result.sessions_finished,
                    "summary": lv.summary.to_dict(), "workers": lv.workers.to_dict()}
                   for lv in results],
    }
    write_json(out / "report.json", report)
    for lv in results:
        write_records(out / f"requests-c{lv.concurrency}.jsonl", lv.result.records)
    if not args.no_plots:
        write_plots(out, args, run_title(args, target), labels, results)
    print_summary(labels, [lv.summary for lv in results],
                  f"baton bench: {info.name}, {args.mode} loop, {args.duration:g} s per level")
    print_turns(labels, [lv.summary for lv in results])
    for label, lv in zip(labels, results):
        w = lv.workers
        print(f"[bench] {label} workers: " + (f"{len(w.workers)} polled {w.polls} times"
                                              if w.available else w.note), flush=True)
        held = w.counter_delta("recomputed_held")
        if held is not None:
            tier = w.counter_delta("tier_recomputed_blocks")
            print(f"[bench] {label} tokens recomputed although held: {held}"
                  + (f" (tier blocks recomputed: {tier})" if tier is not None else ""),
                  flush=True)
    print(f"[bench] wrote {out}/report.json")


def write_plots(out: Path, args, title: str, labels: list[str], results: list[Level]) -> None:
    """Every PNG of the run (see plots.py); the worker plots only where there is a series."""
    slo = Slo(args.slo_ttft, args.slo_itl)
    plot_cdfs(out / "latency_cdf.png", {lab: lv.result.records for lab, lv in
                                        zip(labels, results)}, args.warmup, title, slo)
    plot_turns(out / "ttft_by_turn.png", {lab: lv.summary.by_turn for lab, lv in
                                          zip(labels, results)}, title, slo)
    if len(results) > 1:
        plot_tradeoff(out / "throughput_vs_interactivity.png",
                      {lab: lv.summary for lab, lv in zip(labels, results)}, title)
    for label, lv in zip(labels, results):
        if lv.workers.workers:
            plot_workers(out / f"workers-c{lv.concurrency}.png", lv.workers,
                         f"{title} · {label}")
