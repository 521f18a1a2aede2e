"""SLO-aware admission: reject a request whose TTFT SLO cannot be met, before any work.

This is Mooncake's early rejection (Qin et al., "Mooncake: Trading More Storage for Less
Computation", FAST'25, § "Overload-oriented scheduling"): under overload, a request that
would miss its SLO anyway is refused at arrival from a prediction of the queues it would
join, instead of being prefilled (using prefill and transfer capacity) and then missing.

    with --slo-ttft-ms, for each request, after routing and before Generate, per path it may
    prefill on (the decode worker; the prefill worker unless --prefill-mode local):
      u        = prompt tokens − blocks the chosen decode worker is thought to hold
      own      = uncached tokens of the requests this gateway admitted to that worker that
                 have no first token yet (one entry each)
      ahead    = Σ own entries ≤ u                 workers run prefill shortest first
                 + min(chunk, largest own entry > u)   a longer prompt's chunk may be in the
                                                       step in flight (chunk: the worker's
                                                       --prefill-target-tokens, WorkerStats)
                 + max(0, worker's num_waiting_tokens, aged − Σ own)   others' work
      rate     = the worker's prefill_tokens_per_s (WorkerStats: measured per step on the
                 worker, prefill_rate.py), PRIOR_TOKENS_PER_S until it has one
      TTFT(path) ≈ (ahead + u) / rate;  idle(path) = u / rate
      (rates as decode's cost model takes them: pd_cost.path_rates; on cores the two
      workers share, both the higher, the prefill worker's × (1 − remote_stall_fraction)
      while decode runs sequences)
    TTFT = the path the decode worker's P/D cost model (baton/pd_cost.py `choose`) takes,
      with the policy that worker publishes in WorkerStats (its ITL and idle budgets, or its
      fixed --min-remote-tokens): its rules on these predictions (stall = idle(decode),
      local = TTFT(decode), remote = TTFT(prefill)).
      TTFT ≤ SLO                                   → admit
      TTFT > SLO, idle ≤ SLO (the queue is why)    → 429 slo_unattainable,
                                                     Retry-After = TTFT − SLO
      TTFT > SLO even idle                         → admit when nothing is queued on any
                                                     allowed path (a retry would miss too),
                                                     else 429, Retry-After = the queues'
                                                     drain time
    An admitted request's u is counted on every allowed path until its first token
    (`release`).

Why these inputs. The gateway's own count: a worker's num_waiting_tokens is as old as its last
stats poll (and GetStats waits for the step in flight), so under a burst the stats alone saw
near-empty queues while TTFTs were ten times the SLO. The worker's measured rate: a rate
learned from gateway-side TTFTs also held every queue and the decode batch those requests
waited in (measured 10–100× off under the bursts workload). Shortest first: a short
continuation is not behind the long prompts queued before it (schedule_policy.py), so
counting those made the prediction refuse exactly the requests that would have met the SLO.
A prompt too long for the SLO even alone is let in only onto idle workers: refused always,
it would never be served; let in always, it takes the prefill capacity (and, past
--max-prefill-wait-s, a share of every step) from requests that would meet the SLO.
Stale or missing stats count as an empty queue (unknown is not saturated, as in routing).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from baton.pd_cost import PDCosts, PDPolicy, choose, path_rates, shared_remote_s
from gateway.errors import GatewayError

PRIOR_TOKENS_PER_S = 2000.0  # a few thousand prompt tokens/s until the worker measures
DEFAULT_CHUNK_TOKENS = 256   # a worker that reported no --prefill-target-tokens yet


@dataclass(frozen=True)
class PathQueue:
    """One worker a request may prefill on: its address, queued prompt tokens by its stats
    (aged; 0 when stale or missing), its measured prefill tokens/s (0 = not measured), its
    running sequences (0 when stale or missing), the prompt tokens one of its steps starts
    (its --prefill-target-tokens; 0 = a whole prompt) and, for a decode worker, the P/D
    policy it published (the decode worker's defaults until it has)."""

    address: str
    waiting_tokens: int
    tokens_per_s: float = 0.0
    num_running: int = 0
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    policy: PDPolicy = field(default_factory=PDPolicy)


@dataclass(frozen=True)
class Prediction:
    """One path's TTFT in seconds now and on an idle worker; `ahead`: tokens before the
    request (what `busy` means: > 0)."""

    address: str
    seconds: float
    idle_seconds: float
    ahead: int
    rate: float


@dataclass
class Ticket:
    """An admitted request: its predicted TTFT (chosen path) and the `paths` where its
    `uncached` tokens count as queued until `release`."""

    predicted_s: float
    paths: tuple[str, ...] = ()
    uncached: int = 0
    released: bool = True


def _at(pred: Prediction, rate: float, uncached: int) -> Prediction:
    """`pred` with its seconds at `rate` tokens/s instead."""
    return replace(pred, seconds=(pred.ahead + uncached) / rate,
                   idle_seconds=uncached / rate, rate=rate)


@dataclass
class SLOAdmission:
    slo_ttft_s: float
    prior_tokens_per_s: float = PRIOR_TOKENS_PER_S
    _pending: dict[str, list[int]] = field(default_factory=dict)  # address → own entries

    def pending_tokens(self, address: str) -> int:
        """Uncached tokens of requests admitted to `address` still without a first token."""
        return sum(self._pending.get(address, ()))

    def predict(self, uncached: int, path: PathQueue) -> Prediction:
        """This request's TTFT on `path` (the module docstring's formula)."""
        own = self._pending.get(path.address, [])
        shorter = sum(n for n in own if n <= uncached)
        longer = max((n for n in own if n > uncached), default=0)
        chunk = path.chunk_tokens or longer
        ahead = shorter + min(chunk, longer) + max(0, path.waiting_tokens - sum(own))
        rate = path.tokens_per_s if path.tokens_per_s > 0 else self.prior_tokens_per_s
        return Prediction(path.address, (ahead + uncached) / rate, uncached / rate, ahead,
                          rate)

    def choose(self, preds: list[Prediction], decode: PathQueue, uncached: int) -> Prediction:
        """The path decode's cost model takes (module docstring); preds[0] is decode's own,
        preds[1] (when allowed) the prefill worker's."""
        if len(preds) < 2:
            return preds[0]
        local, remote, p = preds[0], preds[1], decode.policy
        local_rate, remote_rate = path_rates(local.rate, remote.rate, decode.num_running, p,
                                             local.ahead)
        local, remote = _at(local, local_rate, uncached), _at(remote, remote_rate, uncached)
        remote_s = shared_remote_s(remote.seconds, local.ahead / local.rate, p)  # decode's queue
        go_remote, _ = choose(PDCosts(uncached, local.idle_seconds, local.seconds, remote_s,
                                      p.remote_stall_fraction * remote.idle_seconds),
                              decode.num_running, p)
        return remote if go_remote else local

    def admit(self, uncached: int, allowed: list[PathQueue]) -> Ticket:
        """A Ticket (its tokens now pending on every allowed path until `release`), or
        GatewayError 429 (slo_unattainable, Retry-After) when the queues make the SLO
        unattainable. `allowed`: the decode worker's path first (when allowed), then the
        prefill worker's; at least one."""
        preds = [self.predict(uncached, p) for p in allowed]
        chosen = self.choose(preds, allowed[0], uncached)
        if chosen.seconds > self.slo_ttft_s:
            too_long = min(p.idle_seconds for p in preds) > self.slo_ttft_s
            busy = [p for p in preds if p.ahead > 0]
            if not too_long or busy:
                wait = chosen.seconds - self.slo_ttft_s if not too_long else \
                    max(p.ahead / p.rate for p in busy)
                raise GatewayError(
                    429, f"predicted time to first token {chosen.seconds * 1e3:.0f} ms "
                    f"exceeds the {self.slo_ttft_s * 1e3:.0f} ms SLO at the current load "
                    f"({chosen.ahead} prompt tokens ahead of this one's {uncached} on "
                    f"{chosen.address}, {chosen.rate:.0f} tokens/s); retry later",
                    code="slo_unattainable", retry_after=max(1, math.ceil(wait)))
        for p in allowed:
            self._pending.setdefault(p.address, []).append(uncached)
        return Ticket(chosen.seconds, tuple(p.address for p in allowed), uncached,
                      released=False)

    def release(self, ticket: Ticket) -> None:
        """The request got its first token, or ended without one: its tokens no longer
        queue. Idempotent."""
        if ticket.released:
            return
        ticket.released = True
        for address in ticket.paths:
            own = self._pending.get(address, [])
            if ticket.uncached in own:
                own.remove(ticket.uncached)
            if not own:
                self._pending.pop(address, None)
