"""The prefill worker's one frozen config, built from the command line in `main`."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from baton.worker.flags import RoleConfig, add_role_args, role_config_kwargs

DEFAULT_PORT = 50052


@dataclass(frozen=True)
class PrefillConfig(RoleConfig):
    """RoleConfig (engine, server, transport: how KV blocks leave this worker,
    max_prompt_tokens) plus: lease_seconds: how long blocks stay held after a reply, waiting
    for ReleaseBlocks (the request may shorten it). timeout_seconds: default budget of one Prefill call (queue, compute,
    transfer) when the request gives none. tombstone_seconds: how long an aborted request id
    is refused, so a Prefill that arrives after its Abort never writes into reused blocks.
    kv_send_per_chunk: send each prefill step's full blocks while the next chunk computes
    (kv_stream.py); a transport that cannot stream would send once at the end regardless.
    """

    lease_seconds: float = 30.0
    timeout_seconds: float = 600.0
    tombstone_seconds: float = 120.0
    kv_send_per_chunk: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.lease_seconds <= 0 or self.timeout_seconds <= 0:
            raise ValueError("lease_seconds and timeout_seconds must be positive")


def build_parser() -> argparse.ArgumentParser:
    """The prefill worker's flags (the shared engine/server/role ones, then its own)."""
    p = argparse.ArgumentParser(prog="baton serve-prefill",
                                description="Baton prefill worker (gRPC PrefillService).",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = add_role_args(p, DEFAULT_PORT, "prefill")
    g.add_argument("--lease-seconds", type=float, default=30.0,
                   help="how long sent blocks stay held waiting for the decode worker's "
                        "ReleaseBlocks (then they go to the prefix cache)")
    g.add_argument("--timeout-seconds", type=float, default=600.0,
                   help="cap of one Prefill call (queue, compute, transfer)")
    g.add_argument("--kv-send-per-chunk", action=argparse.BooleanOptionalAction, default=True,
                   help="send each prefill chunk's full KV blocks while the next chunk "
                        "computes (NIXL and gRPC transports)")
    return p


def parse_args(argv: list[str] | None = None) -> PrefillConfig:
    """Command line → PrefillConfig; exits with a usage message on bad flags."""
    p = build_parser()
    a = p.parse_args(argv)
    try:
        return PrefillConfig(**role_config_kwargs(a), lease_seconds=a.lease_seconds,
                             timeout_seconds=a.timeout_seconds,
                             kv_send_per_chunk=a.kv_send_per_chunk)
    except ValueError as e:
        p.error(str(e))
