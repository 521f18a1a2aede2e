"""In-flight prefix deferral: requests of one agent's fan-out arrive together with one
uncached prefix; the first computes it, the others wait one step and take it as a cache hit
instead of computing the same blocks again (scheduler.py, at admission).

    step 1:  a [p0 p1 p2 a3]  computes p0..p2 ─┐  b, c: their next uncached block (p0) is
             b, c wait                          │  among the hashes a's row completes
    step 2:  b [hit hit hit b3], c [hit hit hit c3]
"""
from __future__ import annotations

from collections.abc import Sequence

from baton.engine.kv_cache import KVCacheManager
from baton.engine.request import Request
from baton.engine.sched_output import ScheduledRequest


class InflightPrefixes:
    """Hashes of the full blocks one step's prefill rows complete (not yet cached), derived
    from the step's rows on first use, then kept current as rows are added."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self._rows: Sequence[ScheduledRequest] = ()
        self._pending: set[int] | None = None

    def reset(self, rows: Sequence[ScheduledRequest]) -> None:
        """A new step whose planned rows are (and will be appended to) `rows`."""
        self._rows, self._pending = rows, None

    def defers(self, req: Request, num_computed: int) -> bool:
        """True when the block right after req's cache hit (`num_computed` tokens) is being
        computed this step by another request."""
        if not self.kv.enable_prefix_caching:
            return False
        hashes = self.kv.block_hashes(req.request_id, req.all_token_ids)
        nxt = num_computed // self.kv.block_size
        return nxt < len(hashes) and hashes[nxt] in self._hashes()

    def add(self, req: Request, start: int, n: int) -> None:
        """A row computing req's tokens [start, start + n) was planned after the last reset
        (its blocks are allocated)."""
        if self.kv.enable_prefix_caching:
            self._hashes().update(self._completed(req, start, n))

    def _hashes(self) -> set[int]:
        if self._pending is None:
            self._pending = set()
            for s in self._rows:  # prefill rows only: a decode row's drafts are guesses
                if s.num_new_tokens > 1 and not s.spec_token_ids:
                    self._pending.update(self._completed(
                        s.request, s.request.num_computed_tokens, s.num_new_tokens))
        return self._pending

    def _completed(self, req: Request, start: int, n: int) -> list[int]:
        """Hashes of req's full blocks that computing tokens [start, start + n) completes."""
        bs = self.kv.block_size
        hashes = self.kv.block_hashes(req.request_id, req.all_token_ids)
        return hashes[start // bs:(start + n) // bs]
