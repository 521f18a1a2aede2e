"""`baton bench compare`: the same workload on several configurations, one table with ratios.

Each configuration is started in turn (a local cluster via `baton up`, or the transformers
baseline), replayed with the same sessions and seed at the first `--concurrency` level, and
stopped. Configurations and the reference each is compared with:

    disaggregated   1 prefill + 1 decode worker, session routing, the two     vs colocated
                    sharing the cores per step (`baton up --pin share`: each
                    takes the cores the other leaves idle; `--pin split` pinned
                    them to disjoint halves before 2026-12-01)
    colocated       one worker doing both, unpinned, with all cores (--threads 2) (reference)
    session         2 colocated workers, session routing                      vs round-robin
    kv              2 colocated workers, KV-overlap routing                   vs round-robin
    round-robin     2 colocated workers, round-robin                          (reference)
    tiers           one colocated worker (--threads 2), a small pool           vs no-tiers
                    (`--tier-num-blocks`) over a host-memory KV tier
                    (`--tier-host-bytes`): evicted session prefixes are loaded back
    no-tiers        the same worker and pool, no tier: evicted prefixes recomputed (reference)
    admission       disaggregated, the gateway rejecting (429 + Retry-After)   vs disaggregated
                    requests predicted to miss the TTFT SLO (`--slo-ttft`, the same SLO
                    goodput is judged by): compare goodput under an overload burst
    spec            colocated with speculative decoding (suffix drafts from    vs colocated
                    the session and recent outputs, verified in the decode step)
    spec-disaggregated  disaggregated, the decode worker speculating           vs disaggregated
    spec-synthetic  BENCHMARK ONLY: spec with each draft position kept at     vs colocated
                    0.7^i whatever the model says (outputs are not the model's; for
                    synthetic prompts, e.g. AgentX, where real drafts rarely match)
    hf              plain transformers, one request at a time, on a short slice
                    (`--baseline-sessions`, `--baseline-duration`); the first Baton
                    configuration is rerun on the same slice as "baton-slice", vs hf.
    vllm            vLLM's CPU build on the same model folder and cores, from its own venv
                    (`--vllm-python`), in the machine's dtype (`--vllm-dtype auto`:
                    bfloat16 with AVX512_BF16/AMX, else float32, as Baton's `--dtype auto`);
                    compare Baton with it by `--reference vllm`
    vllm-pd         the same vLLM as a prefill and a decode server on the     vs vllm
                    same cores, joined by its NixlConnector behind the proxy of its
                    NIXL tests (bench/vllm_pd.py): the peer's own P/D on this host

The routing configurations use colocated workers (`--routing-workers`, default 2; each
prefills its own requests, pinned to the CPUs in turn) with the same bounded KV pool per worker (`--routing-num-blocks`, 640 blocks of 16
tokens by default): a request routed away from the worker holding its session's prefix must
recompute it, and round-robin, which spreads every session over every worker, needs every
worker to hold every session (bounded memory: LRU thrash) where session/KV routing needs
each to hold only its own. With a prefill worker in front instead, a routing miss costs only
a KV pull from the prefill worker's cache, so routing barely shows there.

Ratios are improvement factors (> 1 = better than the reference): reference / value for
latencies, value / reference for throughput. `--reference NAME` compares every other row with
configuration NAME instead. `--urls name=URL,...` compares servers that are already running
instead of starting them (e.g. `--urls vllm=http://127.0.0.1:8001,baton=http://127.0.0.1:8000
--reference vllm`).

`--driver agentx` sends the workload with the public AgentX harness instead of Baton's client
(agentx_cli.py: block traces only, converted once, one harness run per configuration); the
harness's own numbers get a second table with their ratios (TTFT p50/p90, ITL p90).

`--rounds N` runs the whole set N times, the order reversed every other round (on one machine
the order moves the result as much as a configuration does; compare_rounds.py): each round
writes its own folder round-<r>/, and rounds.json and a last table give every configuration's
numbers per round and the rounds it beat its reference in.

Beside report.json and each configuration's requests-<name>.jsonl, the output folder keeps
metrics-<name>.txt: the server's Prometheus text when its run ended (a gateway's /metrics and
/metrics/workers: P/D decisions and their reasons, preemptions, cache hits).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import secrets
from dataclasses import dataclass
from pathlib import Path

from baton.bench import compare_rounds as rounds_mod
from baton.bench.agentx import HarnessFailed
from baton.bench.agentx_cli import add_agentx_args, prepare, print_harness_compare, run_level
from baton.bench.args import (
    HelpFormatter,
    add_run_args,
    add_workload_args,
    counter_for,
    load_workload,
)
from baton.bench.client import RequestRecord
from baton.bench.configs import (
    CONFIGS,
    ROUTING_NUM_BLOCKS,
    TIER_HOST_BYTES,
    TIER_NUM_BLOCKS,
    add_vllm_args,
    reference_of,
    spec_for,
    vllm_spec,
)
from baton.bench.local import ServerSpec, ServerStartError, running_server
from baton.bench.metrics import Slo, Summary, summarize
from baton.bench.plots import plot_cdfs
from baton.bench.prepare import Preparer
from baton.bench.report import (
    REPORT_VERSION,
    _fmt,
    console,
    default_output_dir,
    machine,
    print_summary,
    typed_args,
    write_json,
    write_records,
)
from baton.bench.runner import RunConfig, run_workload
from baton.bench.server_info import client_version, probe_server, save_metrics
from baton.bench.workload import Session, describe

SLICE = "baton-slice"


@dataclass
class Row:
    name: str
    reference: str | None
    summary: Summary
    records: list[RequestRecord]
    server: dict | None
    answers: dict | None = None     # the server's GET /version and /v1/models (server_info)
    harness: object | None = None   # agentx_results.HarnessSummary under --driver agentx


def _run(url: str, args, sessions: list[Session], counter, salt: str, duration: float,
         warmup: float) -> tuple:
    cfg = RunConfig(url=url, model=args.model, mode=args.mode,
                    concurrency=int(str(args.concurrency).split(",")[0]), duration_s=duration,
                    warmup_s=min(warmup, duration / 2), grace_s=args.grace,
                    session_rate=args.session_rate, progress=not args.no_progress,
                    seed=args.seed, max_retries=args.max_retries)
    preparer = Preparer(counter, salt, args.prompt_format, args.max_context_tokens)
    result = asyncio.run(run_workload(cfg, sessions, preparer))
    return result.records, summarize(result.records, cfg.warmup_s, result.end_s,
                                     Slo(args.slo_ttft, args.slo_itl))


def ratio_cells(row: Row, rows: dict[str, Row]) -> list[str]:
    """p90 TTFT ×, p99 ITL ×, output tokens/s × against the row's reference."""
    ref = rows.get(row.reference) if row.reference else None
    if ref is None:
        return ["", "-", "-", "-"]
    s, r = row.summary, ref.summary

    def better(ours, theirs, lower_is_better=True):
        if not ours or not theirs:
            return "-"
        return f"{(theirs / ours) if lower_is_better else (ours / theirs):.2f}×"

    return [ref.name, better(s.ttft.p90, r.ttft.p90), better(s.itl.p99, r.itl.p99),
            better(s.output_tokens_per_s, r.output_tokens_per_s, lower_is_better=False)]


def print_table(rows: dict[str, Row], title: str) -> None:
    from rich.table import Table

    table = Table(title=title, caption="× = improvement over the reference (> 1 is better)")
    for col in ("config", "TTFT p90 ms", "ITL p99 ms", "TPOT p50 ms", "out tok/s", "req/s",
                "prefix hit", "errors", "vs", "p90 TTFT ×", "p99 ITL ×", "tok/s ×"):
        table.add_column(col, justify="left" if col in ("config", "vs") else "right")
    for row in rows.values():
        s = row.summary
        table.add_row(row.name, _fmt(s.ttft.p90, 1e3, 0), _fmt(s.itl.p99, 1e3, 0),
                      _fmt(s.tpot.p50, 1e3, 0), _fmt(s.output_tokens_per_s),
                      _fmt(s.requests_per_s, digits=2), _fmt(s.prefix_hit_actual, 100, 1, "%"),
                      str(s.errors), *ratio_cells(row, rows))
    console().print(table)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="baton bench compare", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--configs", default="disaggregated,colocated,session,kv,round-robin,hf",
                   help=f"comma list of {','.join(CONFIGS)}")
    p.add_argument("--urls", help="name=URL,... of running servers (nothing is started)")
    p.add_argument("--baseline-sessions", type=int, default=4,
                   help="sessions the transformers baseline (hf) replays")
    p.add_argument("--baseline-duration", type=float, default=120.0,
                   help="seconds of the transformers baseline run")
    p.add_argument("--startup-timeout", type=float, default=600.0,
                   help="seconds each configuration's cluster may take to become ready")
    p.add_argument("--routing-num-blocks", type=int, default=ROUTING_NUM_BLOCKS,
                   help="KV blocks per worker in the routing configurations (same for all)")
    p.add_argument("--routing-workers", type=int, default=2,
                   help="colocated workers in the routing configurations (more than the "
                        "cores share them: pinned in turn)")
    p.add_argument("--tier-num-blocks", type=int, default=TIER_NUM_BLOCKS,
                   help="KV blocks of the worker in the tiers / no-tiers configurations: "
                        "a fraction of the live sessions' KV, so prefixes are evicted")
    p.add_argument("--tier-host-bytes", type=int, default=TIER_HOST_BYTES,
                   help="host-memory tier of the tiers configuration (bytes)")
    p.add_argument("--reference", default=None,
                   help="compare every other configuration with this one (e.g. vllm) "
                        "instead of each one's own reference")
    p.add_argument("--driver", choices=("baton", "agentx"), default="baton",
                   help="who sends the workload: Baton's client or the AgentX harness")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every configuration this many times, the order reversed every "
                        "other round; prints each one's numbers per round and the rounds it "
                        "beat its reference (compare_rounds.py)")
    add_vllm_args(p)
    add_agentx_args(p)
    add_workload_args(p)
    add_run_args(p)
    return p


def _targets(args) -> list[tuple[str, ServerSpec | None, str | None]]:
    """(name, spec to start or None, url or None) for every configuration, in order."""
    if args.urls:
        pairs = [item.split("=", 1) for item in args.urls.split(",") if item]
        return [(name, None, url.rstrip("/")) for name, url in pairs]
    names = [n for n in args.configs.split(",") if n]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown configs {unknown}; choose from {list(CONFIGS)}")
    return [(n, spec_for(n, args.routing_num_blocks, args.routing_workers,
                         args.tier_num_blocks, args.tier_host_bytes, args.slo_ttft,
                         vllm_spec(args)), None)
            for n in names]


def _measure(args, targets, sessions: list[Session], counter, out: Path,
             harness: tuple | None = None) -> tuple[dict, dict]:
    """Run every target in turn; rows by name, and the configurations that failed to start.

    harness: (binary, trace folder) under --driver agentx (agentx_cli.prepare).
    """
    slice_sessions = sessions[: args.baseline_sessions]
    need_slice = any(name == "hf" for name, _, _ in targets)
    rows: dict[str, Row] = {}
    failed: dict[str, str] = {}
    salt = secrets.token_hex(4)
    for name, spec, url in targets:
        is_hf = name == "hf"
        # the slice has no warm-up: a baseline without a prefix cache has nothing to warm
        work, duration, warmup = (slice_sessions, args.baseline_duration, 0.0) if is_hf else \
            (sessions, args.duration, args.warmup)
        ref = reference_of(name, args.reference)
        try:
            with (running_server(spec, args.model, out / f"server-{name}.log",
                                 args.startup_timeout)
                  if spec else contextlib.nullcontext(url)) as base:
                print(f"[compare] {name} at {base}", flush=True)
                if harness is not None:
                    lv = run_level(harness[0], base, args, harness[1], out,
                                   int(str(args.concurrency).split(",")[0]), name)
                    rows[name] = Row(name, ref, lv.summary, lv.records,
                                     spec.describe() if spec else None, probe_server(base),
                                     lv.harness)
                    save_metrics(base, out / f"metrics-{name}.txt")
                    continue
                records, summary = _run(base, args, work, counter, f"{salt}-{name}", duration,
                                        warmup)
                rows[name] = Row(name, ref, summary, records, spec.describe() if spec else None,
                                 probe_server(base))
                save_metrics(base, out / f"metrics-{name}.txt")
                if need_slice and not is_hf and SLICE not in rows:
                    records, summary = _run(base, args, slice_sessions, counter,
                                            f"{salt}-slice", args.baseline_duration, 0.0)
                    rows[SLICE] = Row(f"{SLICE} ({name})", "hf", summary, records, None)
        except (ServerStartError, HarnessFailed) as exc:
            print(f"[compare] {name} failed: {exc}", flush=True)
            failed[name] = str(exc)
    order = [n for n, _, _ in targets if n != "hf"] + [SLICE, "hf"]
    return {k: rows[k] for k in order if k in rows}, failed


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    out = args.output or default_output_dir()
    counter = counter_for(args)
    harness = None
    if args.driver == "agentx":
        if "hf" in args.configs.split(",") and not args.urls:
            raise SystemExit("--driver agentx compares Baton configurations; drop hf")
        binary, sessions, trace_dir = prepare(args, counter, out)
        harness = (binary, trace_dir)
    else:
        sessions = load_workload(args, counter)
    info = describe(args.workload, sessions)
    targets, rounds, orders, failed = _targets(args), [], [], {}
    for r in range(args.rounds):
        where = out if args.rounds == 1 else out / f"round-{r + 1}"
        where.mkdir(parents=True, exist_ok=True)
        order = rounds_mod.round_order(targets, r)
        orders.append([name for name, _, _ in order])
        print(f"[compare] round {r + 1} of {args.rounds}: {' '.join(orders[-1])}", flush=True)
        start = machine()
        rows, round_failed = _measure(args, order, sessions, counter, where, harness)
        keep = [n for n, _, _ in targets if n != "hf"] + [SLICE, "hf"]  # _measure's order
        rows = {n: rows[n] for n in keep if n in rows}
        failed.update({f"{name} (round {r + 1})": why for name, why in round_failed.items()})
        _report(args, argv, rows, round_failed, where, info, harness, start)
        rounds.append(rows)
    if args.rounds > 1:
        summary = rounds_mod.summarize(rounds)
        write_json(out / "rounds.json", rounds_mod.to_json(summary, orders))
        rounds_mod.print_rounds(summary, orders, f"baton bench compare: {info.name}, "
                                                 f"{args.rounds} rounds, order alternated")
        print(f"[compare] wrote {out}/rounds.json")
    return 0 if not failed else 1


def _report(args, argv: list[str], rows: dict, failed: dict, out: Path, info, harness,
            start: dict) -> None:
    """One round's report.json, request logs, plot and tables under `out` (start: machine()
    when the round began)."""
    write_json(out / "report.json", {
        "version": REPORT_VERSION, "kind": "compare",
        "created": dt.datetime.now().isoformat(timespec="seconds"),
        "command": "baton bench compare " + " ".join(argv), "baton": client_version(),
        "machine": machine(start),
        "workload": vars(info), "args": typed_args(args),
        "failed": failed,
        "rows": [{"name": r.name, "reference": r.reference, "server": r.server,
                  "answers": r.answers,
                  "ratios": dict(zip(("vs", "p90_ttft_x", "p99_itl_x", "tok_s_x"),
                                     ratio_cells(r, rows))),
                  "harness": r.harness.to_dict() if r.harness else None,
                  "summary": r.summary.to_dict()} for r in rows.values()]})
    for key, r in rows.items():
        write_records(out / f"requests-{key}.jsonl", r.records)
    if not args.no_plots and rows:
        plot_cdfs(out / "latency_cdf.png", {r.name: r.records for r in rows.values()
                                            if r.reference != "hf" and r.name != "hf"},
                  args.warmup)
    print_summary([r.name for r in rows.values()], [r.summary for r in rows.values()],
                  f"baton bench compare: {info.name}")
    print_table(rows, f"baton bench compare: {info.name}, {args.mode} loop")
    if harness is not None:
        print_harness_compare(rows, f"baton bench compare --driver agentx: {info.name}")
    print(f"[compare] wrote {out}/report.json")

