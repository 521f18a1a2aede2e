"""A seeded AgentX-like workload generator.

Each session: a system prompt shared by every session (global block ids), a first user message,
then turns whose prompt is the previous prompt + the previous reply + new tool/user tokens.
Outputs are short (tool calls) with an occasional long one (reasoning). Between turns: tool time.
After a turn, a session may fan out subagents (fresh context with their own shared system
prompt) that the next parent turn waits for (a join) or that run in the background.
Prompts are block traces (`block_tokens` per id) with global scope. Token sizes are given for
64-token blocks; `Scaling.block_tokens` shrinks every prompt size by the same factor (outputs
are capped separately, by `Scaling.max_output_tokens`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from baton.bench.workload import BlockScope, Child, Scaling, Session, Turn

_SUB_SYSTEM_BASE = 500_000
_SESSION_STRIDE = 1_000_000


@dataclass(frozen=True)
class SyntheticConfig:
    """Shape of the synthetic workload (token counts before `Scaling` caps)."""

    sessions: int = 32
    min_turns: int = 3
    max_turns: int = 10
    system_tokens: int = 1024
    first_user_tokens: int = 256
    growth_tokens: int = 192          # median new tokens per turn (tool result + user)
    output_tokens: int = 48           # median output of a turn
    long_output_prob: float = 0.1     # a turn writes 4× more (reasoning)
    think_s: float = 2.0              # median tool time between turns
    subagent_prob: float = 0.15       # per parent turn
    max_fanout: int = 3
    subagent_turns: int = 2
    join_prob: float = 0.8            # a subagent gates the next parent turn
    session_rate: float = 0.5         # sessions per second (open loop start times)
    block_tokens: int = 64
    seed: int = 0


def _lognormal(rng: np.random.Generator, median: float, sigma: float = 0.6) -> float:
    return float(median * math.exp(rng.normal(0.0, sigma)))


class _Builder:
    def __init__(self, cfg: SyntheticConfig, scaling: Scaling, rng: np.random.Generator):
        self.cfg, self.scaling, self.rng = cfg, scaling, rng
        self.block = scaling.block_tokens or cfg.block_tokens
        self.shrink = self.block / cfg.block_tokens

    def tokens(self, median: float) -> int:
        return max(1, int(_lognormal(self.rng, median * self.shrink)))

    def _ids(self, num_tokens: int, shared: int, shared_base: int, own_base: int) -> tuple:
        n = math.ceil(num_tokens / self.block)
        return tuple(shared_base + i if i < shared else own_base + i for i in range(n))

    def agent(self, name: str, system_tokens: int, shared_base: int, own_base: int,
              num_turns: int, origin: float, subagents: bool) -> Session:
        cfg, rng, sc = self.cfg, self.rng, self.scaling
        system_tokens = int(system_tokens * self.shrink) // self.block * self.block
        system_tokens = max(self.block, system_tokens)
        shared = system_tokens // self.block
        length = system_tokens + self.tokens(cfg.first_user_tokens)
        turns, children, clock = [], [], origin
        for k in range(num_turns):
            out = _lognormal(rng, cfg.output_tokens) * (4 if rng.random() < cfg.long_output_prob
                                                        else 1)
            think = _lognormal(rng, cfg.think_s) if k else 0.0
            if not sc.fits(length):
                break
            clock += think
            turns.append(Turn(max_tokens=sc.output(int(out)), delay_s=sc.think(think),
                              arrival_s=clock * sc.time_scale, num_tokens=length,
                              block_ids=self._ids(length, shared, shared_base, own_base)))
            if subagents and rng.random() < cfg.subagent_prob and k + 1 < num_turns:
                children += self.fanout(name, k, own_base, clock)
            length += turns[-1].max_tokens + self.tokens(cfg.growth_tokens)  # reply + tool result
        return Session(name=name, turns=tuple(turns), children=tuple(children),
                       block_tokens=self.block, block_scope=BlockScope.GLOBAL)

    def fanout(self, name: str, after: int, own_base: int, clock: float) -> list[Child]:
        cfg, rng = self.cfg, self.rng
        kids = []
        for j in range(int(rng.integers(1, cfg.max_fanout + 1))):
            base = own_base + (after + 1) * 10_000 + j * 1_000
            sub = self.agent(f"{name}/sub{after}.{j}", cfg.system_tokens // 2, _SUB_SYSTEM_BASE,
                             base, cfg.subagent_turns, clock, subagents=False)
            if sub.turns:
                join = after + 1 if rng.random() < cfg.join_prob else None
                kids.append(Child(sub, after_turn=after, delay_s=0.0, join_turn=join))
        return kids


def generate(cfg: SyntheticConfig, scaling: Scaling) -> list[Session]:
    """`cfg.sessions` sessions (capped by scaling.max_sessions), deterministic in `cfg.seed`."""
    rng = np.random.default_rng(cfg.seed)
    builder = _Builder(cfg, scaling, rng)
    n = cfg.sessions if scaling.max_sessions is None else min(cfg.sessions, scaling.max_sessions)
    sessions, start = [], 0.0
    for i in range(n):
        turns = int(rng.integers(cfg.min_turns, cfg.max_turns + 1))
        if scaling.max_turns is not None:
            turns = min(turns, scaling.max_turns)
        s = builder.agent(f"syn-{i}", cfg.system_tokens, 0, (i + 1) * _SESSION_STRIDE, turns,
                          0.0, subagents=True)
        if s.turns:
            sessions.append(Session(name=s.name, turns=s.turns, children=s.children,
                                    block_tokens=s.block_tokens, block_scope=s.block_scope,
                                    start_s=start * scaling.time_scale))
        start += float(rng.exponential(1.0 / cfg.session_rate))
    return sessions


@dataclass(frozen=True)
class BurstsConfig:
    """Long-prefill bursts over running decodes (the disaggregated-vs-colocated ITL test).

    Sessions alternate between two kinds, so a closed loop keeps both live at once:
    - decoders: a short private prompt (`decode_prompt_tokens`), long outputs
      (`decode_output_tokens`), `decode_turns` turns, each adding the reply + `growth_tokens`;
    - bursts: `burst_turns` turns, each a fresh private prompt of ~`burst_prompt_tokens`
      (nothing shared, nothing cached) with a tiny output (`burst_output_tokens`).
    No think time: a burst arrives while decoders are mid-stream. Every ITL gap of a decoder
    that overlaps a burst's prefill shows whether the prefill stalled its decode steps.
    """

    sessions: int = 32
    decode_prompt_tokens: int = 96
    decode_output_tokens: int = 64
    decode_turns: int = 4
    growth_tokens: int = 32
    burst_prompt_tokens: int = 1536
    burst_output_tokens: int = 4
    burst_turns: int = 2
    seed: int = 0


def bursts(cfg: BurstsConfig, scaling: Scaling) -> list[Session]:
    """`cfg.sessions` sessions (capped by scaling.max_sessions): decoder, burst, decoder, ...;
    deterministic in `cfg.seed`. Block traces, `scaling.block_tokens` (16) tokens per id."""
    rng = np.random.default_rng(cfg.seed)
    block = scaling.block_tokens or 16
    n = cfg.sessions if scaling.max_sessions is None else min(cfg.sessions, scaling.max_sessions)

    def ids(num_tokens: int, base: int) -> tuple[int, ...]:
        return tuple(base + i for i in range(math.ceil(num_tokens / block)))

    sessions = []
    for i in range(n):
        base = (i + 1) * _SESSION_STRIDE
        turns = []
        if i % 2 == 0:
            length = max(1, int(_lognormal(rng, cfg.decode_prompt_tokens, 0.3)))
            for _ in range(cfg.decode_turns):
                if not scaling.fits(length):
                    break
                out = scaling.output(cfg.decode_output_tokens)
                turns.append(Turn(max_tokens=out, num_tokens=length,
                                  block_ids=ids(length, base)))
                length += out + cfg.growth_tokens
            name = f"dec-{i}"
        else:
            for k in range(cfg.burst_turns):
                length = max(1, int(_lognormal(rng, cfg.burst_prompt_tokens, 0.2)))
                if not scaling.fits(length):
                    continue
                turns.append(Turn(max_tokens=scaling.output(cfg.burst_output_tokens),
                                  num_tokens=length,
                                  block_ids=ids(length, base + k * (_SESSION_STRIDE // 8))))
            name = f"burst-{i}"
        if turns:
            sessions.append(Session(name=name, turns=tuple(turns), block_tokens=block,
                                    block_scope=BlockScope.GLOBAL, start_s=0.0))
    return sessions
