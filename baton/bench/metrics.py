"""Run records → the numbers of the report.

Measured requests: started at or after the warm-up, finished without error or cancellation.
The window runs from the end of the warm-up to the end of the run (last request finished, or
the deadline plus grace), and every rate divides by its length.

    TTFT   first text chunk − request start
    TPOT   (last text chunk − first text chunk) / (output_tokens − 1), per request
    ITL    every gap between consecutive text chunks, pooled over requests
    E2E    end of stream − request start
    interactivity   tokens/s/user = 1 / TPOT; "p90 interactivity" = 1 / p90(TPOT), the speed
                    that 90 % of requests get or beat
    goodput         measured requests with TTFT ≤ slo_ttft and TPOT (their mean ITL) ≤ slo_itl,
                    per second of the window
    prefix hit      actual = Σ cached_tokens / Σ prompt_tokens (server usage);
                    theoretical = Σ hit(r) / Σ our prompt tokens (prepare.py's definition);
                    global = the same counting earlier requests of any session (16-token blocks)
                    Actual counts the server's tokens, the bounds count ours (template and
                    tokenizer may differ), and the server's cache also holds prefixes shared
                    across sessions: actual can exceed the session-tree bound, so the two are
                    reported side by side and never as a ratio.
    by turn         the agent view: per turn index (0 = a session's first request, subagents
                    counted from their own first), measured requests, TTFT p50/p90 and the
                    mean per-request cached fraction (server cached/prompt tokens; and our
                    session-tree bound, hit(r) / our prompt tokens)
"""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass

import numpy as np

from baton.bench.client import RequestRecord, is_context_overflow

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class Stats:
    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None

    @classmethod
    def of(cls, values: list[float]) -> Stats:
        if not values:
            return cls(0, None, None, None, None)
        arr = np.asarray(values, dtype=np.float64)
        p = np.percentile(arr, PERCENTILES)
        return cls(len(values), float(arr.mean()), float(p[0]), float(p[1]), float(p[2]))


@dataclass(frozen=True)
class Slo:
    ttft_s: float = 2.0
    itl_s: float = 0.2


@dataclass(frozen=True)
class TurnStats:
    """One row of the per-turn table (see "by turn" above)."""

    turn: int
    requests: int
    ttft_p50: float
    ttft_p90: float
    cached_fraction: float | None    # mean of cached_tokens / prompt_tokens (server usage)
    bound_fraction: float | None     # mean of theo_hit / expected_prompt_tokens (ours)


def by_turn(ok: list[RequestRecord]) -> tuple[TurnStats, ...]:
    """TTFT and cache hit by turn index, over measured requests, turns in order."""
    turns: dict[int, list[RequestRecord]] = {}
    for r in ok:
        turns.setdefault(r.turn_index, []).append(r)
    rows = []
    for turn in sorted(turns):
        rs = turns[turn]
        ttft = np.percentile([r.ttft for r in rs], (50, 90))
        cached = [r.cached_tokens / r.prompt_tokens for r in rs
                  if r.cached_tokens is not None and r.prompt_tokens]
        bound = [r.theo_hit / r.expected_prompt_tokens for r in rs if r.expected_prompt_tokens]
        rows.append(TurnStats(turn, len(rs), float(ttft[0]), float(ttft[1]),
                              float(np.mean(cached)) if cached else None,
                              float(np.mean(bound)) if bound else None))
    return tuple(rows)


@dataclass(frozen=True)
class Summary:
    measured: int
    warmup: int
    errors: int
    cancelled: int
    error_kinds: dict[str, int]
    window_s: float
    ttft: Stats
    tpot: Stats
    itl: Stats
    e2e: Stats
    requests_per_s: float
    input_tokens_per_s: float
    output_tokens_per_s: float
    p90_interactivity: float | None
    goodput_per_s: float
    slo_attainment: float | None
    prefix_hit_actual: float | None
    prefix_hit_theoretical: float | None
    prefix_hit_global: float | None
    prompt_tokens: int
    cached_tokens: int | None
    by_turn: tuple[TurnStats, ...] = ()

    def to_dict(self) -> dict:
        return asdict(self)


def _error_kind(err: str) -> str:
    return "context overflow" if is_context_overflow(err) else err.split(":")[0][:40]


def meets_slo(r: RequestRecord, slo: Slo) -> bool:
    tpot = r.tpot
    return r.ttft is not None and r.ttft <= slo.ttft_s and (tpot is None or tpot <= slo.itl_s)


def summarize(records: list[RequestRecord], warmup_s: float, end_s: float,
              slo: Slo = Slo()) -> Summary:
    """Everything in the report for one run (see the module docstring for definitions)."""
    window = max(end_s - warmup_s, 1e-9)
    in_window = [r for r in records if r.start >= warmup_s]
    ok = [r for r in in_window if r.ok]
    errors = [r for r in in_window if r.error and not r.cancelled]
    tpots = [r.tpot for r in ok if r.tpot is not None]
    tpot_stats = Stats.of(tpots)
    prompt = sum(r.prompt_tokens if r.prompt_tokens is not None else r.expected_prompt_tokens
                 for r in ok)
    with_usage = [r for r in ok if r.cached_tokens is not None and r.prompt_tokens]
    cached = sum(r.cached_tokens for r in with_usage) if with_usage else None
    ours = sum(r.expected_prompt_tokens for r in ok)
    good = sum(1 for r in ok if meets_slo(r, slo))
    return Summary(
        measured=len(ok), warmup=len(records) - len(in_window), errors=len(errors),
        cancelled=sum(1 for r in in_window if r.cancelled),
        error_kinds=dict(Counter(_error_kind(r.error) for r in errors)),
        window_s=window,
        ttft=Stats.of([r.ttft for r in ok]),
        tpot=tpot_stats,
        itl=Stats.of([x for r in ok for x in r.itls()]),
        e2e=Stats.of([r.e2e for r in ok]),
        requests_per_s=len(ok) / window,
        input_tokens_per_s=prompt / window,
        output_tokens_per_s=sum(r.output_tokens for r in ok) / window,
        p90_interactivity=1.0 / tpot_stats.p90 if tpot_stats.p90 else None,
        goodput_per_s=good / window,
        slo_attainment=good / len(ok) if ok else None,
        prefix_hit_actual=(cached / sum(r.prompt_tokens for r in with_usage)
                           if with_usage else None),
        prefix_hit_theoretical=sum(r.theo_hit for r in ok) / ours if ours else None,
        prefix_hit_global=sum(r.global_hit for r in ok) / ours if ours else None,
        prompt_tokens=prompt, cached_tokens=cached, by_turn=by_turn(ok),
    )
