"""The P/D cost model's glue on the decode worker: its inputs, its metrics, its learning.

    DecodeSequence._add (event loop):
      pd = PDChooser.request(peer, min_remote_tokens)    data: the prefill queue estimate
                                                         now, the learned rates, the policy
      engine.call(rkv.add(..., pd=pd))
          engine thread: decode's own prefix hit (RemoteKV.add), running batch, local
          prefill queue and local prefill rate (EngineStats) → PDState →
          baton/pd_cost.decide() → local / remote;
          the decision comes back with the plan (data, no callback across threads)
      PDChooser.record(decision, planned)   baton_decode_pd_decisions_total{path, reason}
    first token of a local prefill → observe_local; a remote prefill's answer →
    observe_remote (compute_seconds) and observe_transfer (bytes / transfer + arrival time)
    a prefill peer seen with a new kv_epoch (PrefillPeers) → new_epoch: its rates restart
    from the priors

The prefill worker's queue is its last GetStats answer (PrefillPeers caches it: remote
prefills poll it for progress anyway), drained by the remote rate for its age; an answer
older than STATS_MAX_AGE_S asks for a fresh one in the background (no decision waits on a
call), and no answer yet reads as an empty queue (unknown is not saturated). It is never
taken below the uncached tokens this worker itself has sent that peer and not yet had
answered (`sent` / `done`): a burst of requests is decided within milliseconds, before any
answer can count the ones just sent, and each read the peer as idle (8 cold 242-token
prompts at once on the default cluster: all 8 went remote, "long_prompt", and were
prefilled one after the other while decode had nothing to do).

The prefill rates each path is priced with are the ones its engine measures per step
(baton/engine/prefill_rate.py: prompt tokens over step time, median of recent steps; the
prefill worker's comes in its GetStats, decode's own from its EngineStats on the engine
thread), as the gateway's SLO admission uses them; the rates learned here from whole
requests (pd_rates.py) stand in until a worker has measured one. Why: a whole request's
time holds its fixed costs (scheduling, the first decode step, the call), so short prompts
read as a slow rate; measured that way on the AgentX mooncake slice both paths read ~190
tokens/s, where the offline engine prefills ~530 on the same two cores
(benchmarks/thread_scaling.py), and the cost model chose wrongly between them.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING

from baton.engine.remote_kv import PDRequest
from baton.pd_cost import PDDecision, PDPolicy, PDRates
from baton.transfer import block_bytes
from decode_service.pd_rates import PDEstimator
from decode_service.peers import PrefillPeer, PrefillPeers

if TYPE_CHECKING:
    from baton.engine.request import Request
    from decode_service.metrics import DecodeMetrics

log = logging.getLogger(__name__)

STATS_MAX_AGE_S = 0.5
SENT_MAX_AGE_S = 300.0  # a sent prefill still unanswered after this no longer counts
REMOTE_RATE, TRANSFER_RATE = "remote_prefill_tokens_per_second", "transfer_bytes_per_second"


class PDChooser:
    """itl_budget_s: --local-prefill-itl-budget-ms; idle_budget_s:
    --local-prefill-idle-budget-ms; remote_stall_fraction: what a remote prefill takes of
    this worker's step rate (CpuShare.shared_fraction under `--pin share`, else 0). The
    rates are this worker's: its local prefill rate, and each prefill peer process's remote
    and transfer rates (pd_rates.py)."""

    def __init__(self, peers: PrefillPeers, metrics: DecodeMetrics, itl_budget_s: float,
                 stats_timeout_s: float, idle_budget_s: float = 0.25,
                 remote_stall_fraction: float = 0.0) -> None:
        self.peers, self.metrics, self.stats_timeout_s = peers, metrics, stats_timeout_s
        self.policy = PDPolicy(itl_budget_s=itl_budget_s, idle_budget_s=idle_budget_s,
                               remote_stall_fraction=remote_stall_fraction)
        self.block_bytes = block_bytes(peers.layout)
        self.estimator = PDEstimator()
        # peer address → {request id: (uncached tokens, monotonic time sent)}
        self._sent: dict[str, dict[str, tuple[int, float]]] = {}
        peers.watch_epochs(self.new_epoch)

    def request(self, peer: PrefillPeer, min_remote_tokens: int | None) -> PDRequest:
        """The event loop's half of a decision (RemoteKV.add makes it on the engine thread).
        min_remote_tokens: the fixed threshold that replaces the estimate (None: none)."""
        policy = self.policy if min_remote_tokens is None else \
            dataclasses.replace(self.policy, min_remote_tokens=min_remote_tokens)
        rates = self.rates(peer)
        return PDRequest(self.prefill_queue(peer, rates.remote_tokens_per_s), rates, policy,
                         self.block_bytes)

    def rates(self, peer: PrefillPeer) -> PDRates:
        """The learned rates, the remote prefill rate replaced by the one the peer measures
        per step (its last GetStats `prefill_tokens_per_s`) once it has one."""
        rates, load = self.estimator.rates(peer.address), self.peers.load(peer.address)
        if load is not None and load.prefill_tokens_per_s > 0:
            rates = dataclasses.replace(rates, remote_tokens_per_s=load.prefill_tokens_per_s)
        return rates

    def prefill_queue(self, peer: PrefillPeer, rate: float) -> int:
        """The peer's num_waiting_tokens now: its last answer, less what it computed since
        at `rate` tokens/s, and at least what this worker has sent it unanswered."""
        load, now = self.peers.load(peer.address), time.monotonic()
        if load is None or now - load.at > STATS_MAX_AGE_S:
            self.peers.refresh_load(peer, self.stats_timeout_s)
        sent = self._sent.get(peer.address, {})
        for rid in [r for r, (_, at) in sent.items() if now - at > SENT_MAX_AGE_S]:
            del sent[rid]  # a call that never reported its end (a task cancelled unstarted)
        mine = sum(tokens for tokens, _ in sent.values())
        if load is None:
            return mine
        return max(mine, int(load.num_waiting_tokens - (now - load.at) * rate))

    def sent(self, address: str, request_id: str, tokens: int) -> None:
        """A remote prefill of `tokens` uncached tokens went to the peer at `address`."""
        self._sent.setdefault(address, {})[request_id] = (max(0, tokens), time.monotonic())

    def done(self, address: str, request_id: str) -> None:
        """That remote prefill ended, whatever its outcome."""
        self._sent.get(address, {}).pop(request_id, None)

    def record(self, pd: PDRequest, d: PDDecision | None, planned: bool,
               request_id: str) -> None:
        """Count the decision (reason "no_room": remote chosen, the pool had no room now)."""
        if d is None:
            return
        reason = d.reason if planned == d.remote else "no_room"
        self.metrics.pd_decisions.labels("remote" if planned else "local", reason).inc()
        log.debug("P/D %s (%s): local %.4f s, remote %.4f s, stall %.4f s, prefill queue %d "
                  "tokens", d.path, reason, d.local_s, d.remote_s, d.stall_s,
                  pd.prefill_waiting_tokens, extra={"request_id": request_id})

    def observe_local(self, req: Request | None) -> None:
        """A local prefill gave its first token: uncached tokens / time since scheduled."""
        if req is not None and req.scheduled_time is not None:
            tokens = req.num_prompt_tokens - max(0, req.num_cached_tokens)
            taken = self.estimator.observe_local(tokens, time.monotonic() - req.scheduled_time)
            self._count(taken, "local_prefill_tokens_per_second")
            self.metrics.pd_rates.labels("local_prefill_tokens_per_second", "").set(
                self.estimator.local.value)

    def observe_remote(self, peer: PrefillPeer, resp, arrival_seconds: float) -> None:
        """A PrefillResponse (OK) of `peer`: its compute rate and the transfer's bandwidth."""
        est, address, epoch = self.estimator, peer.address, peer.kv_epoch
        self._count(est.observe_remote(address, epoch, resp.num_computed_tokens,
                                       resp.compute_seconds), REMOTE_RATE)
        self._count(est.observe_transfer(address, epoch, resp.transferred_bytes,
                                         resp.transfer_seconds + arrival_seconds),
                    TRANSFER_RATE)
        self._publish(address)

    def new_epoch(self, address: str, kv_epoch: int) -> None:
        """The prefill worker at `address` restarted as process `kv_epoch` (PrefillPeers
        calls this): counted, and its rates start again from the priors."""
        self.metrics.prefill_peer_restarts.inc()
        if self.estimator.new_epoch(address, kv_epoch):
            self._publish(address)

    def _count(self, taken: bool | None, kind: str) -> None:
        if taken is False:
            self.metrics.pd_rejected_samples.labels(kind).inc()

    def _publish(self, address: str) -> None:
        p = self.estimator.peer(address)
        gauge = self.metrics.pd_rates.labels
        gauge(REMOTE_RATE, address).set(p.remote.value)
        gauge(TRANSFER_RATE, address).set(p.transfer.value)
