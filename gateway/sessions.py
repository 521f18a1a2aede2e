"""Which agent session a request belongs to, read from what agent harnesses send.

One documented order; the first source present gives the session (and its parent):

    source (HTTP header; the same names as gRPC metadata)  session        parent
    1. X-Session-ID             Baton's own, OpenCode's    its value      X-Parent-Session-ID
    2. X-Dynamo-Session-ID      NVIDIA Dynamo's            its value      X-Dynamo-Parent-Session-ID
    3. X-Claude-Code-Session-Id Claude Code                S, or S:AGENT  S:PARENT_AGENT, else S
       (+ X-Claude-Code-Agent-Id, X-Claude-Code-Parent-Agent-Id: a subagent's own ids)
    4. Thread-Id / Session-Id   Codex (thread-id is one    its value      X-Codex-Parent-Thread-Id
       (legacy session_id)      conversation; subagents
                                share session-id)
    5. X-SMG-Routing-Key        SGLang Model Gateway's     its value      -
    6. X-Correlation-ID         a tracing id many          its value      -
                                harnesses send per task
    7. the body: prompt_cache_key (OpenAI's cache key: Codex sends its conversation id there),
       then `user` (Anthropic: metadata.user_id); gRPC: GatewayGenerateRequest.session_id
       comes before every header
A parent names the session that spawned this one (a subagent: its prompts begin with the
parent's context), so the router places its first request where the parent's KV is
(router.Router.route). X-Dynamo-Parent-Session-ID is also read beside any other source that
names no parent of its own (as before these families were told apart). A Claude Code
subagent (an agent id beside the session id) is its own session `S:AGENT`, spawned by its
parent agent's session (`S:PARENT_AGENT`) or, without one, by the main conversation `S`.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

CLAUDE_SESSION = "x-claude-code-session-id"
CLAUDE_AGENT = "x-claude-code-agent-id"
CLAUDE_PARENT_AGENT = "x-claude-code-parent-agent-id"
DYNAMO_PARENT = "x-dynamo-parent-session-id"
# (session header, its parent header or None), in order; Claude Code's family is handled apart.
_FAMILIES: tuple[tuple[str, str | None], ...] = (
    ("x-session-id", "x-parent-session-id"),
    ("x-dynamo-session-id", DYNAMO_PARENT),
    (CLAUDE_SESSION, None),
    ("thread-id", "x-codex-parent-thread-id"),
    ("session-id", "x-codex-parent-thread-id"),
    ("session_id", None),
    ("x-smg-routing-key", None),
    ("x-correlation-id", None),
)
SESSION_HEADERS = tuple(name for name, _ in _FAMILIES)


class SessionKeys(NamedTuple):
    """session_id: this request's session ("" = none). parent_session_id: the session that
    spawned it ("" = none)."""

    session_id: str
    parent_session_id: str


def session_keys(get: Callable[[str], str | None], fallback: str | None = None,
                 body: Sequence[str | None] = (), explicit: str = "") -> SessionKeys:
    """The session keys of one request (see the module docstring for the order).

    get(name): a lower-case header / metadata key's value, None when absent. explicit: a
    session named by the request itself ahead of every header (the gRPC field). body: the
    body's keys after the headers, in order (prompt_cache_key, user); `fallback` is one more,
    last (kept for callers with a single key)."""
    if explicit:
        return SessionKeys(explicit, get(DYNAMO_PARENT) or get("x-parent-session-id") or "")
    for header, parent_header in _FAMILIES:
        value = get(header)
        if not value:
            continue
        if header == CLAUDE_SESSION:
            return _claude_code(value, get)
        parent = get(parent_header) if parent_header else None
        return SessionKeys(value, parent or get(DYNAMO_PARENT) or "")
    session = next((v for v in (*body, fallback) if v), "")
    return SessionKeys(session, get(DYNAMO_PARENT) or "" if session else "")


def _claude_code(session: str, get: Callable[[str], str | None]) -> SessionKeys:
    """Claude Code: the main conversation is `session`; a subagent `session:agent`."""
    agent = get(CLAUDE_AGENT)
    if not agent:
        return SessionKeys(session, get(DYNAMO_PARENT) or "")
    parent_agent = get(CLAUDE_PARENT_AGENT)
    parent = f"{session}:{parent_agent}" if parent_agent else session
    return SessionKeys(f"{session}:{agent}", parent)


def affinity_key(get: Callable[[str], str | None]) -> str | None:
    """The session the headers name, for the preparation pool's child affinity (the body's
    keys are not read on the event loop); None without one."""
    return session_keys(get).session_id or None
