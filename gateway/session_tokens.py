"""Per-session incremental tokenization: turn k+1's ids = turn k's ids up to a safe boundary +
the ids of the new text after it.

An agent's turn k+1 renders to turn k's text plus a suffix (the reply, a tool result, the
next generation prompt). Hugging Face tokenizers split text at added tokens (<|im_start|>,
<|im_end|>, ...) before anything else and tokenize each stretch between them on its own
(gateway/piece_cache.py, whose start-up self-check proves it for the served tokenizer), so
ids never merge across an added token. For each session the last prompt's text, ids and the
(char position, id index) of each added token are kept; the next prompt then costs:

    1. n = the common prefix of the old and new text (`startswith`, else a binary search of
       slice compares: C memcmp, ~10 µs for 100 kB)
    2. the boundary: the last added token of the old text that starts at p with
       p + longest added token <= n (so the regex that finds added tokens decides the same
       up to p in both texts: no longer added token can start there and reach past n)
    3. re-check the boundary token: the new text has the same added token at p, and the old
       ids hold its id at the recorded index (else: a full encode)
    4. ids = old_ids[:index] + ids(new_text[p:]) (tokenized stretch by stretch, with the
       piece cache)

A rendered prefix that changed (an edited history, a different system prompt) leaves a short
common prefix, and the new text is tokenized from the boundary before it: with no boundary,
in full. Exactness against a full `encode` is tested on every turn of the shipped traces
(tests/gateway/test_session_tokens.py) and measured by benchmarks/session_tokenize.py.
Without the piece cache (a tokenizer whose self-check failed) every call is a plain encode.
"""
from __future__ import annotations

from bisect import bisect_right
from collections import OrderedDict
from dataclasses import dataclass

from gateway.piece_cache import PieceTokenizer


@dataclass
class _Entry:
    text: str
    ids: list[int]
    starts: list[int]   # char position of each added token, ascending
    indexes: list[int]  # its index in `ids`
    special: bool       # encoded with add_special_tokens


def common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix of two strings (slice compares, O(n log n) in C)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo]; a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if a[lo:mid] == b[lo:mid] else (lo, mid)
    return lo


class SessionTokens:
    """encode(session_id, text) == tokenizer.encode(text), reusing the session's last prompt
    (see the module docstring). max_tokens bounds the ids kept over all sessions (LRU)."""

    def __init__(self, encoder: PieceTokenizer, max_tokens: int = 1 << 20) -> None:
        self._encoder = encoder
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._tokens = 0
        self._max_tokens = max_tokens
        self._reach = max(encoder.longest_added, 1)
        self.reused = 0  # ids taken from a session's last prompt, in all (for tests)

    def encode(self, session_id: str, text: str, add_special_tokens: bool = False) -> list[int]:
        """The ids of `text` (as `tokenizer.encode`); remembered under `session_id` when it
        is not empty."""
        if not session_id or not self._encoder.enabled:
            return self._encoder.encode(text, add_special_tokens)
        entry = self._entries.pop(session_id, None)
        if entry is not None:
            self._tokens -= len(entry.ids)
        cut = self._boundary(entry, text, add_special_tokens) if entry is not None else None
        if cut is None:
            ids = self._encoder.encode("", add_special_tokens)  # BOS and the like, if any
            new = _Entry(text, ids, [], [], add_special_tokens)
            start = 0
        else:
            k, start, index = cut
            new = _Entry(text, entry.ids[:index], entry.starts[:k], entry.indexes[:k],
                         add_special_tokens)
            self.reused += index
        marks: list[tuple[int, int]] = []
        self._encoder.encode_into(text, start, new.ids, marks)
        new.starts += [p for p, _ in marks]
        new.indexes += [i for _, i in marks]
        self._store(session_id, new)
        return list(new.ids)

    def _boundary(self, entry: _Entry, text: str, special: bool) -> tuple[int, int, int] | None:
        """(marks kept, char position, id index) of the last safe boundary, re-checked; None
        when there is none (then the text is encoded in full)."""
        if entry.special != special:
            return None
        n = len(entry.text) if text.startswith(entry.text) else common_prefix(entry.text, text)
        k = bisect_right(entry.starts, n - self._reach) - 1
        if k < 0:
            return None
        start, index = entry.starts[k], entry.indexes[k]
        token = self._encoder.added_at(text, start)
        if token is None or index >= len(entry.ids) or entry.ids[index] != token:
            return None
        return k, start, index

    def _store(self, session_id: str, entry: _Entry) -> None:
        self._entries[session_id] = entry
        self._tokens += len(entry.ids)
        while self._tokens > self._max_tokens and len(self._entries) > 1:
            _, dropped = self._entries.popitem(last=False)
            self._tokens -= len(dropped.ids)
