"""`baton bench agentx`: the same workloads, sent by the public AgentX harness instead of
Baton's client, so the number the AgentX leaderboard reports is one command here.

    baton bench agentx --agentx-venv /tmp/agentx-venv --url http://127.0.0.1:8000 \\
        --trace /work/shared/data/traces/mooncake_fast25/conversation_trace.jsonl.gz \\
        --concurrency 2 --duration 90
    baton bench compare --driver agentx --configs disaggregated,colocated --concurrency 4 ...

Steps: find the harness (agentx.py; a clear error with the install recipe when absent), load
the workload with Baton's loaders and scaling (default: the Mooncake conversation slice at 16
tokens per hash id), convert it to AgentX trace files (agentx_trace.py), run the harness once
per concurrency level against `--url` or a local cluster, and read its exports back
(agentx_results.py): the harness's own table (its definitions) and Baton's summary of the same
requests. Writes report.json, requests-c<C>.jsonl, agentx-trace/ and each level's harness
artifacts (harness-c<C>/) under --output.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from baton.bench.agentx import (
    OFFLINE_VARS,
    HarnessFailed,
    HarnessMissing,
    HarnessRun,
    find_harness,
    tokenizer_folder,
)
from baton.bench.agentx_results import HarnessSummary, read_records, read_summary
from baton.bench.agentx_trace import NotBlockTrace, write_trace_dir
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
from baton.bench.client import RequestRecord
from baton.bench.local import ServerStartError, running_server
from baton.bench.metrics import Slo, Summary, summarize
from baton.bench.report import (
    REPORT_VERSION,
    _fmt,
    _pct,
    console,
    default_output_dir,
    machine,
    print_metric_table,
    print_summary,
    typed_args,
    write_json,
    write_records,
)
from baton.bench.server_info import client_version, probe_server
from baton.bench.tokens import TokenCounter
from baton.bench.workload import Session, describe

# Block traces only; 16 tokens per hash id shrinks Mooncake's 512-token blocks to this CPU.
DEFAULTS = dict(workload="mooncake", block_tokens=16, max_context_tokens=4096)


def add_agentx_args(p: argparse.ArgumentParser) -> None:
    """Where the harness is and the few harness flags Baton sets."""
    g = p.add_argument_group("AgentX harness")
    g.add_argument("--agentx-bin", help="the harness's `agentx` binary")
    g.add_argument("--agentx-venv", help="a venv with agentx-harness (uses DIR/bin/agentx); "
                                         "default: $BATON_AGENTX, then agentx on PATH")
    g.add_argument("--agentx-min-turns", type=int, default=1,
                   help="convert only session trees with at least this many turns "
                        "(--max-sessions then counts the kept ones)")
    g.add_argument("--agentx-warmup-requests", type=int, default=2,
                   help="harness --warmup-requests-per-lane (its scenario default is 10)")
    g.add_argument("--agentx-arg", action="append", default=[], metavar="ARG",
                   help="one more harness argument, verbatim (repeat the flag)")
    g.add_argument("--agentx-startup", type=float, default=600.0,
                   help="seconds the harness may spend outside the measured window "
                        "(dataset build, warm-up)")


@dataclass
class AgentxLevel:
    """One harness run: Baton's summary of its requests and the harness's own aggregate."""

    concurrency: int
    records: list[RequestRecord]
    summary: Summary
    harness: HarnessSummary


def prepare(args, counter: TokenCounter, out: Path, need_harness: bool = True
            ) -> tuple[Path | None, list[Session], Path]:
    """The harness binary (None when not needed), the workload's sessions, the converted trace
    folder (out/agentx-trace).

    Raises SystemExit with the reason when the harness is absent or the workload does not
    convert (text traces), before any cluster is started.
    """
    binary = None
    if need_harness:
        try:
            binary = find_harness(args.agentx_bin, args.agentx_venv)
        except HarnessMissing as exc:
            raise SystemExit(f"[agentx] {exc}") from None
    if args.agentx_min_turns > 1:
        cut = args.max_sessions
        sessions = [s for s in load_workload(argparse.Namespace(**{**vars(args),
                                                                  "max_sessions": None}),
                                             counter)
                    if len(s.turns) >= args.agentx_min_turns][:cut]
    else:
        sessions = load_workload(args, counter)
    if not sessions:
        raise SystemExit("the workload is empty after scaling (raise --max-context-tokens?)")
    try:
        paths = write_trace_dir(sessions, args.model, out / "agentx-trace")
    except (NotBlockTrace, ValueError) as exc:
        raise SystemExit(f"[agentx] --workload {args.workload}: {exc}") from None
    print(f"[agentx] converted {len(sessions)} session trees "
          f"({sum(s.num_requests() for s in sessions)} requests) into {len(paths)} AgentX "
          f"trace files in {out / 'agentx-trace'}", flush=True)
    return binary, sessions, out / "agentx-trace"


def run_level(binary: Path, url: str, args, trace_dir: Path, out: Path, concurrency: int,
              name: str, duration_s: float | None = None) -> AgentxLevel:
    """One harness run against `url`; its artifacts in out/harness-<name>/.

    Raises HarnessFailed (see agentx.run_harness).
    """
    from baton.bench.agentx import run_harness

    run = HarnessRun(binary=binary, url=url, model=args.model,
                     tokenizer=tokenizer_folder(args.model, args.tokenizer),
                     trace_dir=trace_dir, artifact_dir=(out / f"harness-{name}").resolve(),
                     concurrency=concurrency, duration_s=duration_s or args.duration,
                     grace_s=args.grace, warmup_requests_per_lane=args.agentx_warmup_requests,
                     seed=args.seed or 42, extra=tuple(args.agentx_arg))
    artifacts = run_harness(run, out / f"harness-{name}.log", startup_s=args.agentx_startup)
    harness = read_summary(artifacts)
    records, end = read_records(artifacts)
    summary = summarize(records, 0.0, end, Slo(args.slo_ttft, args.slo_itl))
    # The session-tree bound is the harness's (Baton's own bound needs its prepared prompts).
    summary = replace(summary, prefix_hit_theoretical=harness.theoretical_hit_fraction,
                      prefix_hit_global=None)
    return AgentxLevel(concurrency, records, summary, harness)


def print_harness(labels: list[str], runs: list[HarnessSummary], title: str) -> None:
    """The harness's own numbers, one column per run (its definitions: ITL is per request)."""
    rows = [("requests", lambda h: str(h.requests)), ("errors", lambda h: str(h.errors))]
    for name, key in (("TTFT", "ttft"), ("ITL", "itl"), ("E2E", "e2e")):
        for p in ("p50", "p90", "p99"):
            rows.append((f"{name} {p} ms", lambda h, k=key, q=p: _fmt(getattr(getattr(h, k), q),
                                                                       1e3, 0)))
    rows += [("output tok/s", lambda h: _fmt(h.output_tokens_per_s)),
             ("input tok/s", lambda h: _fmt(h.input_tokens_per_s)),
             ("req/s", lambda h: _fmt(h.requests_per_s, digits=2)),
             ("cache read", lambda h: _pct(h.cache_read_fraction)),
             ("theoretical hit", lambda h: _pct(h.theoretical_hit_fraction))]
    print_metric_table(labels, runs, rows, title,
                       caption="harness definitions: ITL is per request")


def _ratio(ours: float | None, theirs: float | None) -> str:
    """Improvement factor for a latency: reference / ours (> 1 = better)."""
    return f"{theirs / ours:.2f}×" if ours and theirs else "-"


def print_harness_compare(rows: dict, title: str) -> None:
    """`baton bench compare --driver agentx`: the harness's numbers per configuration, and
    reference/ours for TTFT p50, TTFT p90 and ITL p90 (compare.Row objects, by name)."""
    from rich.table import Table

    table = Table(title=title, caption="AgentX harness definitions (ITL = per-request mean); "
                                       "× = reference / ours, > 1 is better")
    for col in ("config", "req", "err", "TTFT p50 ms", "TTFT p90 ms", "ITL p50 ms",
                "ITL p90 ms", "out tok/s", "cache read", "vs", "TTFT p50 ×", "TTFT p90 ×",
                "ITL p90 ×"):
        table.add_column(col, justify="left" if col in ("config", "vs") else "right")
    for row in rows.values():
        h = row.harness
        if h is None:
            continue
        ref = rows.get(row.reference) if row.reference else None
        r = ref.harness if ref is not None else None
        ratios = ([ref.name, _ratio(h.ttft.p50, r.ttft.p50), _ratio(h.ttft.p90, r.ttft.p90),
                   _ratio(h.itl.p90, r.itl.p90)] if r is not None else ["", "-", "-", "-"])
        table.add_row(row.name, str(h.requests), str(h.errors), _fmt(h.ttft.p50, 1e3, 0),
                      _fmt(h.ttft.p90, 1e3, 0), _fmt(h.itl.p50, 1e3, 0), _fmt(h.itl.p90, 1e3, 0),
                      _fmt(h.output_tokens_per_s), _pct(h.cache_read_fraction), *ratios)
    console().print(table)


def _parser() -> argparse.ArgumentParser:

    p = argparse.ArgumentParser(prog="baton bench agentx", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--url", help="a running gateway; without it a local cluster is started")
    p.add_argument("--convert-only", action="store_true",
                   help="write the AgentX trace folder under --output and print the harness "
                        "command line; run nothing (no harness needed)")
    add_cluster_args(p)
    add_agentx_args(p)
    add_workload_args(p)
    add_run_args(p)
    p.set_defaults(**DEFAULTS)
    return p


def main(argv: list[str] | None = None) -> int:

    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    levels = parse_levels(args.concurrency)
    out = args.output or default_output_dir()
    binary, sessions, trace_dir = prepare(args, counter_for(args), out,
                                          need_harness=not args.convert_only)
    if args.convert_only:
        run = HarnessRun(binary=Path("agentx"), url=args.url or "http://127.0.0.1:8000",
                         model=args.model, tokenizer=tokenizer_folder(args.model, args.tokenizer),
                         trace_dir=trace_dir.resolve(), artifact_dir=(out / "harness").resolve(),
                         concurrency=levels[0], duration_s=args.duration, grace_s=args.grace,
                         warmup_requests_per_lane=args.agentx_warmup_requests,
                         seed=args.seed or 42, extra=tuple(args.agentx_arg))
        unset = " ".join(f"-u {name}" for name in OFFLINE_VARS)
        print(f"[agentx] run it with HF offline variables unset:\n  env {unset} "
              + " ".join(run.argv()))
        return 0
    info = describe(args.workload, sessions, [f"sent by the AgentX harness ({binary})"])
    start = machine()
    spec = None if args.url else cluster_spec(args)
    runs: list[AgentxLevel] = []
    try:
        with (running_server(spec, args.model, out / "server.log", args.startup_timeout)
              if spec else contextlib.nullcontext(args.url.rstrip("/"))) as url:
            target = {"url": url, "model": args.model,
                      "server": spec.describe() if spec else None, "answers": probe_server(url)}
            for c in levels:
                runs.append(run_level(binary, url, args, trace_dir, out, c, f"c{c}"))
    except (ServerStartError, HarnessFailed) as exc:
        print(f"[agentx] {exc}", file=sys.stderr)
        return 1
    labels = [f"c={lv.concurrency}" for lv in runs]
    write_json(out / "report.json", {
        "version": REPORT_VERSION, "kind": "agentx",
        "created": dt.datetime.now().isoformat(timespec="seconds"),
        "command": "baton bench agentx " + " ".join(argv), "baton": client_version(),
        "machine": machine(start), "target": target,
        "workload": {**vars(info), "args": typed_args(args)},
        "levels": [{"concurrency": lv.concurrency, "harness": lv.harness.to_dict(),
                    "summary": lv.summary.to_dict()} for lv in runs]})
    for lv in runs:
        write_records(out / f"requests-c{lv.concurrency}.jsonl", lv.records)
    print_harness(labels, [lv.harness for lv in runs],
                  f"AgentX harness {runs[0].harness.version}: {info.name}")
    print_summary(labels, [lv.summary for lv in runs], f"Baton's summary: {info.name}")
    print(f"[agentx] wrote {out}/report.json")
    return 0
