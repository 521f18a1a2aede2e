"""SLO-aware admission: reject a request whose TTFT SLO cannot be met, before any work.

This is Mooncake's early rejection (Qin et al., "Mooncake: Trading More Storage for Less
Computation", FAST'25, § "Overload-oriented scheduling"): under overload, a request that
would miss its SLO anyway is refused at arrival from a prediction of the queues it would
join, instead of being prefilled (using prefill and transfer capacity) and then missing.

    with --slo-ttft-ms, for each request, after routing and before Generate:
      uncached  = prompt tokens − blocks the chosen decode worker is thought to hold
      decode path  = (decode worker's num_waiting_tokens + uncached) × its s/token
      prefill path = (prefill worker's num_waiting_tokens + uncached) × its s/token
      TTFT ≈ the cheaper allowed path (the decode worker's P/D decider takes the cheaper one;
             --prefill-mode local / remote, or no prefill worker, allow one)
      TTFT > SLO, and the queue is the cause (the idle prediction fits)
           → 429 slo_unattainable, Retry-After = TTFT − SLO (the queue drains meanwhile)
    learning: when a request ends, s/token of the worker that prefilled it (Finished's
    timings.remote_prefill tells which) += EWMA(gateway TTFT / (that worker's queue at
    admission + the request's uncached tokens from its usage)), starting from a prior.

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
    """An admitted request's prediction, kept to learn from its TTFT."""

    decode: PathQueue
    prefill: PathQueue | None
    predicted_s: float
    ttft_s: float | None = None


@dataclass
class SLOAdmission:
    slo_ttft_s: float
    prior_s_per_token: float = PRIOR_SECONDS_PER_TOKEN
    _s_per_token: dict[str, float] = field(default_factory=dict)

    def seconds_per_token(self, address: str) -> float:
        return self._s_per_token.get(address, self.prior_s_per_token)

    def predict(self, uncached: int, paths: list[PathQueue]) -> tuple[float, float]:
        """(TTFT predicted now, TTFT on idle workers) over the allowed paths, in seconds."""
        now = min((p.waiting_tokens + uncached) * self.seconds_per_token(p.address)
                  for p in paths)
        idle = min(uncached * self.seconds_per_token(p.address) for p in paths)
        return now, idle

    def admit(self, uncached: int, decode: PathQueue, prefill: PathQueue | None,
              allowed: list[PathQueue]) -> Ticket:
        """A Ticket, or GatewayError 429 (slo_unattainable, Retry-After) when the queues
        make the SLO unattainable."""
        predicted, idle = self.predict(uncached, allowed)
        if predicted > self.slo_ttft_s and idle <= self.slo_ttft_s:
            raise GatewayError(
                429, f"predicted time to first token {predicted * 1e3:.0f} ms exceeds the "
                f"{self.slo_ttft_s * 1e3:.0f} ms SLO at the current load; retry later",
                code="slo_unattainable",
                retry_after=max(1, math.ceil(predicted - self.slo_ttft_s)))
        return Ticket(decode, prefill, predicted)

    def observe(self, ticket: Ticket, remote_prefill: bool, uncached: int) -> None:
        """A request ended: learn its prefilling worker's seconds per token."""
        path = ticket.prefill if remote_prefill and ticket.prefill else ticket.decode
        work = path.waiting_tokens + uncached
        if ticket.ttft_s is None or work < MIN_SAMPLE_TOKENS:
            return
        old = self.seconds_per_token(path.address)
        self._s_per_token[path.address] = old + EWMA_ALPHA * (ticket.ttft_s / work - old)
