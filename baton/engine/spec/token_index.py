"""Longest-match search over a growing token list: the suffix structure of the drafter.

Every position p of the list is filed under its *anchor*, the two tokens ending at p, in hash
chains as in zlib's deflate (RFC 1951 §4; `longest_match` in zlib's deflate.c):

    tokens :  a  b  c  d  a  b  c  x  a  b
    pos    :  0  1  2  3  4  5  6  7  8  9
    head[(a,b)] = 9 ──▶ prev[9] = 5 ──▶ prev[5] = 1 ──▶ prev[1] = -1

To continue a query (a request's tokens, ending ...a b), the chain of its last anchor lists
where that pair occurred, latest first; each candidate p is extended backwards while the
tokens agree, up to `max_match`, and the longest match wins (the latest on ties). The tokens
after it are the draft (`continuation`). This is what a suffix tree of depth `max_match`
answers (SuffixDecoding, Oliaro et al. 2024, arXiv 2411.04975, keeps one per request and one
global), with O(1) work per appended token and one array slot per position instead of up to
`max_match` tree nodes per token; the chain walk is capped at `max_chain` candidates.

A whole prompt is filed at once in numpy (a stable sort groups equal anchors; each links to
the one before it): ~5 ms for 20k tokens here. Positions whose anchor holds a negative token
(a separator between unrelated sequences) are never filed.
"""
from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy as np

ANCHOR = 2  # tokens that must agree before a candidate is even looked at
_BULK = 64  # appending at least this many positions at once goes through numpy
_CHUNK = 8  # backward extension compares slices of this many tokens first


def _key(a: int, b: int) -> int:
    return (a << 32) | b  # exact for 0 <= token < 2**32: no collisions to check


class TokenIndex:
    """Hash chains over `tokens` (a list this index reads and never writes; it may grow at
    its end between calls). Positions [0, num_indexed) are filed; `index_to(end)` files
    more. Memory: 8 bytes a position plus one dict entry per distinct anchor."""

    def __init__(self, tokens: Sequence[int]) -> None:
        self.tokens = tokens
        self.head: dict[int, int] = {}
        self.prev = array("q")
        self.num_indexed = 0

    def copy_onto(self, tokens: Sequence[int], upto: int) -> TokenIndex:
        """A copy of this index reading `tokens`, which must agree with this index's tokens
        on [0, upto) (the caller checks), filed up to `upto`: a session's index continued by
        its next turn. Costs O(filed positions) for the copy plus O(positions cut)."""
        upto = min(upto, self.num_indexed)
        out = TokenIndex(tokens)
        out.head, out.prev, out.num_indexed = dict(self.head), self.prev[:upto], upto
        toks, head, prev = self.tokens, out.head, self.prev
        for pos in range(max(upto, 1), self.num_indexed):  # unfile the cut positions
            a, b = toks[pos - 1], toks[pos]
            if a < 0 or b < 0:
                continue
            k = _key(a, b)
            p = head.get(k, -1)
            while p >= upto:
                p = prev[p]
            if p < 0:
                head.pop(k, None)
            else:
                head[k] = p
        return out

    def index_to(self, end: int) -> None:
        """File positions [num_indexed, end) (end <= len(tokens))."""
        start = self.num_indexed
        if end <= start:
            return
        if end - start >= _BULK:
            self._index_bulk(start, end)
        else:
            toks, head, prev = self.tokens, self.head, self.prev
            for pos in range(start, end):
                a, b = (toks[pos - 1], toks[pos]) if pos else (-1, -1)
                if a < 0 or b < 0:
                    prev.append(-1)
                    continue
                k = _key(a, b)
                prev.append(head.get(k, -1))
                head[k] = pos
        self.num_indexed = end

    def _index_bulk(self, start: int, end: int) -> None:
        lo = max(start - 1, 0)
        t = np.asarray(self.tokens[lo:end], dtype=np.int64)
        pos = np.arange(lo + 1, end, dtype=np.int64)
        keys = (t[:-1] << 32) | t[1:]
        ok = (t[:-1] >= 0) & (t[1:] >= 0)
        if start == 0:
            ok = np.concatenate([[False], ok])  # position 0 has no anchor
            keys = np.concatenate([[0], keys])
            pos = np.concatenate([[0], pos])
        prev = np.full(end - start, -1, dtype=np.int64)
        keys, pos_ok = keys[ok], pos[ok]
        order = np.argsort(keys, kind="stable")
        k_sorted, p_sorted = keys[order], pos_ok[order]
        same = k_sorted[1:] == k_sorted[:-1]
        prev[p_sorted[1:][same] - start] = p_sorted[:-1][same]
        firsts = np.concatenate([[True], ~same]) if len(k_sorted) else np.zeros(0, bool)
        if self.head and firsts.any():  # a group's first position links to the older chain
            old = [self.head.get(k, -1) for k in k_sorted[firsts].tolist()]
            prev[p_sorted[firsts] - start] = old
        lasts = np.concatenate([~same, [True]]) if len(k_sorted) else np.zeros(0, bool)
        self.head.update(zip(k_sorted[lasts].tolist(), p_sorted[lasts].tolist()))
        self.prev.extend(prev.tolist())

    def longest_match(self, query: Sequence[int], max_match: int,
                      max_chain: int = 8) -> tuple[int, int]:
        """(m, p): the longest m <= max_match with tokens[p-m+1 : p+1] == query[-m:], over
        the `max_chain` latest filed positions p whose anchor is query's last two tokens,
        among those with at least one token after them; the latest p on equal m. (0, -1)
        when query's anchor was never filed."""
        q_end = len(query) - 1
        if q_end < 1 or query[q_end - 1] < 0 or query[q_end] < 0:
            return 0, -1
        p = self.head.get(_key(query[q_end - 1], query[q_end]), -1)
        toks, prev, n = self.tokens, self.prev, len(self.tokens)
        best_m, best_p, tried = 0, -1, 0
        while p >= 0 and tried < max_chain:
            tried += 1
            if p + 1 < n and not (toks is query and p >= q_end):
                m = _extend(toks, p, query, q_end, max_match)
                if m > best_m:
                    best_m, best_p = m, p
                    if m >= max_match:
                        break
            p = prev[p]
        return best_m, best_p

    def continuation(self, p: int, k: int) -> list[int]:
        """Up to k tokens after position p, stopping at a separator (< 0). Past the end of
        the list the copy continues from itself (LZ77's overlapping copy), so a match that
        ends just before the end of the list drafts its period over and over."""
        toks, n, out = self.tokens, len(self.tokens), []
        i = p + 1
        while len(out) < k:
            t = toks[i] if i < n else out[i - n]
            if t < 0:
                break
            out.append(t)
            i += 1
        return out


def _extend(toks: Sequence[int], p: int, query: Sequence[int], q_end: int,
            max_match: int) -> int:
    """Tokens that agree backwards from toks[p] and query[q_end] (the anchor's two do), up
    to max_match; slices of _CHUNK first, then one at a time."""
    m = ANCHOR
    while m < max_match:
        step = min(_CHUNK, max_match - m, p - m + 1, q_end - m + 1)
        if step <= 0:
            break
        if toks[p - m - step + 1:p - m + 1] == query[q_end - m - step + 1:q_end - m + 1]:
            m += step
            continue
        while m < max_match and toks[p - m] == query[q_end - m]:
            m += 1
        break
    return m
