"""Session hints: which agent session a request belongs to, how long its KV should stay
preferred in a worker's pool after the turn, and whether this is its last turn.

The gateway parses them (X-Session-TTL / `kv_retention`, X-Session-End; gateway/session_hints.py),
they travel on GenerateRequest / PrefillRequest, and the engine's block pool orders eviction
by them (baton/engine/free_lists.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

# Largest accepted retention, seconds: a pin is soft (evicted when nothing else is free), but a
# session that asks for a day would outrank every other session for that long.
MAX_SESSION_TTL_S = 3600.0


@dataclass(frozen=True)
class SessionHint:
    """session_id: non-empty. ttl_s: seconds its blocks stay soft-pinned after each use
    (0: no pin; still ranked after session-less blocks, by last use). end: the request is
    the session's last turn (its blocks become first to evict once it finishes)."""

    session_id: str
    ttl_s: float = 0.0
    end: bool = False


def check_ttl(ttl_s: float) -> float:
    """Return `ttl_s` as a float if it is a finite number in [0, MAX_SESSION_TTL_S].
    Raises ValueError otherwise (message names the accepted range)."""
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)):
        raise ValueError(f"session TTL must be a number of seconds, got {ttl_s!r}")
    ttl = float(ttl_s)
    if not math.isfinite(ttl) or ttl < 0 or ttl > MAX_SESSION_TTL_S:
        raise ValueError(f"session TTL must be between 0 and {MAX_SESSION_TTL_S:g} seconds, "
                         f"got {ttl_s!r}")
    return ttl


def hint_from_wire(session_id: str, ttl_s: float | None, end: bool) -> SessionHint | None:
    """The hint a worker got on the wire (None without a session id). Raises ValueError for
    a bad TTL (the worker answers INVALID_ARGUMENT)."""
    if not session_id:
        return None
    return SessionHint(session_id, check_ttl(ttl_s) if ttl_s is not None else 0.0, bool(end))


def hint_from_proto(req) -> SessionHint | None:
    """The hint of a GenerateRequest or PrefillRequest (session_id, session_ttl_seconds,
    session_end). Raises ValueError for a bad TTL, or hints without a session id."""
    has_ttl = req.HasField("session_ttl_seconds")
    if not req.session_id and (has_ttl or req.session_end):
        raise ValueError("session_ttl_seconds / session_end need a session_id")
    return hint_from_wire(req.session_id, req.session_ttl_seconds if has_ttl else None,
                          req.session_end)


def hint_fields(hint: SessionHint | None) -> dict:
    """Keyword fields of a GenerateRequest / PrefillRequest carrying `hint` ({} for None)."""
    if hint is None:
        return {}
    return {"session_id": hint.session_id, "session_ttl_seconds": hint.ttl_s,
            "session_end": hint.end}
