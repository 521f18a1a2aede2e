"""benchmarks/peer_vllm.py against two fake OpenAI servers already running (--vllm-url,
--baton-url): every measure runs on both, alternating, and the report holds the ratios
against issue 24's targets, the CPU model and each side's dtype. (Starting vLLM itself:
tests/bench/test_vllm_server.py.)"""
from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

from baton.bench import peer as P
from tests.bench.fake_server import FakeServer, ServerThread

REPO = Path(__file__).resolve().parents[2]
sys.path.append(str(REPO / "benchmarks"))
peer_vllm = importlib.import_module("peer_vllm")


def test_cpu_model_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: AMD EPYC 9B14\nflags\t: avx2\n")
    assert peer_vllm.cpu_model(str(info)) == "AMD EPYC 9B14"
    assert peer_vllm.cpu_model(str(tmp_path / "none")) == "?"


def test_vllm_targets_table():
    lines = P.table({"itl_ms": 30.0, "cold_ttft_ms": 200.0, "streams_tok_s": 40.0},
                    {"itl_ms": 15.0, "cold_ttft_ms": 250.0, "streams_tok_s": 80.0},
                    P.VLLM_TARGETS, "vllm")
    assert "baton/vllm" in lines[0]
    assert [line.rsplit(": ", 1)[1] for line in lines[1:]] == ["met", "NOT met", "met"]


def test_run_against_running_servers(tmp_path, capsys):
    slow, fast = FakeServer(ttft_s=0.04, token_s=0.004), FakeServer(ttft_s=0.01, token_s=0.002)
    out = tmp_path / "run.json"
    with ServerThread(slow.app()) as vllm_url, ServerThread(fast.app()) as baton_url:
        rc = peer_vllm.main(["--vllm-url", vllm_url, "--baton-url", baton_url, "--rounds", "2",
                             "--itl-tokens", "6", "--prompt-words", "20", "--ttft-words", "60",
                             "--ttft-requests", "2", "--streams", "3", "--vllm-dtype",
                             "float32", "--output", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["cpu"] and doc["dtypes"]["vllm"] == "float32" and "baton" in doc["dtypes"]
    order = [(r["round"], r["server"]) for r in doc["runs"] if r["measure"] == "itl"]
    assert order == [(0, "vllm"), (0, "baton"), (1, "baton"), (1, "vllm")]
    for side in ("vllm", "baton"):
        s = doc["summary"][side]
        assert all(s[k] is not None and s[k] > 0 for k in P.VLLM_TARGETS), (side, s)
    # the faster fake is "baton": every target's ratio favours it
    assert doc["summary"]["baton"]["itl_ms"] < doc["summary"]["vllm"]["itl_ms"]
    assert doc["summary"]["baton"]["cold_ttft_ms"] < doc["summary"]["vllm"]["cold_ttft_ms"]
    # cold TTFT prompts are never repeated: no prefix of one was sent before
    ttft_prompts = [e.body["prompt"] for e in fast.log if e.body.get("max_tokens") == 4]
    assert len(set(ttft_prompts)) == len(ttft_prompts)
    printed = capsys.readouterr().out
    assert "baton/vllm" in printed and "CPU:" in printed
