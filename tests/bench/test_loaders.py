"""Loaders on the real trace copies (counts from the traces README) and on a tiny AgentX file."""
import json

from baton.bench import loaders
from baton.bench.tokens import TokenCounter
from baton.bench.workload import BlockScope, Scaling

CHARS4 = TokenCounter(None)


def test_tau_bench_counts(traces):
    sessions = loaders.load_tau_bench(traces / "tau_bench/gpt-4o-airline.json.gz", CHARS4,
                                      Scaling())
    assert len(sessions) == 200
    # every assistant message (2,454) is one turn; each turn's prompt ends before it
    assert sum(len(s.turns) for s in sessions) == 2454
    first = sessions[0].turns
    assert first[0].messages[0]["role"] == "system"
    assert first[0].messages[-1]["role"] == "user"
    assert all(len(a.messages) < len(b.messages) for a, b in zip(first, first[1:]))
    assert all(isinstance(m["content"], str) for t in first for m in t.messages)
    assert all(t.max_tokens >= 1 for t in first)


def test_tau_bench_scaling(traces):
    sc = Scaling(max_sessions=3, max_turns=2, max_output_tokens=8, time_scale=0.5)
    sessions = loaders.load_tau_bench(traces / "tau_bench/gpt-4o-airline.json.gz", CHARS4, sc,
                                      default_think_s=2.0)
    assert len(sessions) == 3 and all(len(s.turns) == 2 for s in sessions)
    assert all(t.max_tokens <= 8 for s in sessions for t in s.turns)
    assert sessions[0].turns[1].delay_s == 1.0  # 2 s think × 0.5


def test_swe_agent_counts(traces):
    sessions = loaders.load_swe_agent(traces / "swe_agent_trajectories", CHARS4, Scaling())
    assert len(sessions) == 22
    assert sum(len(s.turns) for s in sessions) == 230


def test_mooncake_counts(traces):
    conv = loaders.load_mooncake(traces / "mooncake_fast25/conversation_trace.jsonl.gz", Scaling())
    assert sum(len(s.turns) for s in conv) == 12031
    assert len(conv) < 12031  # some rows continue earlier ones
    multi = next(s for s in conv if len(s.turns) > 1)
    a, b = multi.turns[0], multi.turns[1]
    assert b.block_ids[: len(a.block_ids) - 1] == a.block_ids[:-1]
    assert b.arrival_s > a.arrival_s
    syn = loaders.load_mooncake(traces / "mooncake_fast25/synthetic_trace.jsonl.gz", Scaling())
    assert sum(len(s.turns) for s in syn) == 3993
    assert all(s.block_scope == BlockScope.GLOBAL for s in syn)


def test_mooncake_block_scaling(traces):
    sc = Scaling(block_tokens=16, max_sessions=5)
    sessions = loaders.load_mooncake(traces / "mooncake_fast25/conversation_trace.jsonl.gz", sc,
                                     max_rows=200)
    first = sessions[0].turns[0]  # 6758 tokens in 14 blocks of 512
    assert len(first.block_ids) == 14
    assert first.num_tokens == -(-6758 * 16 // 512)
    assert sessions[0].block_tokens == 16


AGENTX = {
    "id": "trace_a1", "block_size": 64, "hash_id_scope": "local", "tool_tokens": 64,
    "system_tokens": 64, "requests": [
        {"t": 0.0, "type": "n", "in": 256, "out": 30, "hash_ids": [1, 2, 3, 4],
         "api_time": 2.0, "think_time": 0.0},
        {"t": 3.0, "type": "n", "in": 300, "out": 10, "hash_ids": [1, 2, 3, 4, 5],
         "api_time": 1.0, "think_time": 1.0},
        {"t": 5.0, "type": "subagent", "agent_id": "a7", "requests": [
            {"t": 5.0, "type": "n", "in": 128, "out": 20, "hash_ids": [70, 71],
             "api_time": 1.0, "think_time": 0.0},
            {"t": 7.0, "type": "n", "in": 150, "out": 5, "hash_ids": [70, 71, 72],
             "api_time": 1.0, "think_time": 1.0}]},
        {"t": 5.5, "type": "subagent", "agent_id": "a8", "requests": [
            {"t": 5.5, "type": "n", "in": 64, "out": 5, "hash_ids": [80],
             "api_time": 100.0, "think_time": 0.0}]},
        {"t": 10.0, "type": "n", "in": 400, "out": 40, "hash_ids": [1, 2, 3, 4, 5, 6, 7],
         "api_time": 2.0, "think_time": 2.0},
    ],
}


def test_agentx_parser(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(AGENTX))
    (s,) = loaders.load_agentx(path, Scaling(time_scale=0.5))
    assert s.name == "trace_a1" and s.block_scope == BlockScope.TREE and s.block_tokens == 64
    assert [t.num_tokens for t in s.turns] == [256, 300, 400]
    assert [t.delay_s for t in s.turns] == [0.0, 0.5, 1.0]
    assert [t.max_tokens for t in s.turns] == [30, 10, 40]
    assert s.num_requests() == 6
    a, b = s.children
    assert a.after_turn == 1 and a.join_turn == 2  # ends at 8 s, before the parent turn at 10 s
    assert b.after_turn == 1 and b.join_turn is None  # ends at 105.5 s: background
    assert a.delay_s == 0.5  # starts 1 s after parent turn 1 ended (4 s), × 0.5
    assert [t.block_ids for t in a.session.turns] == [(70, 71), (70, 71, 72)]
    assert a.session.turns[1].delay_s == 0.5


def test_agentx_jsonl_and_scaling(tmp_path):
    path = tmp_path / "traces.jsonl"
    path.write_text(json.dumps(AGENTX) + "\n" + json.dumps({**AGENTX, "id": "b"}) + "\n")
    sessions = loaders.load_agentx(path, Scaling(block_tokens=16, max_context_tokens=80))
    assert [s.name for s in sessions] == ["trace_a1", "b"]
    # 256 → 64, 300 → 75 fit; 400 → 100 does not: the session ends there
    assert [t.num_tokens for t in sessions[0].turns] == [64, 75]


def test_agentx_pads_uncovered_tokens(tmp_path):
    trace = {"id": "p", "requests": [{"t": 0, "in": 200, "out": 3, "hash_ids": [9]}]}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(trace))
    (s,) = loaders.load_agentx(path, Scaling())
    ids = s.turns[0].block_ids
    assert ids[0] == 9 and len(ids) == 4 and all(i < 0 for i in ids[1:])
