"""Local or remote prefill for one request, from an estimate of what each path costs now.

    decide(PDState, PDRates, PDPolicy) -> PDDecision          pure: no I/O, no clock

    uncached = prompt tokens − decode's own prefix hit (the prefill worker's hit is unknown
               here: it is taken as no better than decode's, so both paths compute `uncached`;
               with a KV store, --kv-store-url, that is what happens: what decode holds of a
               finished turn is in the store, and the prefill worker's prefix walk loads it)
    stall    = uncached / local rate           every running sequence waits this long for its
                                               next token while a local prefill runs (chunking
                                               spreads the stall over steps, it adds up the same)
    local    = (decode's local prefill queue + uncached) / local rate
    remote   = (prefill worker's queue + uncached) / remote rate
               + blocks to send × bytes per block / transfer rate + a fixed call overhead

    rules, in order:
      min_remote_tokens given (--min-remote-tokens, or PREFILL_MODE_REMOTE = 1)
                                   → the old fixed threshold                   "threshold"
      nothing uncached             → local                                     "cached"
      stall ≤ ITL budget           → the faster of local / remote      "faster_local|remote"
      decode idle, stall ≤ idle budget (--local-prefill-idle-budget-ms: nothing runs here
                                   to stall; a sequence arriving meanwhile waits at most
                                   that long)
                                   → the faster of local / remote "idle_faster_local|remote"
      stall > budget, decode busy  → remote                                    "itl_budget"
      stall > budget, decode idle  → local when going remote costs this request more extra
                                     wait than the local prefill would block the engine
                                     (remote − local > stall: the prefill worker is
                                     saturated)                                "prefill_saturated"
                                     else remote                               "long_prompt"

How the first turn of a session and its continuations part ways: the gateway keeps a session
on one decode worker, whose prefix cache then holds the whole previous turn, so a
continuation's `uncached` is only the new suffix (a tool result, a user message): its stall
fits the ITL budget, or the idle budget while nothing decodes here (the agent's own session
was waiting on a tool), and it goes local — no transfer, and no wait behind the prefill
worker's queue of long prompts. A first turn (or a session that moved) is cold: its stall
exceeds both budgets and it goes remote, which also leaves the prompt in the prefill worker's
prefix cache for the session's next long turn. Idle decode + idle prefill still sends a long cold prompt
remote: the decode worker stays free for the sequences that arrive meanwhile.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

# Priors until the first measurements land (EWMA then takes over): a few thousand prompt
# tokens/s per side (a 135M model on a GPU does more, on a CPU core less), 1 GB/s transfer.
PRIOR_PREFILL_TOKENS_PER_S = 2000.0
PRIOR_TRANSFER_BYTES_PER_S = 1e9
EWMA_ALPHA = 0.2
MIN_SAMPLE_TOKENS = 16  # shorter prefills measure the step's fixed cost, not the rate


@dataclass(frozen=True)
class PDState:
    """What the decider knows of this request and of both workers' queues right now.

    num_cached_tokens: decode's own prefix hit (block aligned). decode_running: sequences in
    decode's running batch (a local prefill stalls each). decode_waiting_tokens: prompt
    tokens still to prefill here before this one. prefill_waiting_tokens: the prefill
    worker's num_waiting_tokens (GetStats), aged by its learned rate (PDChooser)."""

    num_prompt_tokens: int
    num_cached_tokens: int
    decode_running: int
    decode_waiting_tokens: int
    prefill_waiting_tokens: int
    block_size: int
    block_bytes: int


@dataclass(frozen=True)
class PDRates:
    local_tokens_per_s: float = PRIOR_PREFILL_TOKENS_PER_S
    remote_tokens_per_s: float = PRIOR_PREFILL_TOKENS_PER_S
    transfer_bytes_per_s: float = PRIOR_TRANSFER_BYTES_PER_S


@dataclass(frozen=True)
class PDPolicy:
    """itl_budget_s: the longest stall a local prefill may put on a busy running batch.
    idle_budget_s: while nothing runs here, a local prefill up to this long is chosen when it
    is the faster path (0: idle decode is treated like a stall past the ITL budget).
    remote_overhead_s: fixed cost of a remote prefill (Prefill call, receive, first token).
    min_remote_tokens: when set, the fixed threshold of old replaces the estimate."""

    itl_budget_s: float = 0.05
    idle_budget_s: float = 0.25
    remote_overhead_s: float = 0.005
    min_remote_tokens: int | None = None


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


def decide(s: PDState, r: PDRates, p: PDPolicy) -> PDDecision:
    """The path for one request (rules in the module docstring)."""
    uncached = max(0, s.num_prompt_tokens - s.num_cached_tokens)
    stall = uncached / r.local_tokens_per_s
    local = (s.decode_waiting_tokens + uncached) / r.local_tokens_per_s
    blocks = math.ceil(s.num_prompt_tokens / s.block_size) - s.num_cached_tokens // s.block_size
    remote = (s.prefill_waiting_tokens + uncached) / r.remote_tokens_per_s \
        + blocks * s.block_bytes / r.transfer_bytes_per_s + p.remote_overhead_s

    def out(go_remote: bool, reason: str) -> PDDecision:
        return PDDecision(go_remote, reason, local, remote, stall)

    if p.min_remote_tokens is not None:
        return out(uncached >= max(1, p.min_remote_tokens), "threshold")
    if uncached == 0:
        return out(False, "cached")
    if stall <= p.itl_budget_s:
        return out(remote < local, "faster_remote" if remote < local else "faster_local")
    if s.decode_running == 0 and stall <= p.idle_budget_s:
        faster_remote = remote < local
        return out(faster_remote, "idle_faster_remote" if faster_remote else "idle_faster_local")
    if s.decode_running > 0:
        return out(True, "itl_budget")
    if remote - local > stall:
        return out(False, "prefill_saturated")
    return out(True, "long_prompt")


@dataclass
class Ewma:
    """Exponentially weighted moving average, starting from a prior."""

    value: float
    alpha: float = EWMA_ALPHA
    samples: int = 0

    def add(self, x: float) -> None:
        self.value += self.alpha * (x - self.value)
        self.samples += 1


@dataclass
class PDEstimator:
    """Rates learned online from measured prefills and transfers (event loop only)."""

    local: Ewma = field(default_factory=lambda: Ewma(PRIOR_PREFILL_TOKENS_PER_S))
    remote: Ewma = field(default_factory=lambda: Ewma(PRIOR_PREFILL_TOKENS_PER_S))
    transfer: Ewma = field(default_factory=lambda: Ewma(PRIOR_TRANSFER_BYTES_PER_S))

    def observe_local(self, tokens: int, seconds: float) -> None:
        """A local prefill of `tokens` took `seconds` (joined the batch → first token)."""
        if tokens >= MIN_SAMPLE_TOKENS and seconds > 0:
            self.local.add(tokens / seconds)

    def observe_remote(self, tokens: int, seconds: float) -> None:
        """The prefill worker computed `tokens` in `seconds` (its compute_seconds)."""
        if tokens >= MIN_SAMPLE_TOKENS and seconds > 0:
            self.remote.add(tokens / seconds)

    def observe_transfer(self, num_bytes: int, seconds: float) -> None:
        if num_bytes > 0 and seconds > 0:
            self.transfer.add(num_bytes / seconds)

    def rates(self) -> PDRates:
        return PDRates(self.local.value, self.remote.value, self.transfer.value)
