"""Model-free drafts for speculative decoding: what a request is likely to write next.

    method "suffix" (SuffixDecoding, Oliaro et al. 2024, arXiv 2411.04975; vLLM/ArcticInference
    `method: "suffix"`): three token indices (token_index.py) are searched with the request's
    own tokens as the query; the longest match wins (the first listed on ties):
        own      this request's prompt + outputs. A session's next turn continues the index
                 its last request left (its prompt repeats that context), so only the new
                 tokens are filed (sessions.py);
        session  the session's earlier tokens when this prompt does not continue them (a
                 retried turn, a sub-agent with another system prompt);
        recent   the outputs of recently finished requests, any session (bounded).
    method "ngram" (vLLM's prompt lookup, `method: "ngram"`): the request's own tokens only,
    a match of min_match_tokens..max_match_tokens, a fixed draft length.

Draft length, per request and step: 0 below min_match_tokens (a request with no repetition
drafts nothing and pays nothing); else min(k_cap, ⌊max_spec_factor · match length⌋,
num_speculative_tokens) (ArcticInference's max_spec_factor: a longer match earns a longer
draft). k_cap follows the request's recent acceptance: doubled after a draft accepted whole,
accepted + 1 after a miss (the next draft is one token past what the last one got right).
The engine caps the length further (max_tokens, the context limit, the grammar).

Memory: the own index lives as long as its request; per session one index (the last
request's tokens, no copy) in an LRU bounded by session_cache_tokens; the recent outputs by
recent_cache_tokens. Per step and request: one anchor lookup and at most 8 chain candidates.
"""
from __future__ import annotations

from dataclasses import dataclass

from baton.config import SpeculativeConfig
from baton.engine.request import Request
from baton.engine.spec.sessions import RecentOutputs, SessionIndices
from baton.engine.spec.token_index import TokenIndex


@dataclass
class _State:
    session_id: str | None
    session_end: bool  # the session's last turn: its index is dropped, not kept
    k_cap: int
    own: TokenIndex | None = None  # built at the request's first proposal
    side: TokenIndex | None = None  # the session's earlier index, when not continued


class Drafter:
    """Proposes drafts for decode rows (engine thread only). See the module docstring."""

    def __init__(self, config: SpeculativeConfig) -> None:
        assert config.method is not None, "a Drafter needs a speculative method"
        self.config = config
        self._suffix = config.method == "suffix"
        self._states: dict[str, _State] = {}
        self.sessions = SessionIndices(config.session_cache_tokens)
        self.recent = RecentOutputs(config.recent_cache_tokens)

    def add(self, request_id: str, session_id: str | None, session_end: bool = False) -> None:
        """Track a new request (its index is built at its first `propose`); `session_end`:
        its session ends with it."""
        self._states[request_id] = _State(session_id, session_end,
                                          self.config.num_speculative_tokens)

    def propose(self, req: Request, max_draft: int) -> list[int]:
        """Draft at most `max_draft` tokens to follow req.all_token_ids ([] when nothing
        matches or the request is unknown)."""
        st = self._states.get(req.request_id)
        k = min(max_draft, st.k_cap if st is not None else 0)
        if k <= 0:
            return []
        tokens = req.all_token_ids
        if st.own is None:
            st.own, st.side = self._start(st, tokens)
        st.own.index_to(len(tokens) - 1)  # the last token is the query's end, not a match
        c = self.config
        best_m, best_idx, best_p = 0, st.own, -1
        for idx in (st.own, st.side, self.recent.index) if self._suffix else (st.own,):
            if idx is not None:
                m, p = idx.longest_match(tokens, c.max_match_tokens)
                if m > best_m:
                    best_m, best_idx, best_p = m, idx, p
        if best_m < c.min_match_tokens:
            return self._filler(tokens, k) if c.synthetic_acceptance else []
        if self._suffix and not c.synthetic_acceptance:
            k = min(k, int(c.max_spec_factor * best_m))
        draft = best_idx.continuation(best_p, k)
        return draft + self._filler(tokens, k - len(draft)) if c.synthetic_acceptance else draft

    def _filler(self, tokens: list[int], k: int) -> list[int]:
        """Benchmark mode only (acceptance forced): drafts need not match anything."""
        return [tokens[-1]] * k

    def _start(self, st: _State, tokens: list[int]) -> tuple[TokenIndex, TokenIndex | None]:
        if not self._suffix or st.session_id is None:
            return TokenIndex(tokens), None
        return self.sessions.start(st.session_id, tokens)

    def observe(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        """The verify step's result for the request's last draft (adapts its k_cap)."""
        st = self._states.get(request_id)
        if st is None or not num_drafted or not self._suffix or self.config.synthetic_acceptance:
            return
        if num_accepted >= num_drafted:
            st.k_cap = min(self.config.num_speculative_tokens, 2 * st.k_cap)
        else:
            st.k_cap = max(1, num_accepted + 1)

    def finish(self, req: Request) -> None:
        """The request ended: its tokens become its session's index and its outputs join
        the recent ones (only if it was drafted for here: a prefill-only engine files
        nothing)."""
        st = self._states.pop(req.request_id, None)
        if st is None or st.own is None or not self._suffix:
            return
        self.recent.add(req.output_token_ids)
        if st.session_id is not None and st.session_end:
            self.sessions.drop(st.session_id)
        elif st.session_id is not None:
            st.own.index_to(len(req.all_token_ids))
            self.sessions.put(st.session_id, st.own)

    def end_session(self, session_id: str) -> None:
        """Forget a session's index (its last turn ended, or DELETE /v1/sessions/{id})."""
        self.sessions.drop(session_id)

    @property
    def num_tracked(self) -> int:
        return len(self._states)
