"""The P/D cost model: local or remote prefill for one request, from what each path costs.
One model for the two places that need it: the decode worker's decider (which path a request
takes: decode_service/pd_choice.py, through `RemoteKV.add` on the engine thread) and the
gateway's SLO admission (which path it will take, to predict its TTFT: gateway/admission.py).
Data in, decision out: no I/O, no clock, nothing shared between threads.

    costs(PDState, PDRates, PDPolicy) -> PDCosts           the decode worker's estimate
    choose(PDCosts, decode_running, PDPolicy) -> (remote, reason)    the rules, both callers

    uncached = prompt tokens − decode's own prefix hit. The remote path computes exactly these
               too: what decode holds and the prefill worker lacks is read from decode's pool
               (PrefillRequest.src_block_ids, prefill_service/kv_pull.py), never recomputed
    stall    = uncached / local rate           every running sequence waits this long for its
                                               next token while a local prefill runs (chunking
                                               spreads the stall over steps, it adds up the same)
    local    = (decode's local prefill queue + uncached) / local rate
    remote   = (prefill worker's queue + uncached) / remote rate
               + (blocks written to decode + blocks decode holds, read by prefill at worst)
                 × bytes per block / transfer rate + a fixed call overhead
               remote rate: the prefill worker's, × (1 − remote_stall_fraction) while decode
               runs sequences (on shared cores a busy decode keeps its share of them);
               on shared cores the first term is at least decode's queued prefill work at
               decode's share, (decode's queue / local rate) / (1 − remote_stall_fraction):
               that work runs meanwhile on the same cores, and the first token comes from a
               decode step after it (`shared_remote_s`)
    remote stall = remote_stall_fraction × uncached / remote rate
               what the running sequences lose while the remote prefill computes beside
               them on cores they share (`baton up --pin share`: both busy, each worker
               steps with half the cores, cpu_share.py); 0 on the prefill worker's own cores
    on shared cores (remote_stall_fraction > 0) the local and remote prefill rates are one,
    the higher of the two measured (`path_rates`): the two paths run on the same cores

    rules, in order:
      min_remote_tokens given (--min-remote-tokens)
                                   → the old fixed threshold                   "threshold"
      nothing uncached             → local                                     "cached"
      stall ≤ ITL budget           → the faster of local / remote      "faster_local|remote"
      decode idle, stall ≤ idle budget (nothing runs here to stall; a sequence arriving
                                   meanwhile waits at most that long)
                                   → the faster of local / remote "idle_faster_local|remote"
      stall > budget, shared cores (remote_stall_fraction > 0), and decode busy with a
                                   remote stall past the ITL budget too (neither path keeps
                                   the budget, so the request does not pay for a protection
                                   the batch does not get) or decode idle (a sequence
                                   arriving during a local prefill waits one chunk step;
                                   during a remote one it runs at half the cores: remote
                                   protects it little and costs this request the call,
                                   measured +8 % on a cold 900-token prompt, BENCHMARKS.md
                                   stop 37)
                                   → the faster of local / remote
                                                         "shared_faster_local|remote"
      stall > budget, decode busy  → remote                                    "itl_budget"
      stall > budget, decode idle  → local when going remote costs this request more extra
                                     wait than the local prefill would block the engine
                                     (remote − local > stall: the prefill worker is
                                     saturated)                                "prefill_saturated"
                                     else remote                               "long_prompt"

How the first turn of a session and its continuations part ways: the gateway keeps a session
on one decode worker, whose prefix cache then holds the whole previous turn, so a
continuation's `uncached` is only the new suffix (a tool result, a user message): its stall
fits the ITL budget, or the idle budget while nothing decodes here, and it goes local — no
transfer, and no wait behind the prefill worker's queue of long prompts. A first turn (or a
session that moved) is cold: its stall exceeds both budgets and it goes remote when the
prefill worker has cores of its own; on cores it shares with decode (`baton up --pin share`,
the one-host default) it takes the faster path, idle or busy: the two paths compute on the
same cores, and a remote prefill adds the call and the transfer and is priced behind
decode's own queued prefill work (`shared_remote_s`), so the estimate never finds it
faster: on one host prompts are prefilled on the decode worker, and the prefill worker
idles (`--pin split` or another host gives it cores of its own, and work).
The decode worker publishes the policy it runs with in WorkerStats (`PDPolicy.from_stats`),
so the gateway predicts with the budgets decode really uses.

Why shared cores change the rule (a 2-vCPU AMD EPYC, fp32 SmolLM2-135M, the offline engine,
`python benchmarks/thread_scaling.py --rounds 3`, medians): two threads prefill 534 tokens/s
and one 303; a batch-4 decode step takes 50 ms on two threads and 79 ms on one. A remote
prefill beside a busy decode on the same two cores so takes 1.76x as long as a local one (the
request's TTFT) and still slows every running sequence by 0.36 of its compute time, against a
local prefill's whole compute time: it buys
the batch little and costs the request most. The AgentX harness (c=4, mooncake slice) showed
it: the default cluster, sending every such prompt remote ("itl_budget"), had TTFT p90
2,094 ms against colocated's 628 at the same ITL p90 (BENCHMARKS.md, issue 28).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

# Priors until the first measurements land: a few thousand prompt tokens/s per side (a 135M
# model on a GPU does more, on a CPU core less), 1 GB/s transfer.
PRIOR_PREFILL_TOKENS_PER_S = 2000.0
PRIOR_TRANSFER_BYTES_PER_S = 1e9


@dataclass(frozen=True)
class PDState:
    """What the decider knows of this request and of both workers' queues right now.

    num_cached_tokens: decode's own prefix hit (block aligned). decode_running: sequences in
    decode's running batch (a local prefill stalls each). decode_waiting_tokens: prompt
    tokens still to prefill here before this one. prefill_waiting_tokens: the prefill
    worker's num_waiting_tokens (GetStats), aged by its learned rate. block_size in tokens,
    block_bytes: one KV block's bytes."""

    num_prompt_tokens: int
    num_cached_tokens: int
    decode_running: int
    decode_waiting_tokens: int
    prefill_waiting_tokens: int
    block_size: int
    block_bytes: int


@dataclass(frozen=True)
class PDRates:
    """Prompt tokens/s of a local and a remote prefill, and transfer bytes/s."""

    local_tokens_per_s: float = PRIOR_PREFILL_TOKENS_PER_S
    remote_tokens_per_s: float = PRIOR_PREFILL_TOKENS_PER_S
    transfer_bytes_per_s: float = PRIOR_TRANSFER_BYTES_PER_S


@dataclass(frozen=True)
class PDPolicy:
    """itl_budget_s: the longest stall a local prefill may put on a busy running batch.
    idle_budget_s: while nothing runs on decode, a local prefill up to this long is chosen
    when it is the faster path (0: idle decode is treated like a stall past the ITL budget).
    remote_overhead_s: fixed cost of a remote prefill (Prefill call, receive, first token).
    min_remote_tokens: when set, the fixed threshold of old replaces the estimate.
    remote_stall_fraction: in [0, 1], the share of decode's step rate a remote prefill
    takes while it runs (cores shared with the prefill worker: CpuShare.shared_fraction;
    0: the prefill worker computes on cores of its own).
    Defaults: the decode worker's (baton/worker/role_configs.py DecodeConfig)."""

    itl_budget_s: float = 0.05
    idle_budget_s: float = 0.25
    remote_overhead_s: float = 0.005
    min_remote_tokens: int | None = None
    remote_stall_fraction: float = 0.0

    @classmethod
    def from_stats(cls, itl_budget_ms: float, idle_budget_ms: float,
                   min_remote_tokens: int, remote_stall_fraction: float = 0.0) -> PDPolicy:
        """The policy a decode worker published (WorkerStats.pd_policy; min 0 = none)."""
        return cls(itl_budget_s=itl_budget_ms / 1e3, idle_budget_s=idle_budget_ms / 1e3,
                   min_remote_tokens=min_remote_tokens or None,
                   remote_stall_fraction=remote_stall_fraction)


class PDCosts(NamedTuple):
    """One request's estimate, in tokens and seconds (module docstring)."""

    uncached: int
    stall_s: float
    local_s: float
    remote_s: float
    remote_stall_s: float = 0.0


@dataclass(frozen=True)
class PDDecision:
    remote: bool
    reason: str
    local_s: float
    remote_s: float
    stall_s: float

    @property
    def path(self) -> str:
        return "remote" if self.remote else "local"


def costs(s: PDState, r: PDRates, p: PDPolicy) -> PDCosts:
    """The estimate of the module docstring for one request."""
    uncached = max(0, s.num_prompt_tokens - s.num_cached_tokens)
    local_rate, rate = path_rates(r.local_tokens_per_s, r.remote_tokens_per_s,
                                  s.decode_running, p, s.decode_waiting_tokens)
    stall = uncached / local_rate
    local = (s.decode_waiting_tokens + uncached) / local_rate
    held = s.num_cached_tokens // s.block_size
    written = math.ceil(s.num_prompt_tokens / s.block_size) - held  # into decode's blocks
    read = held  # decode's hit, read by the prefill worker where it lacks it (at worst all)
    remote = shared_remote_s((s.prefill_waiting_tokens + uncached) / rate,
                             s.decode_waiting_tokens / local_rate, p) \
        + (written + read) * s.block_bytes / r.transfer_bytes_per_s + p.remote_overhead_s
    remote_stall = p.remote_stall_fraction * uncached / rate
    return PDCosts(uncached, stall, local, remote, remote_stall)


def path_rates(local: float, remote: float, decode_running: int,
               p: PDPolicy, decode_queue_tokens: int = 0) -> tuple[float, float]:
    """(local, remote) prefill tokens/s to price the two paths with now, from the measured
    ones. On cores the workers share (remote_stall_fraction > 0) both are the higher of the
    two: the paths run on the same cores, and each measured rate undercounts them (decode's
    steps carry its decode rows, a rate learned from whole requests their fixed costs), so a
    gap between them is measurement, not hardware. The remote one then loses the share of
    the cores a busy decode keeps (a remote prefill beside a busy decode on two shared cores
    runs on one); decode is busy when it runs sequences or has prompt tokens queued
    (`decode_queue_tokens`: its own prefill steps hold their share as well: an agent burst's
    turn sent remote beside them ran at half the cores, BENCHMARKS.md stop 36). With no share,
    the measured rates unchanged."""
    f = p.remote_stall_fraction
    if f <= 0:
        return local, remote
    best = max(local, remote)
    busy = decode_running > 0 or decode_queue_tokens > 0
    return best, best * max(1e-3, 1.0 - f) if busy else best


def shared_remote_s(remote_compute_s: float, decode_queue_s: float, p: PDPolicy) -> float:
    """When a remote prefill's first token can come, from its compute time: on cores the
    workers share (remote_stall_fraction f > 0) decode's queued prefill work (decode_queue_s
    at all the cores) runs meanwhile on the share decode keeps, 1 − f, and the remote
    request's first token comes from a decode step after it: not before
    decode_queue_s / (1 − f). On cores of its own the prefill worker computes beside decode:
    compute time unchanged.

    Measured (BENCHMARKS.md, stop 36): four continuation turns of an agent burst on the
    default cluster (2 shared vCPUs); the model without this term sent one of them remote as
    "faster" (remote 0.17 s against 0.23 local behind the other two), and the local two then
    ran beside it at half the cores: all three first tokens came together at 435-640 ms,
    against 272-446 with every prefill local."""
    f = p.remote_stall_fraction
    if f <= 0 or decode_queue_s <= 0:
        return remote_compute_s
    return max(remote_compute_s, decode_queue_s / max(1e-3, 1.0 - f))


def choose(c: PDCosts, decode_running: int, p: PDPolicy) -> tuple[bool, str]:
    """(go remote, reason) by the rules of the module docstring."""
    if p.min_remote_tokens is not None:
        return c.uncached >= max(1, p.min_remote_tokens), "threshold"
    if c.uncached == 0:
        return False, "cached"
    faster_remote = c.remote_s < c.local_s
    if c.stall_s <= p.itl_budget_s:
        return faster_remote, "faster_remote" if faster_remote else "faster_local"
    if decode_running == 0 and c.stall_s <= p.idle_budget_s:
        return faster_remote, "idle_faster_remote" if faster_remote else "idle_faster_local"
    # (a remote stall is 0 on the prefill worker's own cores: the rule is for shared ones)
    if p.remote_stall_fraction > 0 and (decode_running == 0 or c.remote_stall_s > p.itl_budget_s):
        return faster_remote, "shared_faster_remote" if faster_remote else "shared_faster_local"
    if decode_running > 0:
        return True, "itl_budget"
    if c.remote_s - c.local_s > c.stall_s:
        return False, "prefill_saturated"
    return True, "long_prompt"


def decide(s: PDState, r: PDRates, p: PDPolicy) -> PDDecision:
    """The path for one request on the decode worker."""
    c = costs(s, r, p)
    remote, reason = choose(c, s.decode_running, p)
    return PDDecision(remote, reason, c.local_s, c.remote_s, c.stall_s)
