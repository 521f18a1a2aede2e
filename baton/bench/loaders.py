"""Trace files → sessions.

Real text (replayed message by message; turn k sends every message before the k-th assistant
message, with max_tokens = that assistant reply's length in tokens, its tool calls included):
  - τ-bench: a JSON list of records, each with `traj` (OpenAI-style messages). Sent as an
    agent sends them: assistant `tool_calls` and `tool` messages as they are, and `tools`
    (the functions the trace calls, each with the parameters its calls used; the trace holds
    no schemas, so `infer_tools` derives them from every call in the file).
  - SWE-agent: one `.traj` JSON object per file, with `history` (messages); tool calls are
    folded into the assistant's text.
Block hashes (prompts synthesized from hash ids, see tokens.BlockSynth):
  - Mooncake FAST'25: JSONL rows {timestamp (ms), input_length, output_length, hash_ids (512
    tokens each)}. Sessions are inferred: a row continues the session whose latest row's full
    blocks (at least two) are a prefix of its own ids; its think time is the timestamp gap.
  - AgentX / WEKA (cc-traces): a JSON trace {id, block_size (64), hash_id_scope, requests: [...]}
    whose requests are {t, in, out, hash_ids, think_time, api_time, ...} or nested subagents
    {type: "subagent", requests: [...]}. A file may hold one trace, a list, or JSONL.
"""
from __future__ import annotations

import gzip
import itertools
import json
import math
from pathlib import Path

from baton.bench.tokens import TokenCounter
from baton.bench.workload import BlockScope, Child, Scaling, Session, Turn, limit, scale_blocks

MOONCAKE_BLOCK = 512
WEKA_BLOCK = 64


def _open(path: Path):
    return gzip.open(path, "rt") if path.suffix == ".gz" else open(path)


def _tool_calls_text(calls) -> str:
    if not calls:
        return ""
    if isinstance(calls, str):
        return calls
    parts = []
    for call in calls:
        fn = call.get("function", call)
        parts.append(f"{fn.get('name', '')}({fn.get('arguments', '')})")
    return "\n".join(parts)


def clean_message(msg: dict) -> dict:
    """An OpenAI message the gateway can take: string content, tool calls folded into text.

    Chat templates such as SmolLM2's ignore `tool_calls` and reject `content: null`, so an
    assistant's tool calls are appended to its content as text (the load stays realistic).
    """
    text = msg.get("content") or ""
    if not isinstance(text, str):
        text = "".join(p.get("text", "") for p in text if isinstance(p, dict))
    calls = _tool_calls_text(msg.get("tool_calls"))
    if calls:
        text = f"{text}\n{calls}" if text else calls
    out = {"role": msg["role"], "content": text}
    if msg["role"] == "tool" and isinstance(msg.get("tool_call_id"), str):
        out["tool_call_id"] = msg["tool_call_id"]
    return out


def tool_message(msg: dict) -> dict:
    """An OpenAI message as an agent sends it: string content ("" beside tool calls, as
    OpenAI accepts and every chat template takes), `tool_calls` with JSON-text arguments, a
    tool message's `tool_call_id`."""
    text = msg.get("content")
    if text is not None and not isinstance(text, str):
        text = "".join(p.get("text", "") for p in text if isinstance(p, dict))
    out: dict = {"role": msg["role"], "content": text or ""}
    calls = msg.get("tool_calls")
    if calls and isinstance(calls, list):
        out["tool_calls"] = [{"id": c.get("id") or f"call_{k}", "type": "function", "function": {
            "name": c.get("function", {}).get("name", ""),
            "arguments": _arguments_text(c.get("function", {}).get("arguments"))}}
            for k, c in enumerate(calls)]
    if msg["role"] == "tool" and isinstance(msg.get("tool_call_id"), str):
        out["tool_call_id"] = msg["tool_call_id"]
    return out


def _arguments_text(args) -> str:
    return args if isinstance(args, str) else json.dumps(args or {})


_JSON_TYPES = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"),
               (list, "array"), (dict, "object"))


def infer_tools(conversations: list[list[dict]]) -> tuple[dict, ...]:
    """OpenAI `tools` for the functions called in `conversations`: each function's parameters
    are the arguments its calls used, typed by their JSON values (several types: any),
    required when every call had them; sorted by name, so every session sends the same list."""
    seen: dict[str, list[dict]] = {}
    for messages in conversations:
        for m in messages:
            for c in m.get("tool_calls") or ():
                try:
                    args = json.loads(c["function"]["arguments"] or "{}")
                except json.JSONDecodeError:
                    args = {}
                seen.setdefault(c["function"]["name"], []).append(
                    args if isinstance(args, dict) else {})
    return tuple({"type": "function", "function": {"name": name, "parameters": _schema(calls)}}
                 for name, calls in sorted(seen.items()) if name)


def _schema(calls: list[dict]) -> dict:
    props: dict[str, set[str]] = {}
    for args in calls:
        for key, value in args.items():
            props.setdefault(key, set()).add(next(t for cls, t in _JSON_TYPES
                                                  if isinstance(value, cls)))
    return {"type": "object",
            "properties": {k: ({"type": t.pop()} if len(t) == 1 else {})
                           for k, t in sorted(props.items())},
            "required": sorted(k for k in props if all(k in a for a in calls))}


def chat_session(name: str, messages: list[dict], counter: TokenCounter, scaling: Scaling,
                 think_s: list[float] | None = None, default_think_s: float = 1.0,
                 tools: tuple[dict, ...] | None = None) -> Session:
    """Turn k = all messages before the k-th assistant message (k ≥ 1 message before it).
    tools None: tool calls folded into text (`clean_message`); else sent as they are, with
    these `tools`."""
    keep = tools is not None
    msgs = [tool_message(m) if keep else clean_message(m) for m in messages
            if m.get("role") in ("system", "user", "assistant", "tool")]
    turns = []
    for i, m in enumerate(msgs):
        if m["role"] != "assistant" or i == 0:
            continue
        k = len(turns)
        gap = think_s[k] if think_s and k < len(think_s) and think_s[k] else default_think_s
        reply = (m["content"] or "") + _tool_calls_text(m.get("tool_calls"))
        turns.append(Turn(max_tokens=scaling.output(counter.count(reply)),
                          delay_s=0.0 if k == 0 else scaling.think(gap),
                          arrival_s=k * default_think_s * scaling.time_scale,
                          messages=tuple(msgs[:i])))
    return Session(name=name, turns=tuple(turns), tools=tools or ())


def load_tau_bench(path: Path, counter: TokenCounter, scaling: Scaling,
                   default_think_s: float = 1.0) -> list[Session]:
    """τ-bench records → sessions sending real `tools` / `tool_calls` (module docstring)."""
    with _open(path) as f:
        records = json.load(f)
    tools = infer_tools([[tool_message(m) for m in r["traj"]] for r in records])
    if scaling.max_sessions is not None:
        records = records[: scaling.max_sessions]
    sessions = [chat_session(f"tau-{r['task_id']}-{r['trial']}", r["traj"], counter, scaling,
                             default_think_s=default_think_s, tools=tools) for r in records]
    return limit([s for s in sessions if s.turns], scaling)


def load_swe_agent(path: Path, counter: TokenCounter, scaling: Scaling,
                   default_think_s: float = 1.0) -> list[Session]:
    """A folder of `.traj[.gz]` files, or one file. Tool time = the recorded execution_time."""
    files = sorted(p for p in path.iterdir() if ".traj" in p.name) if path.is_dir() else [path]
    if scaling.max_sessions is not None:
        files = files[: scaling.max_sessions]
    sessions = []
    for p in files:
        with _open(p) as f:
            traj = json.load(f)
        times = [step.get("execution_time") or 0.0 for step in traj.get("trajectory", [])]
        name = p.name.split(".traj")[0]
        s = chat_session(name, traj["history"], counter, scaling, think_s=[0.0] + times,
                         default_think_s=default_think_s)
        if s.turns:
            sessions.append(s)
    return limit(sessions, scaling)


def _block_turn(num_tokens: int, ids: list[int], trace_block: int, scaling: Scaling,
                max_tokens: int, delay_s: float, arrival_s: float) -> Turn | None:
    block = scaling.block_tokens or trace_block
    n, scaled_ids = scale_blocks(num_tokens, ids, trace_block, block)
    if n == 0 or not scaling.fits(n):
        return None
    return Turn(max_tokens=scaling.output(max_tokens), delay_s=delay_s, arrival_s=arrival_s,
                block_ids=scaled_ids, num_tokens=n)


def load_mooncake(path: Path, scaling: Scaling, max_rows: int | None = None) -> list[Session]:
    """Rows → sessions by prefix continuation (see the module docstring)."""
    with _open(path) as f:
        rows = [json.loads(line) for line in itertools.islice(f, max_rows) if line.strip()]
    sessions: list[list[dict]] = []
    tails: dict[tuple[int, int], int] = {}
    for row in rows:
        ids = row["hash_ids"]
        owner = None
        for i in range(len(ids) - 1, 0, -1):
            owner = tails.pop((i, ids[i]), None)
            if owner is not None:
                break
        if owner is None:
            owner = len(sessions)
            sessions.append([])
        sessions[owner].append(row)
        full = row["input_length"] // MOONCAKE_BLOCK
        if full >= 2:
            tails[(full - 1, ids[full - 1])] = owner
    out = []
    for k, rows_k in enumerate(sessions):
        start = rows_k[0]["timestamp"] / 1000.0
        turns, prev = [], start
        for row in rows_k:
            t = row["timestamp"] / 1000.0
            turn = _block_turn(row["input_length"], row["hash_ids"], MOONCAKE_BLOCK, scaling,
                               row["output_length"], scaling.think(t - prev) if turns else 0.0,
                               (t - start) * scaling.time_scale)
            if turn is None:
                break
            turns.append(turn)
            prev = t
        if turns:
            out.append(Session(name=f"mooncake-{k}", turns=tuple(turns),
                               block_tokens=scaling.block_tokens or MOONCAKE_BLOCK,
                               block_scope=BlockScope.GLOBAL, start_s=start * scaling.time_scale))
        if scaling.max_sessions is not None and len(out) >= scaling.max_sessions:
            break
    return limit(out, scaling)


def _weka_end(entry: dict) -> float:
    """Recorded end time of a request or a whole subagent (its last request's end)."""
    if entry.get("type") == "subagent":
        return max((_weka_end(r) for r in entry.get("requests", [])), default=entry.get("t", 0))
    return entry.get("t", 0.0) + entry.get("api_time", 0.0)


class _Fresh:
    """Unique negative ids for prompt tokens not covered by hash ids (never shared)."""

    def __init__(self):
        self.counter = itertools.count(1)

    def pad(self, ids: list[int], num_tokens: int, block: int) -> list[int]:
        missing = math.ceil(num_tokens / block) - len(ids)
        return list(ids) + [-next(self.counter) for _ in range(max(missing, 0))]


def weka_session(trace: dict, scaling: Scaling, name: str, origin: float = 0.0,
                 fresh: _Fresh | None = None) -> Session:
    """One WEKA/AgentX trace (or subagent entry) → Session with Child subagents."""
    fresh = fresh or _Fresh()
    block = int(trace.get("block_size", WEKA_BLOCK))
    turns: list[Turn] = []
    children: list[Child] = []
    pending: list[tuple[dict, int, float]] = []  # (subagent entry, after_turn, delay)
    last_end = origin
    for entry in trace.get("requests", []):
        if entry.get("type") == "subagent":
            delay = scaling.think(entry.get("t", last_end) - last_end)
            pending.append((entry, len(turns) - 1, delay))
            continue
        t = entry.get("t", 0.0)
        think = entry.get("think_time", t - last_end if turns else 0.0)
        ids = fresh.pad(entry.get("hash_ids", []), entry["in"], block)
        delay = scaling.think(think) if turns else 0.0
        turn = _block_turn(entry["in"], ids, block, scaling, entry.get("out", 1), delay,
                           (t - origin) * scaling.time_scale)
        if turn is None:
            break
        turns.append(turn)
        last_end = _weka_end(entry)
    for k, (entry, after, delay) in enumerate(pending):
        end = _weka_end(entry)
        join = next((j for j in range(after + 1, len(turns)) if _turn_time(trace, j) >= end),
                    None)
        sub = weka_session({**entry, "block_size": block}, scaling, f"{name}/sub{k}",
                           origin=origin, fresh=fresh)
        if sub.turns:
            children.append(Child(sub, after_turn=after, delay_s=delay, join_turn=join))
    scope = BlockScope.GLOBAL if trace.get("hash_id_scope") == "global" else BlockScope.TREE
    return Session(name=name, turns=tuple(turns), children=tuple(children),
                   block_tokens=scaling.block_tokens or block, block_scope=scope,
                   start_s=trace.get("start_s"))


def _turn_time(trace: dict, j: int) -> float:
    parents = [r for r in trace["requests"] if r.get("type") != "subagent"]
    return parents[j].get("t", 0.0)


def load_agentx(path: Path, scaling: Scaling) -> list[Session]:
    """AgentX/WEKA traces from a file (.json, .jsonl, optionally .gz) or a folder of them."""
    files = sorted(p for p in path.iterdir() if ".json" in p.name) if path.is_dir() else [path]
    traces = []
    for p in files:
        with _open(p) as f:
            text = f.read()
        if ".jsonl" in p.name:
            traces += [json.loads(line) for line in text.splitlines() if line.strip()]
        else:
            data = json.loads(text)
            traces += data if isinstance(data, list) else [data]
    if scaling.max_sessions is not None:
        traces = traces[: scaling.max_sessions]
    sessions = [weka_session(t, scaling, str(t.get("id", f"trace{i}")))
                for i, t in enumerate(traces)]
    return limit([s for s in sessions if s.turns], scaling)
