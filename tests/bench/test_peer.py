"""The pure parts of the peer benchmark (baton/bench/peer.py); no server needed."""
from __future__ import annotations

import numpy as np
import pytest

from baton.bench import peer as P


def test_decode_itl_uses_usage_tokens_not_chunks():
    # 128 tokens streamed from t=1.0 to t=1.0 + 127 * 0.025: 25 ms per token whatever the chunking
    assert P.decode_itl(1.0, 1.0 + 127 * 0.025, 128) == pytest.approx(0.025)
    assert P.decode_itl(1.0, 1.0, 1) is None
    assert P.decode_itl(2.0, 1.0, 10) is None


@pytest.mark.parametrize("q", [0, 10, 50, 90, 99, 100])
def test_percentile_matches_numpy(q):
    xs = [5.0, 1.0, 9.0, 3.0, 7.0, 2.0, 8.0]
    assert P.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_percentile_empty_and_single():
    assert P.percentile([], 90) is None
    assert P.percentile([4.0], 90) == 4.0


def test_throughput_over_wall_time():
    # two streams of 100 tokens, from t=0 to t=4: 50 tok/s
    assert P.throughput([0.0, 1.0], [3.0, 4.0], [100, 100]) == pytest.approx(50.0)
    assert P.throughput([], [], []) is None


def test_prompts_are_deterministic_and_tagged():
    a, b = P.base_prompt("r0", 200), P.base_prompt("r0", 200)
    assert a == b and a.startswith("[run:r0]") and a.endswith(P.CUE)
    assert P.base_prompt("r1", 200) != a
    assert len(P.filler("x", 216).split()) == 216


def test_agentic_session_grows_by_reply_and_tool_result():
    s = P.AgenticSession("t", 2, base_words=20, tool_words=30)
    first = s.prompt
    second = s.add_reply(" I will run the tests.")
    assert second.startswith(first + " I will run the tests.")
    tail = second[len(first) + len(" I will run the tests."):]
    assert tail == P.tool_result("t", 2, 0, 30) and tail.endswith(P.CUE)
    assert len(tail.split("\n")[2].split()) == 30
    third = s.add_reply(" Done.")
    assert third.startswith(second + " Done.") and s.turns_done == 2
    # the same tool results on every server: only the replies can differ
    other = P.AgenticSession("t", 2, base_words=20, tool_words=30)
    other.add_reply(" X")
    assert other.prompt.endswith(P.tool_result("t", 2, 0, 30))
    assert P.AgenticSession("t", 3, 20, 30).prompt != first


def test_targets_and_table():
    itl, tps, p90 = P.TARGETS["itl_ms"], P.TARGETS["streams_tok_s"], \
        P.TARGETS["agentic_ttft_p90_ms"]
    assert itl.met(itl.baton_vs_peer(26.0, 25.0)) is True       # 1.04x <= 1.1
    assert itl.met(itl.baton_vs_peer(30.0, 25.0)) is False      # 1.2x
    assert tps.met(tps.baton_vs_peer(160.0, 100.0)) is True     # 1.6x >= 1.5
    assert p90.met(p90.baton_vs_peer(400.0, 1000.0)) is True    # 2.5x better
    assert p90.met(None) is None
    lines = P.table({"itl_ms": 25.0}, {"itl_ms": 30.0})
    assert "NOT met" in lines[1] and "1.20" in lines[1] and "n/a" in lines[2]


def test_summarize_takes_medians_and_skips_none():
    assert P.summarize({"a": [3.0, 1.0, 2.0], "b": []}) == {"a": 2.0, "b": None}


def test_script_runs_against_two_fake_servers(tmp_path, monkeypatch):
    """benchmarks/peer_llamacpp.py end to end, fake servers standing in for both sides."""
    import importlib.util
    import json
    import sys
    from pathlib import Path

    from tests.bench.fake_server import FakeServer, ServerThread
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "peer_llamacpp.py"
    spec = importlib.util.spec_from_file_location("peer_llamacpp", path)
    script = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "peer_llamacpp", script)  # dataclasses look it up
    spec.loader.exec_module(script)
    peer, baton = FakeServer(token_s=0.002), FakeServer(token_s=0.001)
    out = tmp_path / "run.json"
    with ServerThread(peer.app()) as peer_url, ServerThread(baton.app()) as baton_url:
        assert script.main(["--peer-url", peer_url, "--baton-url", baton_url, "--rounds", "2",
                            "--itl-tokens", "8", "--streams", "3", "--sessions", "2",
                            "--turns", "3", "--turn-tokens", "4", "--tool-words", "10",
                            "--output", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [(r["round"], r["measure"], r["server"]) for r in doc["runs"][:6]] == [
        (0, "itl", "peer"), (0, "itl", "baton"), (0, "streams", "peer"),
        (0, "streams", "baton"), (0, "agentic", "peer"), (0, "agentic", "baton")]
    assert doc["runs"][6]["server"] == "baton"          # round 1 starts with the other side
    assert all(r["full"] for r in doc["runs"]) and len(doc["runs"]) == 12
    # session affinity: Baton's header, llama-server's cache_prompt and slot
    agentic = [e for e in baton.log if e.session_id]
    assert len(agentic) == 2 * 2 * 3
    slots = {e.body.get("id_slot") for e in peer.log if e.body.get("id_slot") is not None}
    assert slots == {0, 1} and all(e.body["cache_prompt"] for e in peer.log)
    assert "id_slot" not in baton.log[0].body
    # turn k's prompt extends turn k-1's
    s0 = [e.body["prompt"] for e in baton.log if (e.session_id or "").endswith("-r0-agentic-s0")]
    assert len(s0) == 3 and all(b.startswith(a) for a, b in zip(s0, s0[1:]))
    assert doc["summary"]["peer"]["itl_ms"] > doc["summary"]["baton"]["itl_ms"]
