"""The AgentX harness's exports → Baton's report: its own numbers, and per-request records.

Two files of the harness's artifact folder (AIPerf 1.0.12 export schema 1.4):
  - `profile_export_aiperf.json`: the aggregate the harness prints and the leaderboard uses.
    Each metric is {unit, avg, p50, p90, p99, ...}; times in ms. `read_summary` keeps:
        TTFT   time_to_first_token           (first output token − request start)
        ITL    inter_token_latency           per-request mean gap after the first token,
                                             percentiles over requests (Baton calls that TPOT;
                                             Baton's own ITL pools every gap)
        E2E    request_latency
        tok/s  output_token_throughput, input_token_throughput; req/s request_throughput
        cache  total_usage_prompt_cache_read_tokens / total_usage_prompt_tokens (server usage)
        theoretical_prefix_cache_hit         the harness's bound from the trace's hash ids
        errors error_summary counts; submission_valid (false under --unsafe-override)
  - `profile_export.jsonl`: one record per request {metadata, metrics, error}. `read_records`
    turns the profiling-phase ones into RequestRecords on a clock starting at the first
    profiled request, so Baton's `summarize` and tables work on a harness run unchanged.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from baton.bench.client import RequestRecord
from baton.bench.metrics import Stats

AGGREGATE = "profile_export_aiperf.json"
RECORDS = "profile_export.jsonl"


def _stats_ms(metric: dict | None) -> Stats:
    """An AIPerf metric in ms → Stats in seconds (count 0 when absent)."""
    if not metric or "avg" not in metric:
        return Stats(0, None, None, None, None)

    def s(key):
        value = metric.get(key)
        return None if value is None else value / 1e3

    return Stats(int(metric.get("count", 0)), s("avg"), s("p50"), s("p90"), s("p99"))


def _avg(data: dict, key: str) -> float | None:
    metric = data.get(key)
    return None if not isinstance(metric, dict) else metric.get("avg")


@dataclass(frozen=True)
class HarnessSummary:
    """The harness's own aggregate for one run (see the module docstring). Times in s."""

    version: str
    requests: int
    errors: int
    error_kinds: dict[str, int]
    duration_s: float | None
    ttft: Stats
    itl: Stats
    e2e: Stats
    output_tokens_per_s: float | None
    input_tokens_per_s: float | None
    requests_per_s: float | None
    prompt_tokens: int | None
    cached_tokens: int | None
    cache_read_fraction: float | None
    theoretical_hit_fraction: float | None
    submission_valid: bool | None
    invalid_reasons: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def summary_from_json(data: dict) -> HarnessSummary:
    """Parse a loaded `profile_export_aiperf.json` (raises KeyError when not one)."""
    if "time_to_first_token" not in data and "request_count" not in data:
        raise KeyError("not an AIPerf profile export: no time_to_first_token/request_count")
    kinds: dict[str, int] = {}
    for item in data.get("error_summary") or []:
        details = item.get("error_details") or {}
        kind = f"{details.get('code') or ''} {details.get('type') or ''}".strip() or \
            (details.get("message") or "error")[:40]
        kinds[kind] = kinds.get(kind, 0) + int(item.get("count", 1))
    prompt = _avg(data, "total_usage_prompt_tokens")
    cached = _avg(data, "total_usage_prompt_cache_read_tokens")
    theo = _avg(data, "theoretical_prefix_cache_hit")
    meta = data.get("metadata") or {}
    return HarnessSummary(
        version=str(data.get("aiperf_version", "?")),
        requests=int(_avg(data, "request_count") or 0), errors=sum(kinds.values()),
        error_kinds=kinds, duration_s=_avg(data, "benchmark_duration"),
        ttft=_stats_ms(data.get("time_to_first_token")),
        itl=_stats_ms(data.get("inter_token_latency")),
        e2e=_stats_ms(data.get("request_latency")),
        output_tokens_per_s=_avg(data, "output_token_throughput"),
        input_tokens_per_s=_avg(data, "input_token_throughput"),
        requests_per_s=_avg(data, "request_throughput"),
        prompt_tokens=None if prompt is None else int(prompt),
        cached_tokens=None if cached is None else int(cached),
        cache_read_fraction=cached / prompt if prompt and cached is not None else None,
        theoretical_hit_fraction=None if theo is None else theo / 100.0,
        submission_valid=meta.get("submission_valid"),
        invalid_reasons=list(meta.get("submission_invalid_reasons") or []))


def read_summary(artifact_dir: Path) -> HarnessSummary:
    """The aggregate of one run's artifact folder."""
    return summary_from_json(json.loads((Path(artifact_dir) / AGGREGATE).read_text()))


def _value(metrics: dict, key: str):
    metric = metrics.get(key)
    return metric.get("value") if isinstance(metric, dict) else None


def record_from_json(row: dict, t0_ns: int) -> RequestRecord:
    """One `profile_export.jsonl` row → RequestRecord, times in s since `t0_ns`."""
    meta, metrics = row["metadata"], row.get("metrics") or {}
    start = (meta["request_start_ns"] - t0_ns) / 1e9
    end_ns = meta.get("request_end_ns")
    isl = _value(metrics, "input_sequence_length") or _value(metrics, "usage_prompt_tokens") or 0
    osl = _value(metrics, "output_sequence_length") or 0
    ttft = _value(metrics, "time_to_first_token")
    rec = RequestRecord(
        session_id=str(meta.get("conversation_id") or meta.get("x_correlation_id")),
        turn_index=int(meta.get("turn_index") or 0), start=start, max_tokens=int(osl),
        expected_prompt_tokens=int(isl), theo_hit=0,
        end=None if end_ns is None else (end_ns - t0_ns) / 1e9,
        output_tokens=int(osl), prompt_tokens=_value(metrics, "usage_prompt_tokens"),
        cached_tokens=_value(metrics, "usage_prompt_cache_read_tokens"),
        cancelled=bool(meta.get("was_cancelled")))
    if ttft is not None:
        rec.first_token = start + ttft / 1e3
        t = rec.first_token
        rec.chunk_times = [t]
        for gap_ms in _value(metrics, "inter_chunk_latency") or []:
            t += gap_ms / 1e3
            rec.chunk_times.append(t)
    error = row.get("error")
    if error:
        rec.error = f"{error.get('type') or error.get('code') or 'error'}: {error.get('message')}"
    return rec


def read_records(artifact_dir: Path, phase: str = "profiling") -> tuple[list[RequestRecord],
                                                                         float]:
    """The `phase` records of a run, in start order, and the window end (last end, in s)."""
    rows = [json.loads(line) for line in
            (Path(artifact_dir) / RECORDS).read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r["metadata"].get("benchmark_phase", phase) == phase]
    if not rows:
        return [], 0.0
    t0 = min(r["metadata"]["request_start_ns"] for r in rows)
    records = sorted((record_from_json(r, t0) for r in rows), key=lambda r: r.start)
    end = max((r.end for r in records if r.end is not None), default=0.0)
    return records, end
