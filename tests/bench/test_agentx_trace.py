"""Baton sessions → AgentX (WEKA) trace files: a tiny Mooncake trace, a subagent tree, refusals.

The harness itself is not needed: the field names are checked against its schema, copied from
agentx-harness 1.0.12 `aiperf/dataset/loader/weka_trace_models.py` (its models forbid extra
fields), and the files are read back with Baton's own AgentX loader.
"""
import gzip
import json

import pytest

from baton.bench import loaders
from baton.bench.agentx_trace import NotBlockTrace, to_weka, write_trace_dir
from baton.bench.workload import Child, Scaling, Session, Turn

TRACE_FIELDS = {"id", "models", "block_size", "hash_id_scope", "tool_tokens", "system_tokens",
                "requests", "totals"}
REQUEST_FIELDS = {"t", "type", "model", "in", "out", "hash_ids", "input_types", "output_types",
                  "stop", "api_time", "think_time", "ttft"}
SUBAGENT_FIELDS = {"t", "type", "agent_id", "subagent_type", "duration_ms", "total_tokens",
                   "tool_use_count", "status", "requests", "models", "tool_tokens",
                   "system_tokens"}
SUBAGENT_REQUIRED = {"t", "type", "agent_id", "subagent_type", "status", "requests", "models"}


def _mooncake(tmp_path):
    """Two sessions: A (3 turns, each extending the last, 512-token blocks) and B (1 turn)."""
    rows = [
        {"timestamp": 0, "input_length": 1100, "output_length": 40, "hash_ids": [7, 8, 9]},
        {"timestamp": 1000, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]},
        {"timestamp": 4000, "input_length": 1700, "output_length": 30,
         "hash_ids": [7, 8, 9, 10]},
        {"timestamp": 30000, "input_length": 2100, "output_length": 20,
         "hash_ids": [7, 8, 9, 10, 11]},
    ]
    path = tmp_path / "tiny.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write("\n".join(json.dumps(r) for r in rows) + "\n")
    return loaders.load_mooncake(path, Scaling(block_tokens=16, max_think_s=10.0))


def test_mooncake_session_converts_with_its_scaled_shape(tmp_path):
    a, b = _mooncake(tmp_path)
    trace = to_weka(a, "smollm2-135m")
    assert set(trace) <= TRACE_FIELDS
    assert trace["hash_id_scope"] == "local" and trace["block_size"] == 16
    reqs = trace["requests"]
    assert all(set(r) <= REQUEST_FIELDS and r["type"] == "s" for r in reqs)
    # 1100 tokens at 512/block → 35 tokens at 16/block, ids renumbered densely, prefixes kept
    assert [r["in"] for r in reqs] == [35, 54, 66]
    assert [r["out"] for r in reqs] == [40, 30, 20]
    assert [r["hash_ids"] for r in reqs] == [[0, 1, 2], [0, 1, 2, 3], [0, 1, 2, 3, 4]]
    # think times: 4 s, then 26 s capped at 10 s; t advances by exactly those (api_time 0)
    assert [r["think_time"] for r in reqs] == [0.0, 4.0, 10.0]
    assert [r["t"] for r in reqs] == [0.0, 4.0, 14.0]
    assert all(r["api_time"] == 0.0 for r in reqs)
    assert [r["in"] for r in to_weka(b, "m")["requests"]] == [19]


def test_written_files_read_back_as_the_same_turns(tmp_path):
    sessions = _mooncake(tmp_path)
    paths = write_trace_dir(sessions, "smollm2-135m", tmp_path / "agentx")
    assert [p.name for p in paths] == ["00000-mooncake-0.json", "00001-mooncake-1.json"]
    back = loaders.load_agentx(tmp_path / "agentx", Scaling())
    for orig, read in zip(sessions, back):
        assert [(t.num_tokens, t.max_tokens, t.delay_s, len(t.block_ids)) for t in read.turns] \
            == [(t.num_tokens, t.max_tokens, t.delay_s, len(t.block_ids)) for t in orig.turns]


def test_subagent_becomes_a_subagent_entry():
    def turn(n, ids, delay=0.0):
        return Turn(max_tokens=4, delay_s=delay, block_ids=ids, num_tokens=n)

    kid = Session("kid", (turn(20, (100, 101)), turn(40, (100, 101, 102), delay=2.0)),
                  block_tokens=16)
    parent = Session("p", (turn(30, (1, 2)), turn(50, (1, 2, 3, 4), delay=3.0)),
                     children=(Child(kid, after_turn=0, delay_s=0.5, join_turn=1),),
                     block_tokens=16)
    reqs = to_weka(parent, "m")["requests"]
    assert [r["type"] for r in reqs] == ["s", "subagent", "s"]
    sub = reqs[1]
    assert set(sub) <= SUBAGENT_FIELDS and SUBAGENT_REQUIRED <= set(sub)
    assert sub["t"] == 0.5 and [r["t"] for r in sub["requests"]] == [0.5, 2.5]
    assert sub["duration_ms"] == 2000
    # ids are dense over the whole tree: the child's own blocks follow the parent's first
    assert reqs[0]["hash_ids"] == [0, 1] and sub["requests"][1]["hash_ids"] == [2, 3, 4]
    assert reqs[2]["hash_ids"] == [0, 1, 5, 6] and reqs[2]["t"] == 3.0


def test_chat_turns_and_mixed_block_sizes_are_refused(tmp_path):
    chat = Session("c", (Turn(max_tokens=4, messages=({"role": "user", "content": "hi"},)),))
    with pytest.raises(NotBlockTrace, match="block traces"):
        to_weka(chat, "m")
    t = Turn(max_tokens=1, block_ids=(1,), num_tokens=8)
    with pytest.raises(ValueError, match="block sizes"):
        write_trace_dir([Session("a", (t,), block_tokens=16), Session("b", (t,), block_tokens=64)],
                        "m", tmp_path / "x")
