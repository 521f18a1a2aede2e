"""report.json, per-request JSONL and the printed tables (the plots are in plots.py)."""
from __future__ import annotations

import datetime as dt
import json
import os
import platform
from dataclasses import asdict
from pathlib import Path

from baton.bench.client import RequestRecord
from baton.bench.metrics import Summary

REPORT_VERSION = 2  # 2: typed args, "baton", target.answers, by_turn, workers


def default_output_dir() -> Path:
    return Path("bench-results") / dt.datetime.now().strftime("%Y%m%d-%H%M%S")


def machine(start: dict | None = None) -> dict:
    """Where the numbers come from. The load average (1, 5, 15 min) at the start and at the end
    shows whether the machine was shared; the benchmarked server itself adds its workers."""
    load = [round(x, 2) for x in os.getloadavg()]
    if start is not None:
        return {**start, "loadavg_end": load}
    return {"platform": platform.platform(), "python": platform.python_version(),
            "cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
            "loadavg_start": load}


def json_value(value):
    """`value` as a JSON-native type: Paths as strings, tuples and lists as lists, other
    unknown objects as their str(); None, bools and numbers stay what they are."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [json_value(v) for v in value]
    if isinstance(value, dict):
        return {str(k): json_value(v) for k, v in value.items()}
    return str(value)


def typed_args(args) -> dict:
    """The parsed command line for report.json, each flag with its JSON-native type."""
    return {k: json_value(v) for k, v in sorted(vars(args).items())}


def write_json(path: Path, data: dict) -> None:
    """`data` as indented JSON (str() remains the last resort, so a long run's report is
    never lost to one odd value; `typed_args` keeps the arguments typed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")


def write_records(path: Path, records: list[RequestRecord]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in records:
            row = asdict(r)
            row["chunk_times"] = [round(t, 5) for t in r.chunk_times]
            f.write(json.dumps(row) + "\n")


def _fmt(value, scale: float = 1.0, digits: int = 1, suffix: str = "") -> str:
    if value is None:
        return "-"
    return f"{value * scale:.{digits}f}{suffix}"


def _pct(value) -> str:
    return _fmt(value, 100.0, 1, "%")


METRIC_ROWS = [
    ("requests (measured)", lambda s: str(s.measured)),
    ("errors / cancelled", lambda s: f"{s.errors} / {s.cancelled}"),
    ("requests/s", lambda s: _fmt(s.requests_per_s, digits=2)),
    ("input tokens/s", lambda s: _fmt(s.input_tokens_per_s)),
    ("output tokens/s", lambda s: _fmt(s.output_tokens_per_s)),
    ("TTFT p50/p90/p99 ms", lambda s: "/".join(_fmt(v, 1e3, 0) for v in
                                                (s.ttft.p50, s.ttft.p90, s.ttft.p99))),
    ("TPOT p50/p90/p99 ms", lambda s: "/".join(_fmt(v, 1e3, 0) for v in
                                                (s.tpot.p50, s.tpot.p90, s.tpot.p99))),
    ("ITL p50/p90/p99 ms", lambda s: "/".join(_fmt(v, 1e3, 0) for v in
                                               (s.itl.p50, s.itl.p90, s.itl.p99))),
    ("E2E p50/p90/p99 s", lambda s: "/".join(_fmt(v, 1, 2) for v in
                                              (s.e2e.p50, s.e2e.p90, s.e2e.p99))),
    ("p90 interactivity tok/s/user", lambda s: _fmt(s.p90_interactivity)),
    ("goodput req/s (SLO met)", lambda s: f"{_fmt(s.goodput_per_s, digits=2)} "
                                          f"({_pct(s.slo_attainment)})"),
    # The server row counts the server's tokens (and its cache may hold prefixes other
    # sessions share); the bounds count ours: the rows are not a ratio of one another.
    ("prefix hit, server (cached/prompt tokens)", lambda s: _pct(s.prefix_hit_actual)),
    ("prefix hit, session-tree bound (our count)", lambda s: _pct(s.prefix_hit_theoretical)),
    ("prefix hit, any-session bound (our count)", lambda s: _pct(s.prefix_hit_global)),
]


def console():
    """A rich console; wide when not a terminal, so logged tables stay readable."""
    import sys

    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=160)


def print_metric_table(labels: list[str], items: list, rows, title: str,
                       caption: str | None = None) -> None:
    """One column per run (`labels`, `items`), one row per (name, cell(item) -> str)."""
    from rich.table import Table

    table = Table(title=title, caption=caption)
    table.add_column("metric")
    for label in labels:
        table.add_column(label, justify="right")
    for name, cell in rows:
        table.add_row(name, *(cell(item) for item in items))
    console().print(table)


def print_summary(labels: list[str], summaries: list[Summary], title: str) -> None:
    """One column per run (concurrency level or configuration), one row per metric."""
    print_metric_table(labels, summaries, METRIC_ROWS, title)


def _turn_cell(t) -> str:
    if t is None:
        return "-"
    return (f"{t.requests} · {_fmt(t.ttft_p50, 1e3, 0)}/{_fmt(t.ttft_p90, 1e3, 0)} ms · "
            f"{_pct(t.cached_fraction)} ({_pct(t.bound_fraction)})")


def print_turns(labels: list[str], summaries: list[Summary], max_turns: int = 40) -> None:
    """The agent view: one row per turn index, one column per run (requests · TTFT p50/p90 ·
    mean server cached fraction (our session-tree bound))."""
    from rich.table import Table

    turns = sorted({t.turn for s in summaries for t in s.by_turn})
    if not turns:
        return
    table = Table(title="by turn index: requests · TTFT p50/p90 · cached, server (bound)",
                  caption=f"first {max_turns} turn indices" if len(turns) > max_turns else None)
    table.add_column("turn", justify="right")
    for label in labels:
        table.add_column(label, justify="right")
    rows = [{t.turn: t for t in s.by_turn} for s in summaries]
    for turn in turns[:max_turns]:
        table.add_row(str(turn), *(_turn_cell(r.get(turn)) for r in rows))
    console().print(table)
