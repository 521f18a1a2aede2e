"""`baton bench --quick`-like run against a real local cluster (`baton up`), end to end.

Slow: it starts gateway + prefill + decode processes with the default model (smollm2-135m,
converted once into the cache) and replays a short synthetic agent workload through them.
"""
import json

import pytest

from baton.bench.cli import main

pytestmark = pytest.mark.slow


def test_bench_quick_against_local_cluster(tmp_path):
    out = tmp_path / "quick"
    rc = main(["--quick", "--duration", "20", "--warmup", "3", "--grace", "5", "--no-progress",
               "--no-plots", "--output", str(out)])
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    s = report["levels"][0]["summary"]
    assert report["target"]["server"]["mode"] == "disaggregated"
    assert report["target"]["answers"]["version"]["version"]   # the gateway's GET /version
    workers = report["levels"][0]["workers"]
    assert workers["available"], workers["note"]
    assert {w["role"] for w in workers["workers"].values()} == {"prefill", "decode"}
    assert s["measured"] > 0 and s["errors"] == 0
    assert s["ttft"]["p50"] > 0 and s["output_tokens_per_s"] > 0
    # multi-turn sessions over a shared system prompt: the prefix cache must hit
    assert s["prefix_hit_actual"] and s["prefix_hit_actual"] > 0.3
