"""The pure parts of the peer benchmark (benchmarks/peer_llamacpp.py): prompts, the agentic
conversation, and the numbers. No server, no network: tests/bench/test_peer.py covers them.

Prompts are raw text for `/v1/completions`, so both servers tokenize the same string with the
same vocabulary (the GGUF carries the HF tokenizer) and no chat template can differ between
them. Filler words are common English words, about one token each with SmolLM2's BPE.

An agentic session is a base prompt, then per turn: the reply the server gave + a synthetic
tool result + the cue for the next reply. Turn k's prompt is turn k−1's prompt + its reply +
the tool result, so a server that keeps the session's KV only prefills the new tail.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

WORDS = ("the agent reads a file and runs the tool then checks each result for errors in "
         "code test build output line value list name path data time step plan task note "
         "call return state cache block token model server request reply session").split()
CUE = "\nAssistant:"


def filler(seed: str, n_words: int) -> str:
    """`n_words` words drawn from WORDS by a generator seeded with `seed` (deterministic)."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def base_prompt(tag: str, n_words: int) -> str:
    """A fresh prompt: the tag first (busts caches between rounds), then filler, then the cue."""
    return f"[run:{tag}] System: you are a coding agent.\nUser: {filler(tag, n_words)}{CUE}"


def tool_result(tag: str, session: int, turn: int, n_words: int) -> str:
    """The synthetic tool output appended after turn `turn`'s reply (the same on every server)."""
    body = filler(f"{tag}/s{session}/t{turn}", n_words)
    return f"\nTool result ({turn}):\n{body}{CUE}"


@dataclass
class AgenticSession:
    """One session's conversation so far; `prompt` is what the next turn sends."""

    tag: str
    index: int
    base_words: int
    tool_words: int
    prompt: str = ""
    turns_done: int = 0

    def __post_init__(self) -> None:
        if not self.prompt:
            self.prompt = base_prompt(f"{self.tag}/s{self.index}", self.base_words)

    def add_reply(self, reply: str) -> str:
        """Append the reply and the next tool result; returns the next turn's prompt."""
        self.prompt += reply + tool_result(self.tag, self.index, self.turns_done,
                                           self.tool_words)
        self.turns_done += 1
        return self.prompt


def decode_itl(first: float, last: float, tokens: int) -> float | None:
    """Mean inter-token latency from streamed chunk times: (last − first) / (tokens − 1).

    `tokens` comes from the server's usage, so servers that pack several tokens in one chunk
    are measured alike; None with fewer than two tokens.
    """
    if tokens < 2 or last < first:
        return None
    return (last - first) / (tokens - 1)


def percentile(xs: list[float], q: float) -> float | None:
    """The q-th percentile (0–100), linear between closest ranks (numpy's default)."""
    if not xs:
        return None
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def median(xs: list[float]) -> float | None:
    return percentile(xs, 50)


def throughput(starts: list[float], ends: list[float], tokens: list[int]) -> float | None:
    """Output tokens per second over the wall time from the first start to the last end."""
    if not starts or not ends:
        return None
    wall = max(ends) - min(starts)
    return sum(tokens) / wall if wall > 0 else None


def ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den == 0:
        return None
    return num / den


@dataclass(frozen=True)
class Target:
    """One issue-17 target: Baton's number over the peer's (`higher` = Baton's should be
    larger), met when that ratio is ≤ `limit` (lower is better) or ≥ `limit` (higher)."""

    name: str
    unit: str
    higher_is_better: bool
    limit: float

    def baton_vs_peer(self, baton: float | None, peer: float | None) -> float | None:
        return ratio(baton, peer)

    def met(self, r: float | None) -> bool | None:
        if r is None:
            return None
        return r >= self.limit if self.higher_is_better else r <= self.limit


TARGETS = {
    # batch-1 ITL: Baton ≤ 1.1 × llama.cpp's
    "itl_ms": Target("batch-1 ITL", "ms/token", higher_is_better=False, limit=1.1),
    # 8 concurrent streams: Baton's output tok/s ≥ 1.5 × llama.cpp's
    "streams_tok_s": Target("8-stream output", "tok/s", higher_is_better=True, limit=1.5),
    # agentic TTFT p90 ≥ 2× better: Baton's p90 ≤ 0.5 × llama.cpp's
    "agentic_ttft_p90_ms": Target("agentic TTFT p90", "ms", higher_is_better=False, limit=0.5),
    "agentic_ttft_p50_ms": Target("agentic TTFT p50", "ms", higher_is_better=False, limit=0.5),
}
# issue 24, against vLLM's CPU build on the same cores (benchmarks/peer_vllm.py)
VLLM_TARGETS = {
    "itl_ms": Target("batch-1 ITL", "ms/token", higher_is_better=False, limit=0.6),
    "cold_ttft_ms": Target("cold TTFT ~1k tokens", "ms", higher_is_better=False, limit=1.0),
    "streams_tok_s": Target("8-stream output", "tok/s", higher_is_better=True, limit=1.5),
}


def summarize(values: dict[str, list[float | None]]) -> dict[str, float | None]:
    """Per metric, the median over rounds."""
    return {k: median([v for v in vs if v is not None]) for k, vs in values.items()}


def table(peer: dict[str, float | None], baton: dict[str, float | None],
          targets: dict[str, Target] = TARGETS, peer_name: str = "peer") -> list[str]:
    """One line per target: peer, Baton, Baton/peer, the limit and whether it is met."""
    lines = [f"{'metric':24s}{peer_name:>12s}{'baton':>12s}{'baton/' + peer_name:>12s}  target"]
    for key, t in targets.items():
        p, b = peer.get(key), baton.get(key)
        r = t.baton_vs_peer(b, p)
        op = ">=" if t.higher_is_better else "<="
        verdict = {None: "n/a", True: "met", False: "NOT met"}[t.met(r)]
        fmt = (lambda x: "-" if x is None else f"{x:.2f}")
        lines.append(f"{t.name + ' ' + t.unit:24s}{fmt(p):>12s}{fmt(b):>12s}{fmt(r):>12s}"
                     f"  {op} {t.limit:g}: {verdict}")
    return lines
