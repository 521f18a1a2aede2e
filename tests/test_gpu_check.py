"""benchmarks/gpu_check.py stays runnable: its CPU dry-run passes, every section reports once,
and the section runner turns a failure or the time budget into a report, not a crash."""
from __future__ import annotations

import importlib
import importlib.util
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO / "benchmarks"))
gpu_check = importlib.import_module("gpu_check")


@pytest.mark.timeout(480)
def test_dry_run_reports_every_section_and_exits_0(tmp_path):
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--dry-run",
         "--json", str(report)],
        cwd=tmp_path, capture_output=True, text=True, timeout=460)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    lines = re.findall(r"^== \[(\w+)\] (PASS|FAIL|SKIP) ", proc.stdout, re.MULTILINE)
    assert [name for name, _ in lines] == list(gpu_check.SECTIONS)
    sections = {s["section"]: s for s in json.loads(report.read_text())["sections"]}
    assert list(sections) == list(gpu_check.SECTIONS)
    # what runs on CPU must pass there; only the CUDA graph capture (and NIXL where it is not
    # installed) may skip
    for name in ("env", "engine", "bf16", "kernels", "disagg", "tiers", "decode_bw",
                 "decode_floor"):
        assert sections[name]["status"] == "PASS", sections[name]
    assert sections["graphs"]["status"] == "SKIP"
    assert "CUDA" in sections["graphs"]["reason"]
    nixl_ok = importlib.util.find_spec("nixl") is not None
    assert sections["nixl"]["status"] == ("PASS" if nixl_ok else "SKIP"), sections["nixl"]
    engine = sections["engine"]["details"]
    assert all(engine[m]["match"] for m in ("smollm2-135m", "llama-3.2-1b"))
    bf16 = sections["bf16"]["details"]
    # the section's rule: vLLM's top-5 rule with at least half the prompts equal, or (where it
    # breaks on a random model's flat distributions) at least as faithful to fp32
    assert all((r["all_tokens_equal"] or 0) >= r["prompts"] // 2 or r["as_faithful_to_fp32"]
               for r in bf16.values()), bf16
    disagg = sections["disagg"]["details"]
    assert "grpc" in disagg and ("nixl" in disagg) == nixl_ok
    assert all(d["equal"] and not d["local_prefills"] for d in disagg.values())
    tiers = sections["tiers"]["details"]
    assert tiers["host_64"]["equal"] and tiers["host_64"]["loaded_blocks"]["host"] > 0
    assert tiers["host_4"]["equal"] and tiers["host_4"]["loaded_blocks"]["disk"] > 0
    floor = sections["decode_floor"]["details"]
    assert set(floor) == {"smollm2-135m", "llama-3.2-1b"}
    assert all(f["step_ms"] > 0 and f["floor_ms"] > 0 for f in floor.values())


def _ctx():
    from types import SimpleNamespace

    return SimpleNamespace(report={})


def test_a_raising_section_fails_alone():
    def section(name):
        if name == "bad":
            def run(ctx):
                raise RuntimeError("boom")
            return run
        return lambda ctx: ("PASS", "fine")

    results = gpu_check.run_sections(_ctx(), ["ok1", "bad", "ok2"], 60, section)
    assert [(r["section"], r["status"]) for r in results] == [
        ("ok1", "PASS"), ("bad", "FAIL"), ("ok2", "PASS")]
    assert "RuntimeError: boom" in results[1]["reason"]


def test_budget_stops_the_running_section_and_skips_the_rest():
    def section(name):
        def run(ctx):
            for _ in range(200):  # 10 s at most, far past the 0.3 s budget
                time.sleep(0.05)
            return "PASS", "never"
        return run

    results = gpu_check.run_sections(_ctx(), ["slow", "after"], 0.3, section)
    assert results[0]["status"] == "FAIL" and "budget" in results[0]["reason"]
    assert results[1]["status"] == "SKIP"


def test_bf16_fp32_faithfulness_verdict():
    """Where vLLM's top-5 rule breaks on a random model, the bf16 section passes only if
    baton's bf16 is as faithful to fp32 as transformers' (the H200 run's summaries pass; a
    side that misses fp32's argmax more often, or loses far more fp32 logprob, fails)."""
    bf16 = importlib.import_module("gpu_check_bf16")

    def summary(ours, theirs, regret_ours, regret_theirs):
        return {"baton_is_fp32_argmax": ours, "transformers_is_fp32_argmax": theirs,
                "mean_regret_baton": regret_ours, "mean_regret_transformers": regret_theirs}

    assert bf16.faithful_to_fp32(summary(9, 5, 0.209, 0.413))  # H200, smollm2-135m shape
    assert bf16.faithful_to_fp32(summary(7, 3, 0.674, 0.640))  # H200, llama-3.2-1b shape
    assert not bf16.faithful_to_fp32(summary(3, 7, 0.2, 0.4))
    assert not bf16.faithful_to_fp32(summary(7, 3, 1.2, 0.6))
