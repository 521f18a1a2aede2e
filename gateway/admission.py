"""SLO-aware admission: reject a request whose TTFT SLO cannot be met, before any work.

This is Mooncake's early rejection (Qin et al., "Mooncake: Trading More Storage for Less
Computation", FAST'25, § "Overload-oriented scheduling"): under overload, a request that
would miss its SLO anyway is refused at arrival from a prediction of the queues it would
join, instead of being prefilled (using prefill and transfer capacity) and then missing.

    with --slo-ttft-ms, for each request, after routing and before Generate:
      uncached  = prompt tokens − blocks the chosen decode worker is thought to hold
      queue(w)  = max(w's num_waiting_tokens from its stats,
                      uncached tokens of requests this gateway admitted to w that have no
                      first token yet)
      decode path  = (queue(decode worker) + uncached) × its s/token
      prefill path = (queue(prefill worker) + uncached) × its s/token
      TTFT ≈ the cheaper allowed path (the decode worker's P/D decider takes the cheaper one;
             --prefill-mode local / remote, or no prefill worker, allow one)
      TTFT > SLO, and the queue is the cause (the idle prediction fits)
           → 429 slo_unattainable, Retry-After = TTFT − SLO (the queue drains meanwhile)
    learning: when a request ends, s/token of the worker that prefilled it (Finished's
    timings.remote_prefill tells which) += EWMA(gateway TTFT / (that worker's queue at
    admission + the request's uncached tokens from its usage)), starting from a prior.

The gateway's own count matters: a worker's num_waiting_tokens leaves out the request it is
prefilling now (and every one admitted since its last stats poll), so under a burst the
stats alone saw an almost empty queue while TTFTs were ten times the SLO, and the learned
s/token absorbed that queueing (measured: a bursts run at c = 8, 3 s SLO, admitted all).
Stale or missing stats count as an empty queue (unknown is not saturated, as in routing).
A prompt that misses the SLO on an idle cluster is admitted: refusing it would not help, a
retry would miss too.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from gateway.errors import GatewayError

PRIOR_SECONDS_PER_TOKEN = 1 / 2000  # a few thousand prompt tokens/s until measured
EWMA_ALPHA = 0.2
MIN_SAMPLE_TOKENS = 32  # below this a TTFT measures fixed costs (tokenizing, RPCs), not rate


@dataclass(frozen=True)
class PathQueue:
    """One worker a request may prefill on: its address and queued prompt tokens (0 when its
    stats are stale or missing)."""

    address: str
    waiting_tokens: int


@dataclass
class Ticket:
    """An admitted request's prediction, kept to learn from its TTFT. `decode` / `prefill`
    carry the queues counted at admission; `path` is the worker it was predicted to prefill
    on, where its `uncached` tokens count as queued until `release`."""

    decode: PathQueue
    prefill: PathQueue | None
    predicted_s: float
    ttft_s: float | None = None
    path: str = ""
    uncached: int = 0
    released: bool = True


@dataclass
class SLOAdmission:
    slo_ttft_s: float
    prior_s_per_token: float = PRIOR_SECONDS_PER_TOKEN
    _s_per_token: dict[str, float] = field(default_factory=dict)
    _pending: dict[str, int] = field(default_factory=dict)  # address → admitted, no token yet

    def seconds_per_token(self, address: str) -> float:
        return self._s_per_token.get(address, self.prior_s_per_token)

    def pending_tokens(self, address: str) -> int:
        """Uncached tokens of requests admitted to `address` still without a first token."""
        return self._pending.get(address, 0)

    def _queued(self, p: PathQueue) -> PathQueue:
        return PathQueue(p.address, max(p.waiting_tokens, self.pending_tokens(p.address)))

    def predict(self, uncached: int, paths: list[PathQueue]) -> tuple[float, float, str]:
        """(TTFT predicted now, TTFT on idle workers, in seconds, and the address of the
        path predicted fastest) over the allowed paths; `paths`' queues as given (admit
        adds this gateway's pending tokens first)."""
        now, path = min(((p.waiting_tokens + uncached) * self.seconds_per_token(p.address),
                         p.address) for p in paths)
        idle = min(uncached * self.seconds_per_token(p.address) for p in paths)
        return now, idle, path

    def admit(self, uncached: int, decode: PathQueue, prefill: PathQueue | None,
              allowed: list[PathQueue]) -> Ticket:
        """A Ticket (its tokens now pending on the predicted path until `release`), or
        GatewayError 429 (slo_unattainable, Retry-After) when the queues make the SLO
        unattainable."""
        decode = self._queued(decode)
        prefill = self._queued(prefill) if prefill is not None else None
        allowed = [self._queued(p) for p in allowed]
        predicted, idle, path = self.predict(uncached, allowed)
        if predicted > self.slo_ttft_s and idle <= self.slo_ttft_s:
            raise GatewayError(
                429, f"predicted time to first token {predicted * 1e3:.0f} ms exceeds the "
                f"{self.slo_ttft_s * 1e3:.0f} ms SLO at the current load; retry later",
                code="slo_unattainable",
                retry_after=max(1, math.ceil(predicted - self.slo_ttft_s)))
        self._pending[path] = self.pending_tokens(path) + uncached
        return Ticket(decode, prefill, predicted, path=path, uncached=uncached,
                      released=False)

    def release(self, ticket: Ticket) -> None:
        """The request got its first token, or ended without one: its tokens no longer
        queue. Idempotent."""
        if ticket.released:
            return
        ticket.released = True
        left = self.pending_tokens(ticket.path) - ticket.uncached
        if left > 0:
            self._pending[ticket.path] = left
        else:
            self._pending.pop(ticket.path, None)

    def observe(self, ticket: Ticket, remote_prefill: bool, uncached: int) -> None:
        """A request ended: learn its prefilling worker's seconds per token."""
        path = ticket.prefill if remote_prefill and ticket.prefill else ticket.decode
        work = path.waiting_tokens + uncached
        if ticket.ttft_s is None or work < MIN_SAMPLE_TOKENS:
            return
        old = self.seconds_per_token(path.address)
        self._s_per_token[path.address] = old + EWMA_ALPHA * (ticket.ttft_s / work - old)
