"""Picks the decode worker (and prefill worker) for a request. Pure: no I/O, time passed in.

    request ──▶ session key? ──yes──▶ its worker healthy, not excluded, not overloaded? ──▶ stick
                     │ no / moved
                     ▼
              new session with a parent? ──yes──▶ the parent's worker usable? ──▶ "parent"
                     │ no                 (a subagent's prompt starts with its parent's
                     ▼                     context; then it sticks on its own session)
                score(w) = kv_weight * (matched(w) - shared) / (prompt_blocks - shared)
                           - load_weight * load(w)              best score wins (ties rotate)

- matched(w): leading block hashes of the prompt that w reported holding, or that
  the gateway itself sent to w (its "sent index": soft state that covers the gap between
  stats polls and workers that report no hashes). Hashes chain, so only a prefix can hit.
- shared: the fewest blocks any candidate matches (a common system prompt): every choice
  saves those, so only the rest tells the candidates apart. Dividing by the whole prompt
  instead let a 1,344-token system prompt shrink a session's own 150-token lead to 0.09,
  below any load difference, and the kv policy sent turns away from their cached context.
- load(w) = w's reported load (when its stats are fresh, else 0: unknown is not saturated)
  + requests the gateway started on w since those stats / capacity_hint (bursts between polls).
- A worker is overloaded only on fresh stats (load >= overload_load); stale or missing stats
  never count as overloaded, so routing recovers when a worker stops reporting.
- round-robin ignores sessions and KV (the benchmark's baseline); kv scores every request.
The same rules pick the prefill worker from the prefill views (no prefill worker → None: the
decode worker prefills locally).
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from gateway.config import RouterConfig, RoutingPolicy


@dataclass(frozen=True)
class WorkerView:
    """What the router knows of one worker right now (built by the worker pool).

    healthy: False when health checks or calls fail. load: reported load when the stats are
    fresh, None when stale or missing. pending: requests the gateway started on it since
    those stats (all in-flight ones when stale). cached: block hashes it reported holding.
    """

    address: str
    healthy: bool = True
    load: float | None = None
    pending: int = 0
    cached: Collection[int] = frozenset()


@dataclass(frozen=True)
class RouteDecision:
    """decode / prefill: chosen addresses (prefill None = local prefill). reason: "sticky",
    "moved" (its session left an unusable worker), "parent" (a new session placed with the
    session that spawned it), "kv", "load" or "round_robin".
    overlap_blocks: leading prompt blocks the chosen decode worker is thought to hold."""

    decode: str
    prefill: str | None
    reason: str
    overlap_blocks: int = 0


@dataclass
class _Session:
    decode: str
    prefill: str | None
    last_used: float


class Router:
    """Session table + gateway-side sent index + the scoring above."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self._sent: dict[str, OrderedDict[int, None]] = {}
        self._rotation = {"decode": itertools.count(), "prefill": itertools.count()}

    # ---- queries -------------------------------------------------------------------------
    def route(self, session_id: str, block_hashes: Sequence[int],
              decodes: Sequence[WorkerView], prefills: Sequence[WorkerView], now: float,
              exclude: Collection[str] = (), parent_session_id: str = ""
              ) -> RouteDecision | None:
        """The workers for one request, or None when no healthy decode worker is left.

        `exclude`: decode workers already tried for this request (retries).
        `parent_session_id`: the session that spawned this one; a session with no entry of
        its own yet starts on its parent's workers when they are usable."""
        candidates = [w for w in decodes if w.healthy and w.address not in exclude]
        if not candidates:
            return None
        prefill_pool = [w for w in prefills if w.healthy]
        if self.config.policy is RoutingPolicy.ROUND_ROBIN:
            decode = self._rotate("decode", candidates)
            prefill = self._rotate("prefill", prefill_pool) if prefill_pool else None
            return RouteDecision(decode.address, prefill and prefill.address, "round_robin",
                                 self.overlap(decode, block_hashes))
        session = self._live_session(session_id, now)
        parent = self._live_session(parent_session_id, now) if session is None else None
        for s, reason in ((session, "sticky"), (parent, "parent")):
            stuck = self._stick(s, reason, candidates, block_hashes, prefill_pool)
            if stuck is not None:
                return stuck
        decode, overlap = self._best("decode", candidates, block_hashes)
        reason = "moved" if session is not None else ("kv" if overlap else "load")
        prefill = self._pick_prefill(session.prefill if session else None, block_hashes,
                                     prefill_pool)
        return RouteDecision(decode.address, prefill, reason, overlap)

    def overlap(self, worker: WorkerView, block_hashes: Sequence[int]) -> int:
        """Leading prompt blocks that `worker` holds (reported) or was sent (sent index)."""
        sent = self._sent.get(worker.address, ())
        n = 0
        for h in block_hashes:
            if h not in worker.cached and h not in sent:
                break
            n += 1
        return n

    def load(self, worker: WorkerView) -> float:
        return (worker.load or 0.0) + worker.pending / self.config.capacity_hint

    def overloaded(self, worker: WorkerView) -> bool:
        return worker.load is not None and worker.load >= self.config.overload_load

    def session_of(self, session_id: str) -> tuple[str, str | None] | None:
        s = self._sessions.get(session_id)
        return None if s is None else (s.decode, s.prefill)

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    # ---- updates -------------------------------------------------------------------------
    def record(self, session_id: str, decision: RouteDecision, block_hashes: Sequence[int],
               now: float) -> None:
        """A request started streaming on `decision`: stick its session and index its blocks."""
        if session_id and self.config.policy is RoutingPolicy.SESSION:
            self._sessions[session_id] = _Session(decision.decode, decision.prefill, now)
            self._sessions.move_to_end(session_id)
            while len(self._sessions) > self.config.max_sessions:
                self._sessions.popitem(last=False)
        cap = self.config.sent_index_blocks
        if cap and self.config.policy is not RoutingPolicy.ROUND_ROBIN:
            for address in filter(None, (decision.decode, decision.prefill)):
                index = self._sent.setdefault(address, OrderedDict())
                for h in block_hashes:
                    index[h] = None
                    index.move_to_end(h)
                while len(index) > cap:
                    index.popitem(last=False)

    def end_session(self, session_id: str) -> tuple[str, str | None] | None:
        """Forget a session (DELETE /v1/sessions/{id}); returns its (decode, prefill)
        workers, None when it had no entry."""
        s = self._sessions.pop(session_id, None)
        return None if s is None else (s.decode, s.prefill)

    def forget_worker(self, address: str) -> None:
        """The worker left or restarted: what the gateway sent there is gone."""
        self._sent.pop(address, None)

    def expire_sessions(self, now: float) -> int:
        """Drop sessions idle for longer than session_ttl_s; returns how many."""
        dropped = 0
        while self._sessions:
            key, s = next(iter(self._sessions.items()))
            if now - s.last_used <= self.config.session_ttl_s:
                break
            del self._sessions[key]
            dropped += 1
        return dropped

    # ---- policy pieces -------------------------------------------------------------------
    def _live_session(self, session_id: str, now: float) -> _Session | None:
        s = self._sessions.get(session_id) if session_id else None
        if s is not None and now - s.last_used > self.config.session_ttl_s:
            del self._sessions[session_id]
            return None
        return s

    def _stick(self, s: _Session | None, reason: str, candidates: Sequence[WorkerView],
               block_hashes: Sequence[int], prefill_pool: Sequence[WorkerView]
               ) -> RouteDecision | None:
        """Route to session s's decode worker (and its prefill worker, if still usable), or
        None when there is no session or its worker is gone, excluded or overloaded."""
        decode = _find(candidates, s.decode) if s is not None else None
        if decode is None or self._should_leave(decode, candidates):
            return None
        prefill = self._pick_prefill(s.prefill, block_hashes, prefill_pool)
        return RouteDecision(decode.address, prefill, reason, self.overlap(decode, block_hashes))

    def _should_leave(self, current: WorkerView, candidates: Sequence[WorkerView]) -> bool:
        """Leave an overloaded worker only for one that is not overloaded."""
        return self.overloaded(current) and any(not self.overloaded(w) for w in candidates)

    def _pick_prefill(self, sticky: str | None, block_hashes: Sequence[int],
                      pool: Sequence[WorkerView]) -> str | None:
        if not pool:
            return None
        current = _find(pool, sticky) if sticky else None
        if current is not None and not self._should_leave(current, pool):
            return current.address
        return self._best("prefill", pool, block_hashes)[0].address

    def _best(self, role: str, pool: Sequence[WorkerView],
              block_hashes: Sequence[int]) -> tuple[WorkerView, int]:
        """Highest score; among equals the rotation decides (equal idle workers share load)."""
        start = next(self._rotation[role]) % len(pool)
        order = [pool[(start + i) % len(pool)] for i in range(len(pool))]
        overlaps = [self.overlap(w, block_hashes) for w in order]
        shared = min(overlaps)
        rest = max(1, len(block_hashes) - shared)
        best, best_key, best_overlap = pool[0], None, 0
        for w, overlap in zip(order, overlaps):
            score = self.config.kv_weight * (overlap - shared) / rest \
                - self.config.load_weight * self.load(w)
            key = (not self.overloaded(w), score)
            if best_key is None or key > best_key:
                best, best_key, best_overlap = w, key, overlap
        return best, best_overlap

    def _rotate(self, role: str, pool: Sequence[WorkerView]) -> WorkerView:
        return pool[next(self._rotation[role]) % len(pool)]


def _find(pool: Sequence[WorkerView], address: str | None) -> WorkerView | None:
    return next((w for w in pool if w.address == address), None)
