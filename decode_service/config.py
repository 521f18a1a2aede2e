"""The decode worker's one frozen config, built from the command line in `main`."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from baton.worker.flags import RoleConfig, add_role_args, role_config_kwargs

DEFAULT_PORT = 50051


@dataclass(frozen=True)
class DecodeConfig(RoleConfig):
    """RoleConfig (engine, server, transport: how KV blocks arrive, max_prompt_tokens) plus:
    prefill_address: prefill worker used when a request names none (None = prefill locally).
    min_remote_tokens: None (default) = the cost-based decider (decode_service/pd_decider.py)
    chooses local or remote prefill per request from both sides' queues, decode's prefix hit
    and learned rates; a number = the fixed threshold of old: an uncached prompt suffix
    shorter than this is prefilled here, a longer one on a prefill worker.
    local_prefill_itl_budget_ms: the decider's ITL budget: a local prefill runs inside this
    worker's decode steps and stalls every running sequence for its compute time (a
    255-token suffix cost ~1 s of ITL on a CPU core); one that would stall a busy batch
    longer than this goes remote.
    local_prefill_idle_budget_ms: while this worker runs no sequence, a local prefill that
    would take up to this long is chosen when it is the faster path (0: off).
    on_prefill_failure: "recompute" (prefill locally from this worker's cached prefix) or
    "fail" (end the request with an error) when a remote prefill fails or times out.
    prefill_timeout_seconds: stall budget of one Prefill call: it is given up (Abort, then
    recompute or fail) once the prefill worker's engine has run no forward step for this
    long, measured by polling its GetStats `num_steps`. A queue of long prefills ahead of
    this one does not end it while the prefill worker keeps stepping (a fixed deadline did,
    whatever the queue). prefill_max_seconds: hard cap of one Prefill call, sent as its
    timeout_seconds (the prefill worker stops by then; a NIXL quarantine lasts until then at
    most: it ends once a re-sent Abort is answered, decode_service/quarantine.py).
    kv_wait_seconds: after Prefill answered OK, how long the receiver may take to report
    every block written. abort_timeout_seconds / handshake_timeout_seconds: those calls.
    quarantine_grace_seconds: blocks whose transfer the prefill worker never confirmed
    stopped are reused only this long after the prefill deadline.
    max_n: most completions per request (INVALID_ARGUMENT above it).
    """

    prefill_address: str | None = None
    min_remote_tokens: int | None = None
    local_prefill_itl_budget_ms: float = 50.0
    local_prefill_idle_budget_ms: float = 250.0
    on_prefill_failure: str = "recompute"
    prefill_timeout_seconds: float = 60.0
    prefill_max_seconds: float = 600.0
    kv_wait_seconds: float = 10.0
    abort_timeout_seconds: float = 5.0
    handshake_timeout_seconds: float = 5.0
    quarantine_grace_seconds: float = 5.0
    max_n: int = 16

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.on_prefill_failure not in ("recompute", "fail"):
            raise ValueError("on_prefill_failure must be 'recompute' or 'fail'")
        if self.min_remote_tokens is not None and self.min_remote_tokens < 1:
            raise ValueError("min_remote_tokens must be ≥ 1")
        if self.local_prefill_itl_budget_ms < 0:
            raise ValueError("local_prefill_itl_budget_ms must be ≥ 0")
        if self.local_prefill_idle_budget_ms < 0:
            raise ValueError("local_prefill_idle_budget_ms must be ≥ 0")
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


def _threshold(text: str) -> int | None:
    """--min-remote-tokens: a token count, or 'auto' (None: the decider), so deployment files
    can pass the flag always and leave the choice to an environment variable."""
    return None if text == "auto" else int(text)


def build_parser() -> argparse.ArgumentParser:
    """The decode worker's flags (the shared engine/server/role ones, then its own)."""
    p = argparse.ArgumentParser(prog="baton serve-decode",
                                description="Baton decode worker (gRPC DecodeService).",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = add_role_args(p, DEFAULT_PORT, "decode")
    g.add_argument("--prefill-address", default=None, help="default prefill worker host:port")
    g.add_argument("--min-remote-tokens", type=_threshold, default=None,
                   help="fixed P/D threshold: prefill an uncached suffix of at least this "
                        "many tokens remotely, a shorter one here ('auto' or unset: the "
                        "cost-based decider chooses per request)")
    g.add_argument("--local-prefill-itl-budget-ms", type=float, default=50.0,
                   help="cost-based P/D: the longest stall a local prefill may put on a busy "
                        "decode batch before it goes to the prefill worker")
    g.add_argument("--local-prefill-idle-budget-ms", type=float, default=250.0,
                   help="cost-based P/D: while no sequence runs here, the longest local "
                        "prefill chosen when it is faster than the prefill worker (0: off)")
    g.add_argument("--on-prefill-failure", default="recompute", choices=["recompute", "fail"],
                   help="when a remote prefill fails: prefill here instead, or fail the request")
    g.add_argument("--prefill-timeout-seconds", type=float, default=60.0,
                   help="give a remote prefill up after this long without prefill progress")
    g.add_argument("--prefill-max-seconds", type=float, default=600.0,
                   help="hard cap of one remote prefill, queue included")
    g.add_argument("--kv-wait-seconds", type=float, default=10.0,
                   help="after the prefill worker said OK: longest wait for every KV block")
    g.add_argument("--abort-timeout-seconds", type=float, default=5.0,
                   help="timeout of one Abort call to a prefill worker")
    g.add_argument("--handshake-timeout-seconds", type=float, default=5.0,
                   help="timeout of the KV-layout handshake with a prefill worker")
    g.add_argument("--quarantine-grace-seconds", type=float, default=5.0,
                   help="blocks a transfer may still write are reused only this long after "
                        "the prefill deadline (unless an Abort is answered first)")
    g.add_argument("--max-n", type=int, default=16, help="most completions per request")
    return p


def parse_args(argv: list[str] | None = None) -> DecodeConfig:
    """Command line → DecodeConfig; exits with a usage message on bad flags."""
    p = build_parser()
    a = p.parse_args(argv)
    try:
        return DecodeConfig(
            **role_config_kwargs(a), prefill_address=a.prefill_address,
            min_remote_tokens=a.min_remote_tokens,
            local_prefill_itl_budget_ms=a.local_prefill_itl_budget_ms,
            local_prefill_idle_budget_ms=a.local_prefill_idle_budget_ms,
            on_prefill_failure=a.on_prefill_failure,
            prefill_timeout_seconds=a.prefill_timeout_seconds,
            prefill_max_seconds=a.prefill_max_seconds, kv_wait_seconds=a.kv_wait_seconds,
            abort_timeout_seconds=a.abort_timeout_seconds,
            handshake_timeout_seconds=a.handshake_timeout_seconds,
            quarantine_grace_seconds=a.quarantine_grace_seconds, max_n=a.max_n)
    except ValueError as e:
        p.error(str(e))
