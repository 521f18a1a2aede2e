"""Metrics on hand-made timings."""
import math

import pytest

from baton.bench.client import RequestRecord
from baton.bench.metrics import Slo, Stats, meets_slo, summarize


def rec(start, first, gaps, *, prompt=100, cached=50, theo=60, global_hit=70, error=None,
        cancelled=False, usage=True, turn=0):
    """A finished request: first token at `first`, then one token after each gap."""
    times = [first]
    for g in gaps:
        times.append(times[-1] + g)
    return RequestRecord(
        session_id="s", turn_index=turn, start=start, max_tokens=len(times),
        expected_prompt_tokens=prompt, theo_hit=theo, global_hit=global_hit,
        end=times[-1] + 0.001, first_token=first, chunk_times=times, output_tokens=len(times),
        prompt_tokens=prompt if usage else None, cached_tokens=cached if usage else None,
        error=error, cancelled=cancelled)


def test_stats_percentiles_linear():
    s = Stats.of([float(i) for i in range(1, 101)])  # 1..100
    assert s.count == 100 and s.mean == 50.5
    assert s.p50 == pytest.approx(50.5) and s.p90 == pytest.approx(90.1)
    assert s.p99 == pytest.approx(99.01)
    assert Stats.of([]).p50 is None


def test_record_ttft_tpot_itl():
    r = rec(10.0, 10.5, [0.1, 0.2, 0.3])
    assert r.ttft == pytest.approx(0.5)
    assert r.itls() == pytest.approx([0.1, 0.2, 0.3])
    assert r.tpot == pytest.approx(0.2)  # 0.6 s over 3 tokens after the first
    assert r.e2e == pytest.approx(1.101)
    one = rec(0.0, 0.1, [])
    assert one.tpot is None and one.itls() == []


def test_summary_window_throughput_and_warmup():
    records = [
        rec(0.0, 0.2, [0.1]),              # warm-up: excluded
        rec(2.0, 2.5, [0.1, 0.1]),         # ttft 0.5, tpot 0.1
        rec(3.0, 4.0, [0.3, 0.3, 0.3]),    # ttft 1.0, tpot 0.3
        rec(4.0, 4.1, [0.05]),             # ttft 0.1, tpot 0.05
        rec(5.0, 5.1, [], error="HTTP 500: boom"),
        rec(5.0, 5.1, [0.1], cancelled=True),
    ]
    s = summarize(records, warmup_s=1.0, end_s=11.0, slo=Slo(ttft_s=0.8, itl_s=0.2))
    assert s.window_s == 10.0
    assert s.warmup == 1 and s.measured == 3 and s.errors == 1 and s.cancelled == 1
    assert s.error_kinds == {"HTTP 500": 1}
    assert s.requests_per_s == pytest.approx(0.3)
    assert s.output_tokens_per_s == pytest.approx((3 + 4 + 2) / 10)
    assert s.input_tokens_per_s == pytest.approx(300 / 10)
    assert s.ttft.p50 == pytest.approx(0.5)
    assert s.tpot.p50 == pytest.approx(0.1)
    # ITL pools every gap: 0.1, 0.1, 0.3, 0.3, 0.3, 0.05
    assert s.itl.count == 6 and s.itl.mean == pytest.approx(1.15 / 6)
    # p90 TPOT over (0.1, 0.3, 0.05) = 0.26 → interactivity 1/0.26
    assert s.tpot.p90 == pytest.approx(0.26)
    assert s.p90_interactivity == pytest.approx(1 / 0.26)
    # goodput: request 1 (0.5 s, 0.1 s) and 3 (0.1 s, 0.05 s) meet the SLO; 2 misses both
    assert s.goodput_per_s == pytest.approx(0.2)
    assert s.slo_attainment == pytest.approx(2 / 3)


def test_slo_checks_ttft_and_mean_itl():
    slo = Slo(ttft_s=1.0, itl_s=0.1)
    assert meets_slo(rec(0, 0.5, [0.1, 0.1]), slo)
    assert not meets_slo(rec(0, 1.5, [0.1]), slo)
    assert not meets_slo(rec(0, 0.5, [0.05, 0.25]), slo)  # mean ITL 0.15
    assert meets_slo(rec(0, 0.5, []), slo)  # one token: no ITL to miss


def test_prefix_hit_actual_vs_theoretical():
    records = [rec(1, 1.1, [0.1], prompt=100, cached=0, theo=0, global_hit=16),
               rec(2, 2.1, [0.1], prompt=300, cached=192, theo=200, global_hit=208)]
    s = summarize(records, 0.0, 10.0)
    assert s.prefix_hit_actual == pytest.approx(192 / 400)
    assert s.prefix_hit_theoretical == pytest.approx(200 / 400)
    assert s.prefix_hit_global == pytest.approx(224 / 400)


def test_prefix_hit_unknown_without_usage():
    s = summarize([rec(1, 1.1, [0.1], usage=False)], 0.0, 10.0)
    assert s.prefix_hit_actual is None and s.cached_tokens is None
    assert s.prompt_tokens == 100  # falls back to our own count


def test_empty_run():
    s = summarize([], 0.0, 5.0)
    assert s.measured == 0 and s.requests_per_s == 0 and s.p90_interactivity is None
    assert s.slo_attainment is None and not math.isnan(s.goodput_per_s)


def test_by_turn_ttft_and_cached_fraction():
    records = [
        rec(1, 1.4, [0.1], turn=0, prompt=100, cached=0, theo=0),       # ttft 0.4
        rec(1, 1.2, [0.1], turn=0, prompt=200, cached=0, theo=0),       # ttft 0.2
        rec(2, 2.1, [0.1], turn=1, prompt=400, cached=320, theo=300),   # 0.8 cached
        rec(2, 2.3, [0.1], turn=1, prompt=500, cached=300, theo=400),   # 0.6 cached
        rec(3, 3.1, [0.1], turn=2, prompt=600, cached=480, theo=500, usage=False),
        rec(3, 3.1, [0.1], turn=2, error="HTTP 500: x"),                # not measured
        rec(0, 0.1, [0.1], turn=5),                                     # warm-up
    ]
    rows = summarize(records, warmup_s=0.5, end_s=10.0).by_turn
    assert [(t.turn, t.requests) for t in rows] == [(0, 2), (1, 2), (2, 1)]
    assert rows[0].ttft_p50 == pytest.approx(0.3) and rows[0].ttft_p90 == pytest.approx(0.38)
    assert rows[0].cached_fraction == 0.0 and rows[0].bound_fraction == 0.0
    assert rows[1].cached_fraction == pytest.approx(0.7)          # mean of 0.8 and 0.6
    assert rows[1].bound_fraction == pytest.approx((0.75 + 0.8) / 2)
    assert rows[2].cached_fraction is None                        # no server usage
    assert rows[2].bound_fraction == pytest.approx(500 / 600)
    assert summarize([], 0.0, 1.0).by_turn == ()
