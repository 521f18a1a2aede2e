"""What a workload is, independent of how it is sent.

A workload is a list of session trees. A `Session` is an ordered list of `Turn`s sent one after
another (turn k+1 only after turn k completes, then after its think/tool time); it may spawn
`Child` sessions (subagents) that run concurrently with it and may gate a later parent turn:

    parent:  T0 ──▶ T1 ──────────────▶ T2 (waits for A and B: join) ──▶ T3
                     ├─▶ child A: a0 ─▶ a1 ┘
                     └─▶ child B: b0 ──────┘
                     └─▶ child C (background: gates nothing, the tree ends when it ends)

A turn's prompt is either a chat message list (real-text traces) or a list of block hash ids
(block traces: every id stands for `Session.block_tokens` tokens; equal ids mean equal tokens,
so equal leading ids are a shared KV prefix). Lengths and times here are already scaled.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from enum import StrEnum


class BlockScope(StrEnum):
    """Which hash ids alias each other.

    GLOBAL: one id means the same tokens in every session (Mooncake, the synthetic system prompt).
    TREE: ids are local to one session tree (AgentX/WEKA `hash_id_scope: local`).
    """

    GLOBAL = "global"
    TREE = "tree"


@dataclass(frozen=True)
class Turn:
    """One request of a session.

    max_tokens: output length to force (sent with `ignore_eos`).
    delay_s: idle time before this turn is sent, measured from the end of the previous turn of
      the same session (think time / tool time), already scaled and capped.
    arrival_s: trace time of this turn relative to its root session's start (open loop).
    messages: chat prompt (the whole conversation so far), or () for a block turn.
    block_ids / num_tokens: block prompt: hash ids and the exact prompt length in tokens.
    """

    max_tokens: int
    delay_s: float = 0.0
    arrival_s: float = 0.0
    messages: tuple[dict, ...] = ()
    block_ids: tuple[int, ...] = ()
    num_tokens: int = 0

    @property
    def is_chat(self) -> bool:
        return bool(self.messages)


@dataclass(frozen=True)
class Child:
    """A subagent: starts `delay_s` after parent turn `after_turn` completes (-1: at the start).

    join_turn: index of the parent turn that waits for this child to finish; None = background.
    """

    session: Session
    after_turn: int
    delay_s: float = 0.0
    join_turn: int | None = None


@dataclass(frozen=True)
class Session:
    """One session tree as recorded: its turns, its subagents, its block geometry."""

    name: str
    turns: tuple[Turn, ...]
    children: tuple[Child, ...] = ()
    block_tokens: int = 0
    block_scope: BlockScope = BlockScope.GLOBAL
    start_s: float | None = None  # absolute trace start (open loop); None: drawn from a rate
    tools: tuple[dict, ...] = ()  # OpenAI `tools` every chat turn sends (none: no field)

    def num_requests(self) -> int:
        return len(self.turns) + sum(c.session.num_requests() for c in self.children)


@dataclass(frozen=True)
class Scaling:
    """How a trace is shrunk to fit this machine. Applied by the loaders.

    block_tokens: tokens per hash id for block traces (None: the trace's own size); shrinking it
      shrinks every block-trace context by the same factor and keeps the sharing structure.
    max_context_tokens: a session ends before its first turn whose prompt is longer.
    max_output_tokens: cap on every turn's max_tokens.
    time_scale: multiplies every think/tool time and trace timestamp (0.1 = ten times faster).
    max_think_s: cap on one think/tool time after scaling (AgentX caps idle gaps too).
    max_sessions / max_turns: keep the first sessions / the first turns of each session.
    """

    block_tokens: int | None = None
    max_context_tokens: int | None = None
    max_output_tokens: int | None = None
    time_scale: float = 1.0
    max_think_s: float = 10.0
    max_sessions: int | None = None
    max_turns: int | None = None

    def __post_init__(self) -> None:
        if self.time_scale < 0 or self.max_think_s < 0:
            raise ValueError("time_scale and max_think_s must be ≥ 0")
        for name in ("block_tokens", "max_context_tokens", "max_output_tokens", "max_sessions",
                     "max_turns"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be ≥ 1, got {value}")

    def think(self, seconds: float) -> float:
        return min(max(seconds, 0.0) * self.time_scale, self.max_think_s)

    def output(self, tokens: int) -> int:
        tokens = max(int(tokens), 1)
        return min(tokens, self.max_output_tokens) if self.max_output_tokens else tokens

    def fits(self, prompt_tokens: int) -> bool:
        return self.max_context_tokens is None or prompt_tokens <= self.max_context_tokens


def scale_blocks(num_tokens: int, hash_ids: list[int], trace_block: int,
                 block_tokens: int) -> tuple[int, tuple[int, ...]]:
    """Rescale a block-trace prompt from `trace_block` to `block_tokens` tokens per id.

    The number of ids is kept (the sharing structure); the length becomes the same fraction of
    the new blocks: `ceil(num_tokens * block_tokens / trace_block)`, at most len(ids) blocks.
    """
    if not hash_ids:
        return 0, ()
    scaled = math.ceil(num_tokens * block_tokens / trace_block)
    scaled = max(1, min(scaled, len(hash_ids) * block_tokens))
    needed = math.ceil(scaled / block_tokens)
    return scaled, tuple(hash_ids[:needed])


def limit(sessions: list[Session], scaling: Scaling) -> list[Session]:
    """Apply max_sessions / max_turns (turn cut also drops children spawned after the cut)."""
    if scaling.max_sessions is not None:
        sessions = sessions[: scaling.max_sessions]
    if scaling.max_turns is None:
        return sessions
    out = []
    for s in sessions:
        n = scaling.max_turns
        kids = tuple(replace(c, join_turn=c.join_turn if (c.join_turn or 0) < n else None)
                     for c in s.children if c.after_turn < n - 1)
        out.append(replace(s, turns=s.turns[:n], children=kids))
    return out


@dataclass
class WorkloadInfo:
    """A short description for the report."""

    name: str
    sessions: int
    requests: int
    notes: list[str] = field(default_factory=list)


def describe(name: str, sessions: list[Session], notes: list[str] | None = None) -> WorkloadInfo:
    return WorkloadInfo(name=name, sessions=len(sessions),
                        requests=sum(s.num_requests() for s in sessions), notes=notes or [])
