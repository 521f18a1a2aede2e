"""Session → the exact requests to send, their token counts and their ideal cache hits.

Cache-busting (as AgentX): every replayed session tree gets a marker `[rid:<12 hex>]` at the
start of its first user message (chat) or its own token namespace (block traces whose ids are
tree-local). A tree's own turns and subagents still share; two replays never alias, and a
second run against the same server (a sweep level) starts cold except for prefixes that are
really common to all sessions, such as τ-bench's system prompt.

Theoretical prefix-cache hit (what a perfect, unbounded prefix cache could serve):

    For request r of a session tree with prompt tokens p_r (after the chat template),
        hit(r) = min( max_{q before r in the same tree} LCP(p_r, p_q),  len(p_r) - 1 )
    where LCP is the length of the longest common token prefix, "before" is the tree's
    recorded order (arrival time; turn order within a session), and the last prompt token is
    always computed (its logits give the first output token). The workload's theoretical
    maximum over a set of requests R is  Σ_R hit(r) / Σ_R len(p_r).

It ignores the server's block granularity (a real cache keeps full `block_size` blocks) and
sharing across trees; the report adds a second figure, the "global" ideal, that also counts
prefixes of any earlier request of the run (in dispatch order) in 16-token blocks.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from baton.bench.tokens import BlockSynth, TokenCounter
from baton.bench.workload import BlockScope, Child, Session, Turn

CHAT_ENDPOINT = "/v1/chat/completions"
COMPLETIONS_ENDPOINT = "/v1/completions"
KEY_TOKENS = 16


@dataclass
class PreparedTurn:
    """One request ready to send: endpoint + body (minus model/stream) + accounting."""

    turn: Turn
    endpoint: str
    body: dict
    prompt_tokens: int
    theo_hit: int = 0
    keys: tuple[int, ...] = ()


@dataclass
class PreparedSession:
    session_id: str
    session: Session
    turns: list[PreparedTurn]
    children: list[tuple[Child, PreparedSession]] = field(default_factory=list)

    def all_turns(self) -> list[PreparedTurn]:
        out = list(self.turns)
        for _, kid in self.children:
            out += kid.all_turns()
        return out


def lcp(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def theoretical_hits(prompts: list[np.ndarray]) -> list[int]:
    """hit(r) of the module docstring for prompts given in order."""
    hits = []
    for i, p in enumerate(prompts):
        best, cap = 0, max(len(p) - 1, 0)
        for q in reversed(prompts[:i]):
            best = max(best, lcp(p, q))
            if best >= cap:
                break
        hits.append(min(best, cap))
    return hits


def prefix_keys(tokens: np.ndarray) -> tuple[int, ...]:
    """Chained hashes of the full KEY_TOKENS-token blocks (equal key ⇔ equal prefix)."""
    keys, prev = [], 0
    for i in range(len(tokens) // KEY_TOKENS):
        prev = hash((prev, tokens[i * KEY_TOKENS:(i + 1) * KEY_TOKENS].tobytes()))
        keys.append(prev)
    return tuple(keys)


def marker(run_salt: str, tree_index: int) -> str:
    """12 hex digits naming one replay of one session tree."""
    return hashlib.blake2b(f"{run_salt}/{tree_index}".encode(), digest_size=6).hexdigest()


def _mark(messages: tuple[dict, ...], mark: str) -> list[dict]:
    msgs = [dict(m) for m in messages]
    target = next((m for m in msgs if m["role"] == "user"), msgs[0])
    target["content"] = f"[rid:{mark}]\n\n{target['content']}"
    return msgs


class Preparer:
    """Renders sessions for one run. prompt_format: "tokens" | "text" (block traces only)."""

    def __init__(self, counter: TokenCounter, run_salt: str, prompt_format: str = "tokens",
                 max_context_tokens: int | None = None):
        self.counter = counter
        self.run_salt = run_salt
        self.prompt_format = prompt_format
        self.max_context_tokens = max_context_tokens
        self._synth: dict[int, BlockSynth] = {}

    def synth(self, block_tokens: int) -> BlockSynth:
        if block_tokens not in self._synth:
            self._synth[block_tokens] = BlockSynth(self.counter.tokenizer, block_tokens)
        return self._synth[block_tokens]

    def prepare(self, session: Session, tree_index: int) -> PreparedSession:
        mark = marker(self.run_salt, tree_index)
        local = session.block_scope == BlockScope.TREE
        ns = f"{self.run_salt}/{mark}" if local else self.run_salt
        root, flat = self._render(session, f"{mark}-{session.name}", mark, ns)
        order = sorted(range(len(flat)), key=lambda i: flat[i][0].turn.arrival_s)
        hits = theoretical_hits([flat[i][1] for i in order])
        for i, hit in zip(order, hits):
            flat[i][0].theo_hit = hit
        return root

    def _render(self, session: Session, sid: str, mark: str,
                ns: str) -> tuple[PreparedSession, list[tuple[PreparedTurn, np.ndarray]]]:
        """The prepared tree, and every (turn, prompt tokens) of it for the hit computation."""
        if session.turns and session.turns[0].is_chat:
            flat = self._chat(session, mark)
        else:
            flat = self._blocks(session, ns)
        prepared = PreparedSession(sid, session, [p for p, _ in flat])
        for k, child in enumerate(session.children):
            kid, kid_flat = self._render(child.session, f"{sid}/{k}", mark, ns)
            prepared.children.append((child, kid))
            flat += kid_flat
        return prepared, flat

    def _chat(self, session: Session, mark: str) -> list[tuple[PreparedTurn, np.ndarray]]:
        last = session.turns[-1].messages
        msgs = _mark(last, mark)
        ends = [len(t.messages) for t in session.turns]
        tools = [dict(t) for t in session.tools]
        prompts = self.counter.chat_prompts(msgs, ends, tools)
        out = []
        for turn, end, toks in zip(session.turns, ends, prompts):
            if self.max_context_tokens and len(toks) > self.max_context_tokens:
                break
            body = {"messages": msgs[:end], "max_tokens": turn.max_tokens}
            if tools:
                body["tools"] = tools
            out.append((PreparedTurn(turn, CHAT_ENDPOINT, body, len(toks),
                                     keys=prefix_keys(toks)), toks))
        return out

    def _blocks(self, session: Session, ns: str) -> list[tuple[PreparedTurn, np.ndarray]]:
        synth = self.synth(session.block_tokens)
        out = []
        for turn in session.turns:
            words = synth.word_indices(ns, turn.block_ids, turn.num_tokens)
            if self.prompt_format == "tokens" and synth.has_token_ids:
                prompt = np.asarray(synth.token_ids, np.int64)[words].tolist()
            else:
                prompt = "".join(synth.words[i] for i in words)
            body = {"prompt": prompt, "max_tokens": turn.max_tokens}
            out.append((PreparedTurn(turn, COMPLETIONS_ENDPOINT, body, turn.num_tokens,
                                     keys=prefix_keys(words)), words))
        return out

