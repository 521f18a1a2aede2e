"""Where the drafter keeps tokens between requests (drafter.py): one index per session, the
recent outputs of every request. Both live on the worker that holds the session's KV (the
decode worker when disaggregated); a session that moves is rebuilt from its next prompt.

    session "s": turn 1 [system, user₁] → out₁                 index I₁ over turn 1's tokens
                 turn 2 [system, user₁, out₁', tool₁]          out₁' = out₁ re-tokenized
                        ├── common prefix c with I₁ ──┤
                 c ≥ half of I₁: I₁ is copied, cut to c, continued over turn 2 (`start`)
                 else: a fresh index for turn 2; I₁ stays searchable beside it (the side)
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from baton.engine.spec.token_index import TokenIndex

SEPARATOR = -1  # between unrelated outputs in the recent list: never part of a match


class SessionIndices:
    """session id → the index its last finished request left; least recently used first
    out once their tokens pass `max_tokens` (the most recent one always stays)."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._indices: OrderedDict[str, TokenIndex] = OrderedDict()
        self._tokens = 0

    def start(self, session_id: str, tokens: list[int]) -> tuple[TokenIndex, TokenIndex | None]:
        """(own, side) for a new request of the session whose token list is `tokens`:
        own continues the session's index when `tokens` shares at least half of it as a
        prefix (side None); else own is fresh and side is the session's index (or None)."""
        base = self._indices.get(session_id)
        if base is None:
            return TokenIndex(tokens), None
        self._indices.move_to_end(session_id)
        c = common_prefix(base.tokens, tokens, base.num_indexed)
        if 2 * c >= base.num_indexed:
            return base.copy_onto(tokens, c), None
        return TokenIndex(tokens), base

    def put(self, session_id: str, index: TokenIndex) -> None:
        """Keep `index` (its token list is no longer written) as the session's."""
        old = self._indices.pop(session_id, None)
        if old is not None:
            self._tokens -= old.num_indexed
        self._indices[session_id] = index
        self._tokens += index.num_indexed
        while self._tokens > self.max_tokens and len(self._indices) > 1:
            _, evicted = self._indices.popitem(last=False)
            self._tokens -= evicted.num_indexed

    def drop(self, session_id: str) -> None:
        old = self._indices.pop(session_id, None)
        if old is not None:
            self._tokens -= old.num_indexed

    def __len__(self) -> int:
        return len(self._indices)

    @property
    def num_tokens(self) -> int:
        return self._tokens


class RecentOutputs:
    """The outputs of recently finished requests, back to back with separators, indexed;
    at most `max_tokens` (the older half is dropped and the rest re-indexed when full)."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.index = TokenIndex([])

    def add(self, output_token_ids: Sequence[int]) -> None:
        if not output_token_ids or self.max_tokens <= 0:
            return
        tokens = self.index.tokens
        tokens.extend(output_token_ids[-self.max_tokens:])
        tokens.append(SEPARATOR)
        if len(tokens) > self.max_tokens:
            kept = tokens[len(tokens) - self.max_tokens // 2:]
            self.index = TokenIndex(kept)
        self.index.index_to(len(self.index.tokens))


def common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """Length of the longest common prefix of a and b, at most `limit` (slices of 256
    compared at C speed, then the last one token by token)."""
    n = min(len(a), len(b), limit)
    i = 0
    while i < n:
        j = min(i + 256, n)
        if a[i:j] != b[i:j]:
            while a[i] == b[i]:
                i += 1
            return i
        i = j
    return n
