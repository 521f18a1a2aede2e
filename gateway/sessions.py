"""Which agent session a request belongs to, read from the headers agent harnesses send.

Session key, first one present wins (HTTP headers; the same names as gRPC metadata keys):
    X-Session-ID            Baton's own
    X-Dynamo-Session-ID     NVIDIA Dynamo's agent-aware router
    X-SMG-Routing-Key       SGLang Model Gateway's routing key
    X-Correlation-ID        a tracing id many harnesses send on every request of a task
    user                    the OpenAI body field (HTTP) / GatewayGenerateRequest.session_id
X-Dynamo-Parent-Session-ID names the session that spawned this one (a subagent: its prompts
begin with the parent's context), so the router can place its first request where the
parent's KV is (router.Router.route).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

SESSION_HEADERS = ("x-session-id", "x-dynamo-session-id", "x-smg-routing-key",
                   "x-correlation-id")
PARENT_SESSION_HEADER = "x-dynamo-parent-session-id"


class SessionKeys(NamedTuple):
    """session_id: this request's session ("" = none). parent_session_id: the session that
    spawned it ("" = none)."""

    session_id: str
    parent_session_id: str


def session_keys(get: Callable[[str], str | None], fallback: str | None = None) -> SessionKeys:
    """The session keys of one request; `get(name)` reads a lower-case header (None when
    absent); `fallback` (the body's `user`) is used when no session header is set."""
    session = next((v for v in map(get, SESSION_HEADERS) if v), None) or fallback or ""
    return SessionKeys(session, get(PARENT_SESSION_HEADER) or "")
