"""The AgentX harness driver without the harness: finding it, its command line and
environment, its exports (a captured sample, tests/bench/agentx_sample/), and `baton bench
agentx` / `compare --driver agentx` end to end with a stand-in binary that writes that sample.

The sample is a real agentx-harness 1.0.12 run against `baton up` (1 prefill + 1 decode), cut
to the metrics read here and to a few per-request rows (agentx_sample/README.md).
"""
import json
import os
import stat
import sys
from pathlib import Path

import pytest

from baton.bench.agentx import (
    OFFLINE_VARS,
    HarnessFailed,
    HarnessMissing,
    HarnessRun,
    find_harness,
    harness_env,
    run_harness,
)
from baton.bench.agentx_results import read_records, read_summary, record_from_json
from baton.bench.metrics import summarize

SAMPLE = Path(__file__).resolve().parent / "agentx_sample"

# A stand-in `agentx`: records its argv and which offline variables it saw, then copies the
# sample into --artifact-dir (or exits 3 / writes nothing, as FAKE_AGENTX_MODE says).
FAKE = f"""#!{sys.executable}
import json, os, shutil, sys
argv = sys.argv[1:]
out = argv[argv.index("--artifact-dir") + 1]
os.makedirs(out, exist_ok=True)
mode = os.environ.get("FAKE_AGENTX_MODE", "ok")
with open(os.path.join(out, "call.json"), "w") as f:
    json.dump({{"argv": argv, "offline": [v for v in {OFFLINE_VARS!r} if v in os.environ]}}, f)
if mode == "fail":
    sys.exit(3)
if mode == "ok":
    for name in ("profile_export_aiperf.json", "profile_export.jsonl"):
        shutil.copy(os.path.join({str(SAMPLE)!r}, name), out)
"""


def _fake_venv(tmp_path: Path) -> Path:
    binary = tmp_path / "venv" / "bin" / "agentx"
    binary.parent.mkdir(parents=True)
    binary.write_text(FAKE)
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    return tmp_path / "venv"


def test_find_harness_order_and_clear_errors(tmp_path):
    venv = _fake_venv(tmp_path)
    binary = venv / "bin" / "agentx"
    assert find_harness(agentx_venv=str(venv), env={}) == binary
    assert find_harness(agentx_bin=str(binary), env={}) == binary
    assert find_harness(env={"BATON_AGENTX": str(venv)}) == binary
    assert find_harness(env={"PATH": str(venv / "bin")}) == binary
    with pytest.raises(HarnessMissing, match="pip install agentx-harness==1.0.12"):
        find_harness(env={"PATH": str(tmp_path / "nothing")})
    # an explicit path that is wrong is an error even when another one would work
    with pytest.raises(HarnessMissing, match="--agentx-venv=.*nowhere"):
        find_harness(agentx_venv=str(tmp_path / "nowhere"), env={"BATON_AGENTX": str(venv)})


def test_env_drops_hf_offline_variables_only():
    env = harness_env({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PATH": "/bin",
                       "HF_HOME": "/x"})
    assert env == {"PATH": "/bin", "HF_HOME": "/x"}


def test_command_line(tmp_path):
    run = HarnessRun(binary=Path("/v/bin/agentx"), url="http://127.0.0.1:9", model="m",
                     tokenizer=Path("/models/m"), trace_dir=Path("/t"),
                     artifact_dir=Path("/a"), concurrency=4, duration_s=90.0, grace_s=15.0,
                     warmup_requests_per_lane=3, extra=("--log-level", "debug"))
    argv = run.argv()
    assert argv[:2] == ["/v/bin/agentx", "profile"]
    pairs = dict(zip(argv[2::1], argv[3::1]))
    assert pairs["--url"] == "http://127.0.0.1:9" and pairs["--tokenizer"] == "/models/m"
    assert pairs["--input-file"] == "/t" and pairs["--custom-dataset-type"] == "weka_trace"
    assert pairs["--concurrency"] == "4" and pairs["--benchmark-duration"] == "90"
    assert pairs["--benchmark-grace-period"] == "15"
    assert pairs["--warmup-requests-per-lane"] == "3" and pairs["--artifact-dir"] == "/a"
    assert "--unsafe-override" in argv and argv[-2:] == ["--log-level", "debug"]
    assert run.timeout_s(startup_s=100.0) == 205.0


def test_summary_of_the_captured_sample():
    h = read_summary(SAMPLE)
    data = json.loads((SAMPLE / "profile_export_aiperf.json").read_text())
    assert h.version == "1.0.12" and h.requests == int(data["request_count"]["avg"])
    assert h.ttft.p90 == pytest.approx(data["time_to_first_token"]["p90"] / 1e3)
    assert h.itl.p50 == pytest.approx(data["inter_token_latency"]["p50"] / 1e3)
    assert h.cache_read_fraction == pytest.approx(
        data["total_usage_prompt_cache_read_tokens"]["avg"]
        / data["total_usage_prompt_tokens"]["avg"])
    assert h.submission_valid is False and h.invalid_reasons == ["unsafe_override"]
    assert h.errors == 0


def test_records_rebuild_the_harness_numbers():
    records, end = read_records(SAMPLE)
    rows = [json.loads(x) for x in (SAMPLE / "profile_export.jsonl").read_text().splitlines()]
    profiled = [r for r in rows if r["metadata"]["benchmark_phase"] == "profiling"]
    assert len(records) == len(profiled) and records[0].start == 0.0
    assert all(r.ok and r.ttft > 0 and len(r.chunk_times) == r.output_tokens for r in records)
    s = summarize(records, 0.0, end)
    # the harness's ITL is per-request: Baton's TPOT of the same request
    by_id = {r["metadata"]["x_request_id"]: r for r in profiled}
    one = next(iter(by_id.values()))
    rec = record_from_json(one, one["metadata"]["request_start_ns"])
    assert rec.tpot == pytest.approx(one["metrics"]["inter_token_latency"]["value"] / 1e3,
                                     rel=1e-3)
    assert s.measured == len(profiled) and s.errors == 0


def test_error_rows_become_errors():
    row = json.loads((SAMPLE / "profile_export.jsonl").read_text().splitlines()[-1])
    row["error"] = {"code": 400, "type": "BadRequest", "message": "prompt is too long"}
    row["metrics"] = {}
    rec = record_from_json(row, row["metadata"]["request_start_ns"])
    assert not rec.ok and rec.error == "BadRequest: prompt is too long" and rec.ttft is None


def _run(tmp_path, mode):
    venv = _fake_venv(tmp_path)
    run = HarnessRun(binary=venv / "bin" / "agentx", url="http://x", model="m",
                     tokenizer=tmp_path, trace_dir=tmp_path, artifact_dir=tmp_path / "art",
                     concurrency=1, duration_s=1.0, grace_s=1.0)
    env = {**os.environ, "FAKE_AGENTX_MODE": mode, "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}
    return run_harness(run, tmp_path / "h.log", env=env, startup_s=60.0)


def test_run_harness_unsets_offline_and_checks_results(tmp_path):
    art = _run(tmp_path / "ok", "ok")
    call = json.loads((art / "call.json").read_text())
    assert call["offline"] == [] and "--unsafe-override" in call["argv"]
    with pytest.raises(HarnessFailed, match="exited with 3"):
        _run(tmp_path / "fail", "fail")
    with pytest.raises(HarnessFailed, match="no profile_export_aiperf.json"):
        _run(tmp_path / "empty", "empty")


def test_bench_agentx_without_harness_says_how_to_install(tmp_path, monkeypatch):
    from baton.bench.agentx_cli import main

    monkeypatch.delenv("BATON_AGENTX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SystemExit, match="python3 -m venv"):
        main(["--url", "http://127.0.0.1:9", "--output", str(tmp_path / "o"),
              "--tokenizer", "none"])


def _cli_args(tmp_path, venv):
    tok = tmp_path / "tok"
    tok.mkdir(exist_ok=True)
    return ["--agentx-venv", str(venv), "--workload", "synthetic", "--synthetic-sessions", "3",
            "--block-tokens", "16", "--tokenizer", str(tok), "--duration", "5", "--grace", "1"]


def test_bench_agentx_end_to_end_with_a_stand_in_harness(fake, tmp_path, capsys):
    from baton.bench.agentx_cli import main

    _, url = fake
    out = tmp_path / "run"
    assert main(["--url", url, "--concurrency", "2", "--output", str(out),
                 *_cli_args(tmp_path, _fake_venv(tmp_path))]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["kind"] == "agentx" and report["target"]["url"] == url
    (level,) = report["levels"]
    assert level["harness"]["version"] == "1.0.12"
    assert level["summary"]["measured"] == 4   # the sample's profiling rows
    call = json.loads((out / "harness-c2" / "call.json").read_text())
    trace_dir = Path(call["argv"][call["argv"].index("--input-file") + 1])
    assert trace_dir == out / "agentx-trace" and len(list(trace_dir.glob("*.json"))) == 3
    assert call["argv"][call["argv"].index("--tokenizer") + 1] == str(tmp_path / "tok")
    assert (out / "requests-c2.jsonl").read_text().count("\n") == 4
    assert "TTFT p90 ms" in capsys.readouterr().out


def test_compare_with_the_agentx_driver(fake, tmp_path, capsys):
    from baton.bench.compare import main as compare_main

    _, url = fake
    out = tmp_path / "cmp"
    rc = compare_main(["--driver", "agentx", "--urls", f"colocated={url},disaggregated={url}",
                       "--concurrency", "4", "--output", str(out), "--no-plots",
                       *_cli_args(tmp_path, _fake_venv(tmp_path))])
    assert rc == 0
    rows = {r["name"]: r for r in json.loads((out / "report.json").read_text())["rows"]}
    assert rows["disaggregated"]["harness"]["ttft"]["p90"] > 0
    for name in rows:
        call = json.loads((out / f"harness-{name}" / "call.json").read_text())
        assert call["argv"][call["argv"].index("--concurrency") + 1] == "4"
    assert "TTFT p50 ×" in capsys.readouterr().out


def test_compare_agentx_driver_refuses_text_traces(tmp_path):
    from baton.bench.compare import main as compare_main

    args = _cli_args(tmp_path, _fake_venv(tmp_path))
    args[args.index("synthetic")] = "tau-bench"
    with pytest.raises(SystemExit, match="block traces"):
        compare_main(["--driver", "agentx", "--urls", "a=http://127.0.0.1:9",
                      "--output", str(tmp_path / "o"), *args])


def test_convert_only_needs_no_harness(tmp_path, capsys, monkeypatch):
    from baton.bench.agentx_cli import main

    monkeypatch.delenv("BATON_AGENTX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    args = _cli_args(tmp_path, tmp_path / "no-venv")[2:]
    assert main(["--convert-only", "--output", str(tmp_path / "o"), *args]) == 0
    assert len(list((tmp_path / "o" / "agentx-trace").glob("*.json"))) == 3
    printed = capsys.readouterr().out
    assert ("env -u HF_HUB_OFFLINE -u TRANSFORMERS_OFFLINE -u HF_DATASETS_OFFLINE agentx "
            "profile") in printed
    assert "--unsafe-override" in printed


@pytest.mark.slow
def test_the_real_harness_against_the_fake_gateway(fake, tmp_path):
    """Only where the harness is installed ($BATON_AGENTX or agentx on PATH; CI has none)."""
    from baton.bench.agentx_cli import main

    try:
        venv = str(find_harness())
    except HarnessMissing:
        pytest.skip("AgentX harness not installed (BATON_AGENTX)")
    from baton.bench.agentx import tokenizer_folder
    try:
        tok = tokenizer_folder("smollm2-135m")
    except Exception as exc:  # noqa: BLE001 - no model folder here: nothing to test with
        pytest.skip(f"no local tokenizer folder: {exc}")
    _, url = fake
    out = tmp_path / "real"
    assert main(["--url", url, "--agentx-bin", venv, "--workload", "synthetic",
                 "--synthetic-sessions", "4", "--block-tokens", "16", "--max-output-tokens", "8",
                 "--tokenizer", str(tok), "--concurrency", "2", "--duration", "8",
                 "--grace", "5", "--output", str(out), "--agentx-startup", "300"]) == 0
    (level,) = json.loads((out / "report.json").read_text())["levels"]
    assert level["harness"]["errors"] == 0 and level["harness"]["requests"] > 0
    assert level["summary"]["measured"] == level["harness"]["requests"]
    assert level["harness"]["ttft"]["p50"] == pytest.approx(level["summary"]["ttft"]["p50"])
