"""Baton block-trace sessions → AgentX (WEKA cc-traces) trace files, for the AgentX harness.

The harness (`agentx profile --custom-dataset-type weka_trace --input-file DIR`) replays a
folder of trace JSON files, one session tree per file, in its own format
(aiperf/dataset/loader/weka_trace_models.py in the `agentx-harness` wheel):

    {"id", "models": [model], "block_size", "hash_id_scope": "local",
     "requests": [{"t", "type": "s", "model", "in", "out", "hash_ids", "think_time",
                   "api_time"} | {"t", "type": "subagent", "agent_id", "subagent_type",
                   "status", "duration_ms", "models", "requests": [...]}]}

Any workload Baton loads as block turns converts: the Mooncake FAST'25 trace (sessions
inferred by prefix continuation), the synthetic and bursts generators, and AgentX traces
themselves (after Baton's scaling). Text traces (τ-bench, SWE-agent) have no hash ids and are
refused.

What is kept, what changes:
  - Lengths and hash ids are Baton's scaled ones (`--block-tokens`, `--max-context-tokens`,
    `--max-output-tokens`): `in` = Turn.num_tokens, `out` = Turn.max_tokens,
    `block_size` = Session.block_tokens, so both drivers replay the same prompts' shape.
  - Times: the harness waits `t_k − (t_{k−1} + api_time_{k−1})` after a turn ends. Writing
    `api_time = 0` and `t_k = t_{k−1} + delay_k` (Baton's scaled, capped think time) makes its
    wait equal Baton's `Turn.delay_s`; `think_time` carries the same value.
  - Hash ids become dense non-negative ints per session tree (`hash_id_scope: local`, the only
    scope the harness takes): ids shared across sessions (Mooncake's global ids, the synthetic
    system prompt) stop aliasing between files, so cross-session prefix reuse is not replayed.
  - A subagent entry follows its spawning turn, at that turn's `t` plus its delay (with
    `api_time = 0` a turn ends at its `t` on the trace's clock); its `duration_ms` is its last
    request's `t` minus its spawn; the harness decides from these times which parent turn
    waits for it.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from baton.bench.workload import Child, Session, Turn


class NotBlockTrace(ValueError):
    """The workload's turns are chat messages, not block hash ids (τ-bench, SWE-agent)."""


class _Ids:
    """Dense per-tree renumbering of hash ids (first seen → 0, 1, ...)."""

    def __init__(self) -> None:
        self.map: dict[int, int] = {}

    def __call__(self, ids: tuple[int, ...]) -> list[int]:
        return [self.map.setdefault(i, len(self.map)) for i in ids]


def _request(turn: Turn, t: float, model: str, ids: _Ids) -> dict:
    if turn.is_chat or not turn.block_ids:
        raise NotBlockTrace("the AgentX harness replays block traces (hash ids); this "
                            "workload has chat turns: use mooncake, synthetic, bursts or agentx")
    return {"t": round(t, 6), "type": "s", "model": model, "in": int(turn.num_tokens),
            "out": int(turn.max_tokens), "hash_ids": ids(turn.block_ids),
            "think_time": round(turn.delay_s, 6), "api_time": 0.0}


def _requests(session: Session, model: str, ids: _Ids, t0: float, prefix: str) -> list[dict]:
    """The session's turns in order, each child's subagent entry right after its spawn turn."""
    by_turn: dict[int, list[tuple[int, Child]]] = {}
    for k, child in enumerate(session.children):
        by_turn.setdefault(child.after_turn, []).append((k, child))
    out: list[dict] = []
    t = t0

    def spawn(after: int, at: float) -> None:
        for k, child in by_turn.get(after, []):
            start = at + child.delay_s
            inner = _requests(child.session, model, ids, start, f"{prefix}{k}.")
            if not inner:
                continue
            out.append({"t": round(start, 6), "type": "subagent", "agent_id": f"agent_{prefix}{k}",
                        "subagent_type": "baton", "status": "completed",
                        "duration_ms": int(round((inner[-1]["t"] - start) * 1000)),
                        "models": [model], "requests": inner})

    spawn(-1, t0)
    for j, turn in enumerate(session.turns):
        t = t + (turn.delay_s if j else 0.0)
        out.append(_request(turn, t, model, ids))
        spawn(j, t)
    return out


def to_weka(session: Session, model: str) -> dict:
    """One session tree → one AgentX/WEKA trace dict (see the module docstring).

    Raises NotBlockTrace for chat turns, ValueError for a session without block geometry.
    """
    if session.block_tokens < 1:
        raise NotBlockTrace(f"session {session.name!r} has no block size: the AgentX harness "
                            "replays block traces (mooncake, synthetic, bursts, agentx)")
    return {"id": session.name, "models": [model], "block_size": int(session.block_tokens),
            "hash_id_scope": "local", "tool_tokens": 0, "system_tokens": 0,
            "requests": _requests(session, model, _Ids(), 0.0, "")}


def _file_name(k: int, name: str) -> str:
    return f"{k:05d}-{re.sub(r'[^A-Za-z0-9_.-]+', '_', name)[:60]}.json"


def write_trace_dir(sessions: list[Session], model: str, folder: Path) -> list[Path]:
    """Write one trace file per session tree into `folder` (created); returns the paths.

    All sessions must share one block size (the harness takes one `--isl-block-size`).
    """
    sizes = {s.block_tokens for s in sessions}
    if len(sizes) > 1:
        raise ValueError(f"sessions mix block sizes {sorted(sizes)}; pass --block-tokens")
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for k, session in enumerate(sessions):
        path = folder / _file_name(k, session.name)
        path.write_text(json.dumps(to_weka(session, model), separators=(",", ":")))
        paths.append(path)
    return paths
