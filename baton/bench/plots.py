"""The PNG plots of a run; every figure is titled with the run's configuration.

    latency_cdf.png                    empirical CDFs (steps) of TTFT, TPOT, ITL, E2E, one line
                                       per run, p50 (o) and p99 (x) marked, SLO lines dashed
    throughput_vs_interactivity.png    output tokens/s vs p90 interactivity, one point per run
    ttft_by_turn.png                   TTFT p50/p90 and mean cached fraction by turn index
    workers-c<N>.png                   each worker's running/waiting requests and KV usage
                                       over the run (GET /metrics/workers, about 1 s apart)
"""
from __future__ import annotations

from pathlib import Path

from baton.bench.client import RequestRecord
from baton.bench.metrics import Slo, Summary, TurnStats
from baton.bench.worker_poll import WorkerSeries


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path, title: str) -> None:
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    _pyplot().close(fig)


def step_cdf(ax, values: list[float], label: str) -> None:
    """The empirical CDF as a step function (`steps-post`: F jumps by 1/n at each value),
    with its p50 (o) and p99 (x) marked in the line's colour."""
    import numpy as np

    if not values:
        return
    x = np.sort(np.asarray(values, dtype=np.float64))
    y = np.arange(1, len(x) + 1) / len(x)
    (line,) = ax.plot(np.r_[x[0], x], np.r_[0.0, y], drawstyle="steps-post", label=label)
    p50, p99 = np.percentile(x, (50, 99))
    ax.plot([p50], [0.5], "o", color=line.get_color(), markersize=5)
    ax.plot([p99], [0.99], "x", color=line.get_color(), markersize=6)


def slo_line(ax, value: float | None, label: str, vertical: bool = True) -> None:
    """A dashed threshold line; when it lies far beyond the data (more than twice the axis
    range) an arrow at the edge names it instead, so the data keep the axis."""
    if value is None:
        return
    lo, hi = ax.get_xlim() if vertical else ax.get_ylim()
    if ax.get_lines() and value > lo + 2 * (hi - lo):
        xy, ha = ((0.99, 0.04), "right") if vertical else ((0.01, 0.96), "left")
        ax.annotate(f"{label} {'→' if vertical else '↑'}", xy, xycoords="axes fraction",
                    ha=ha, va="bottom" if vertical else "top", fontsize=8, color="0.3")
        return
    line = ax.axvline if vertical else ax.axhline
    line(value, color="0.3", linestyle="--", linewidth=1, label=label)


def plot_cdfs(path: Path, runs: dict[str, list[RequestRecord]], warmup_s: float,
              title: str = "", slo: Slo | None = None) -> None:
    """Latency CDFs (TTFT, TPOT, ITL, E2E), one line per run; SLO thresholds as lines (the
    ITL SLO is on each request's mean ITL, i.e. TPOT, and is drawn on both panels)."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(10, 7.5))
    panels = [("TTFT (ms)", lambda r: [r.ttft * 1e3], slo and slo.ttft_s * 1e3),
              ("TPOT (ms)", lambda r: [r.tpot * 1e3] if r.tpot is not None else [],
               slo and slo.itl_s * 1e3),
              ("ITL (ms)", lambda r: [x * 1e3 for x in r.itls()], slo and slo.itl_s * 1e3),
              ("E2E (s)", lambda r: [r.e2e], None)]
    for ax, (name, get, threshold) in zip(axes.flat, panels):
        for label, records in runs.items():
            ok = [r for r in records if r.ok and r.start >= warmup_s]
            step_cdf(ax, [v for r in ok for v in get(r)], label)
        ax.set_xlabel(name)
        slo_line(ax, threshold, f"SLO {threshold:g} ms" if threshold else "")
        ax.set_ylabel("fraction of requests" if name != "ITL (ms)" else "fraction of gaps")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize=8, title="o p50  x p99", title_fontsize=7)
    _save(fig, path, title)


def plot_tradeoff(path: Path, points: dict[str, Summary], title: str = "") -> None:
    """Output throughput vs p90 interactivity, one point per concurrency level (or config)."""
    fig, ax = _pyplot().subplots(figsize=(6, 4.8))
    xs, ys = [], []
    for label, s in points.items():
        if s.p90_interactivity is None:
            continue
        xs.append(s.p90_interactivity)
        ys.append(s.output_tokens_per_s)
        ax.annotate(label, (xs[-1], ys[-1]), textcoords="offset points", xytext=(4, 4))
    ax.plot(xs, ys, "o-")
    ax.set_xlabel("p90 interactivity (tokens/s/user)")
    ax.set_ylabel("output throughput (tokens/s)")
    ax.grid(alpha=0.3)
    _save(fig, path, title)


def plot_turns(path: Path, runs: dict[str, tuple[TurnStats, ...]], title: str = "",
               slo: Slo | None = None) -> None:
    """The agent view: TTFT p50 (solid) / p90 (dashed) and the mean server cached fraction
    by turn index, one colour per run."""
    fig, (left, right) = _pyplot().subplots(1, 2, figsize=(11, 4.5))
    for label, turns in runs.items():
        x = [t.turn for t in turns]
        (line,) = left.plot(x, [t.ttft_p50 * 1e3 for t in turns], "o-", label=f"{label} p50")
        left.plot(x, [t.ttft_p90 * 1e3 for t in turns], "s--", color=line.get_color(),
                  label=f"{label} p90", markersize=4)
        cached = [(t.turn, t.cached_fraction * 100) for t in turns
                  if t.cached_fraction is not None]
        if cached:
            right.plot(*zip(*cached), "o-", color=line.get_color(), label=label)
    if slo is not None:
        slo_line(left, slo.ttft_s * 1e3, f"SLO {slo.ttft_s * 1e3:g} ms", vertical=False)
    left.set(xlabel="turn index", ylabel="TTFT (ms)")
    right.set(xlabel="turn index", ylabel="mean cached fraction, server (%)", ylim=(0, 102))
    for ax in (left, right):
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize=8)
    _save(fig, path, title)


def plot_workers(path: Path, series: WorkerSeries, title: str = "") -> None:
    """Each worker's running and waiting requests and KV usage (%) over the run's clock."""
    fig, axes = _pyplot().subplots(3, 1, figsize=(10, 7.5), sharex=True)
    for worker, col in series.workers.items():
        label = f"{col['role']} {worker}".strip()
        for ax, key, scale in zip(axes, ("running", "waiting", "kv_usage"), (1, 1, 100)):
            points = [(t, v * scale) for t, v in zip(col["t"], col[key]) if v is not None]
            if points:
                ax.plot(*zip(*points), drawstyle="steps-post", label=label)
    for ax, name in zip(axes, ("requests running", "requests waiting", "KV cache usage (%)")):
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    axes[-1].set_xlabel("run time (s)")
    _save(fig, path, title)
