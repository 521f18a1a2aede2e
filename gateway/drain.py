"""The gateway's shutdown state, shared by the HTTP layer and `Gateway.stop()`.

    accepting ──stop()──▶ draining ──shutdown_grace_s, or no request left──▶ closed
                           │  /health: 503 {"status": "draining"} (readiness fails)
                           │  new requests: 503 + Retry-After, code "shutting_down"
                           │  running requests go on (counted by `Guard`)
                           └─ at the deadline (`expire()`): a running stream ends with an SSE
                              error event and `data: [DONE]`; a request not yet answered
                              gets the same 503; their Generate calls are cancelled (abort)
"""
from __future__ import annotations

import asyncio

from gateway.errors import GatewayError

RETRY_AFTER_S = 1.0  # another replica (or this one, restarted) is the retry's target


def shutting_down() -> GatewayError:
    """The error for requests refused or cut because the gateway is stopping."""
    return GatewayError(503, "The server is shutting down; retry the request.",
                        code="shutting_down", retry_after=RETRY_AFTER_S)


class Drain:
    """Counts running requests; `begin()` refuses new ones, `expire()` ends running ones."""

    def __init__(self) -> None:
        self.draining = False
        self.expired = asyncio.Event()
        self.running = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        """A request starts (call `leave()` when its response is over)."""
        self.running += 1
        self._idle.clear()

    def leave(self) -> None:
        """A request's response is over."""
        self.running -= 1
        if self.running == 0:
            self._idle.set()

    def begin(self) -> None:
        """Stop accepting: new requests and /health get 503 from now on."""
        self.draining = True

    def expire(self) -> None:
        """The grace is over: running requests end now (see the module docstring)."""
        self.expired.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait up to timeout_s for no request to be running; True when none is."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True
