"""Session hints at the gateway: how long a session's KV should stay in the workers' pools,
and when the session is over (README, "Session hints").

Per request (HTTP headers, or the same names as gRPC metadata; body field on chat/completions):
    X-Session-TTL: 30          seconds the session's KV stays soft-pinned after each turn,
                               a number in [0, 3600] (baton/session_hints.py MAX_SESSION_TTL_S)
    "kv_retention": 30         the same in the body: a number, or {"ttl_s": 30}; the header
                               wins when both are sent
    X-Session-End: true        this is the session's last turn ("true"/"false", "1"/"0")
Per session:
    DELETE /v1/sessions/{id}   end it now: the workers that hold it (the router's sticky
                               decode and prefill worker; every worker when the router has
                               no entry) move its cached blocks first in line for eviction

Hints need a session id (gateway/sessions.py); bad values are a 400 with an OpenAI-style
error, and nothing is sent to a worker.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, NamedTuple

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from baton.session_hints import check_ttl
from gateway.errors import GatewayError
from gateway.router import Router
from gateway.workers import DECODE, PREFILL, WorkerPool
from protos import common_pb2

log = logging.getLogger(__name__)

TTL_HEADER = "x-session-ttl"
END_HEADER = "x-session-end"
MAX_SESSION_ID_CHARS = 256
_BOOLS = {"true": True, "1": True, "false": False, "0": False}


class SessionHints(NamedTuple):
    """ttl_s: None when not given (the workers use 0). end: last turn of its session."""

    ttl_s: float | None = None
    end: bool = False


def _bad(message: str, param: str) -> GatewayError:
    return GatewayError(400, message, param=param, code="invalid_session_hint")


def parse_session_hints(get: Callable[[str], str | None], kv_retention: Any,
                        session_id: str) -> SessionHints:
    """The hints of one request: `get(name)` reads a lower-case header / metadata key,
    `kv_retention` is the body field (None when absent). Raises GatewayError 400 for a
    non-numeric, negative, non-finite or too large TTL, a bad end flag, or hints sent
    without a session id."""
    ttl, param = None, None
    header = get(TTL_HEADER)
    if header is not None:
        param = "X-Session-TTL"
        try:
            value = float(header.strip())
        except ValueError as e:
            raise _bad(f"X-Session-TTL must be a number of seconds, got {header!r}",
                       param) from e
        try:
            ttl = check_ttl(value)
        except ValueError as e:
            raise _bad(f"X-Session-TTL: {e}", param) from e
    elif kv_retention is not None:
        param = "kv_retention"
        value = kv_retention
        if isinstance(value, dict):
            if set(value) != {"ttl_s"}:
                raise _bad('kv_retention must be a number of seconds or {"ttl_s": seconds}',
                           param)
            value = value["ttl_s"]
        try:
            ttl = check_ttl(value)
        except ValueError as e:
            raise _bad(f"kv_retention: {e}", param) from e
    end_text = get(END_HEADER)
    end = False
    if end_text is not None:
        end = _BOOLS.get(end_text.strip().lower())
        if end is None:
            raise _bad(f"X-Session-End must be true or false, got {end_text!r}", "X-Session-End")
        param = param or "X-Session-End"
    if param is not None and not session_id:
        raise _bad("session hints need a session: send X-Session-ID (or the body's user)",
                   param)
    return SessionHints(ttl, end)


def request_fields(session_id: str, hints: SessionHints) -> dict:
    """GenerateRequest fields carrying the hints ({} without a session)."""
    if not session_id:
        return {}
    out: dict = {"session_end": hints.end}
    if hints.ttl_s is not None:
        out["session_ttl_seconds"] = hints.ttl_s
    return out


class SessionRoutes:
    """DELETE /v1/sessions/{session_id} (see the module docstring)."""

    def __init__(self, router: Router, pool: WorkerPool, rpc_timeout_s: float) -> None:
        self.router, self.pool, self.rpc_timeout_s = router, pool, rpc_timeout_s

    def add_to(self, app: FastAPI) -> None:
        app.add_api_route("/v1/sessions/{session_id}", self.delete, methods=["DELETE"])

    async def delete(self, session_id: str) -> JSONResponse:
        """End a session on the workers that hold it; 200 with how many blocks moved."""
        if not session_id.strip() or len(session_id) > MAX_SESSION_ID_CHARS:
            raise _bad(f"session id must be 1 to {MAX_SESSION_ID_CHARS} characters",
                       "session_id")
        known = self.router.end_session(session_id)
        if known is not None:
            targets = [w for w in (self.pool.get(DECODE, known[0]),
                                   known[1] and self.pool.get(PREFILL, known[1])) if w]
        else:
            targets = [w for role in (DECODE, PREFILL) for w in self.pool.workers[role].values()]
        req = common_pb2.EndSessionRequest(session_id=session_id)
        answers = await asyncio.gather(
            *(w.stub.EndSession(req, timeout=self.rpc_timeout_s) for w in targets),
            return_exceptions=True)
        blocks, failed = 0, 0
        for w, a in zip(targets, answers):
            if isinstance(a, BaseException):
                failed += 1
                log.warning("EndSession on %s failed: %r", w.address, a)
            else:
                blocks += a.num_blocks
        return JSONResponse({"id": session_id, "object": "session.deleted", "deleted": True,
                             "workers": len(targets) - failed, "failed_workers": failed,
                             "num_blocks": blocks})
