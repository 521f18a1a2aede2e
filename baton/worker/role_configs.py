"""The prefill and decode workers' frozen configs, each flag declared on its field
(baton/flagspec.py). They live in baton/ (not in the services) so that `baton up` can offer
and check every worker flag without importing a service; prefill_service/config.py and
decode_service/config.py build their parsers from these.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from baton.config import none_or
from baton.flagspec import flag
from baton.request_limits import DEFAULT_MAX_N
from baton.worker.flags import RoleConfig, ServerConfig

PREFILL_PORT = 50052
DECODE_PORT = 50051


@dataclass(frozen=True)
class PrefillConfig(RoleConfig):
    """RoleConfig (engine, server, transport: how KV blocks leave this worker,
    max_prompt_tokens) plus: lease_seconds: how long blocks stay held after a reply, waiting
    for ReleaseBlocks (the request may shorten it). timeout_seconds: default budget of one
    Prefill call (queue, compute, transfer) when the request gives none. tombstone_seconds:
    how long an aborted request id is refused, so a Prefill that arrives after its Abort never
    writes into reused blocks. kv_send_per_chunk: send each prefill step's full blocks while
    the next chunk computes (kv_stream.py); a transport that cannot stream would send once at
    the end regardless.
    """

    server: ServerConfig = field(default_factory=lambda: ServerConfig(port=PREFILL_PORT))
    lease_seconds: float = flag(
        30.0, "how long sent blocks stay held waiting for the decode worker's ReleaseBlocks "
              "(then they go to the prefix cache)")
    timeout_seconds: float = flag(600.0, "cap of one Prefill call (queue, compute, transfer)")
    tombstone_seconds: float = 120.0
    kv_send_per_chunk: bool = flag(
        True, "send each prefill chunk's full KV blocks while the next chunk computes (NIXL "
              "and gRPC transports)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.lease_seconds <= 0 or self.timeout_seconds <= 0:
            raise ValueError("lease_seconds and timeout_seconds must be positive")


@dataclass(frozen=True)
class DecodeConfig(RoleConfig):
    """RoleConfig (engine, server, transport: how KV blocks arrive, max_prompt_tokens) plus:
    prefill_address: prefill worker used when a request names none (None = prefill locally).
    min_remote_tokens: None (default) = the cost-based decider (baton/pd_cost.py) chooses
    local or remote prefill per request from both sides' queues, what each side holds and
    learned rates; a number = the fixed threshold of old: an uncached prompt suffix shorter
    than this is prefilled here, a longer one on a prefill worker.
    local_prefill_itl_budget_ms: the decider's ITL budget: a local prefill runs inside this
    worker's decode steps and stalls every running sequence for its compute time; one that
    would stall a busy batch longer than this goes remote.
    local_prefill_idle_budget_ms: while this worker runs no sequence, a local prefill that
    would take up to this long is chosen when it is the faster path (0: off).
    Both budgets are published in WorkerStats, and the gateway's SLO admission predicts with
    them (one cost model, baton/pd_cost.py).
    on_prefill_failure: "recompute" (prefill locally from this worker's cached prefix) or
    "fail" (end the request with an error) when a remote prefill fails or times out.
    prefill_timeout_seconds: stall budget of one Prefill call: it is given up (Abort, then
    recompute or fail) once the prefill worker's engine has run no forward step for this
    long, measured by polling its GetStats `num_steps`. prefill_max_seconds: hard cap of one
    Prefill call, sent as its timeout_seconds (the prefill worker stops by then; a NIXL
    quarantine lasts until then at most: decode_service/quarantine.py).
    kv_wait_seconds: after Prefill answered OK, how long the receiver may take to report
    every block written. abort_timeout_seconds / handshake_timeout_seconds: those calls.
    quarantine_grace_seconds: blocks whose transfer the prefill worker never confirmed
    stopped are reused only this long after the prefill deadline.
    max_n: most completions per request (INVALID_ARGUMENT above it; the gateway's --max-n,
    the same flag in `baton up`, refuses them first).
    kv_pull: name this worker's blocks of a remote prefill's prefix hit (src_block_ids), so
    the prefill worker reads what it lacks instead of computing it (prefill_service/kv_pull.py).
    """

    server: ServerConfig = field(default_factory=lambda: ServerConfig(port=DECODE_PORT))
    prefill_address: str | None = flag(
        None, "default prefill worker host:port (none: prefill here)", cluster=False)
    min_remote_tokens: int | None = flag(
        None, "fixed P/D threshold: prefill an uncached suffix of at least this many tokens "
              "remotely, a shorter one here ('auto' or unset: the cost-based decider "
              "chooses per request)", parse=none_or(int))
    local_prefill_itl_budget_ms: float = flag(
        50.0, "cost-based P/D: the longest stall a local prefill may put on a busy decode "
              "batch before it goes to the prefill worker")
    local_prefill_idle_budget_ms: float = flag(
        250.0, "cost-based P/D: while no sequence runs here, the longest local prefill "
               "chosen when it is faster than the prefill worker (0: off)")
    on_prefill_failure: str = flag(
        "recompute", "when a remote prefill fails: prefill here instead, or fail the request",
        choices=("recompute", "fail"))
    prefill_timeout_seconds: float = flag(
        60.0, "give a remote prefill up after this long without prefill progress")
    prefill_max_seconds: float = flag(600.0, "hard cap of one remote prefill, queue included")
    kv_wait_seconds: float = flag(
        10.0, "after the prefill worker said OK: longest wait for every KV block")
    abort_timeout_seconds: float = flag(5.0, "timeout of one Abort call to a prefill worker")
    handshake_timeout_seconds: float = flag(
        5.0, "timeout of the KV-layout handshake with a prefill worker")
    quarantine_grace_seconds: float = flag(
        5.0, "blocks a transfer may still write are reused only this long after the prefill "
             "deadline (unless an Abort is answered first)")
    max_n: int = flag(DEFAULT_MAX_N, "most completions per request")
    kv_pull: bool = flag(
        True, "a remote prefill reads the blocks this worker holds of the prompt and the "
              "prefill worker lacks, instead of computing them (--no-kv-pull: it computes "
              "them, or loads them from the KV store)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.on_prefill_failure not in ("recompute", "fail"):
            raise ValueError("on_prefill_failure must be 'recompute' or 'fail'")
        if self.min_remote_tokens is not None and self.min_remote_tokens < 1:
            raise ValueError("min_remote_tokens must be ≥ 1")
        if self.local_prefill_itl_budget_ms < 0 or self.local_prefill_idle_budget_ms < 0:
            raise ValueError("local_prefill_itl_budget_ms and local_prefill_idle_budget_ms "
                             "must be ≥ 0")
        for name in ("prefill_timeout_seconds", "prefill_max_seconds", "kv_wait_seconds",
                     "abort_timeout_seconds", "handshake_timeout_seconds"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.quarantine_grace_seconds < 0:
            raise ValueError("quarantine_grace_seconds must be ≥ 0")
        if self.max_n < 1:
            raise ValueError("max_n must be ≥ 1")

    @property
    def recompute(self) -> bool:
        return self.on_prefill_failure == "recompute"
