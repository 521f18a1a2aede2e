"""The prefill worker's one frozen config, built from the command line in `main`."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from baton.config import EngineConfig
from baton.worker.flags import (
    ServerConfig,
    add_engine_args,
    add_server_args,
    engine_config_from_args,
    server_config_from_args,
)

DEFAULT_PORT = 50052


@dataclass(frozen=True)
class PrefillConfig:
    """transport: how KV blocks leave this worker ("nixl" | "grpc"; "inproc" for tests).
    lease_seconds: how long blocks stay held after a reply, waiting for ReleaseBlocks (the
    request may shorten it). max_prompt_tokens: per-request prompt limit (INVALID_ARGUMENT
    above it). timeout_seconds: default budget of one Prefill call (queue, compute,
    transfer) when the request gives none. tombstone_seconds: how long an aborted request id
    is refused, so a Prefill that arrives after its Abort never writes into reused blocks.
    """

    engine: EngineConfig = field(default_factory=EngineConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    served_model_name: str | None = None
    transport: str = "nixl"
    lease_seconds: float = 30.0
    max_prompt_tokens: int = 32768
    timeout_seconds: float = 600.0
    tombstone_seconds: float = 120.0

    def __post_init__(self) -> None:
        if self.transport not in ("nixl", "grpc", "inproc"):
            raise ValueError(f"transport must be nixl, grpc or inproc, got {self.transport!r}")
        if self.lease_seconds <= 0 or self.timeout_seconds <= 0:
            raise ValueError("lease_seconds and timeout_seconds must be positive")
        if self.max_prompt_tokens < 1:
            raise ValueError("max_prompt_tokens must be ≥ 1")


def parse_args(argv: list[str] | None = None) -> PrefillConfig:
    p = argparse.ArgumentParser(prog="baton serve-prefill",
                                description="Baton prefill worker (gRPC PrefillService).")
    add_engine_args(p)
    # A prefill worker's queue mixes continuing turns (short uncached suffixes) with cold
    # contexts: shortest-first keeps the former from queueing behind the latter.
    p.set_defaults(schedule_policy="shortest_first")
    add_server_args(p, DEFAULT_PORT)
    g = p.add_argument_group("prefill")
    g.add_argument("--transport", default="nixl", choices=["nixl", "grpc"])
    g.add_argument("--lease-seconds", type=float, default=30.0)
    g.add_argument("--max-prompt-tokens", type=int, default=32768)
    g.add_argument("--timeout-seconds", type=float, default=600.0,
                   help="cap of one Prefill call (queue, compute, transfer)")
    a = p.parse_args(argv)
    try:
        return PrefillConfig(
            engine=engine_config_from_args(a), server=server_config_from_args(a),
            served_model_name=a.served_model_name, transport=a.transport,
            lease_seconds=a.lease_seconds, max_prompt_tokens=a.max_prompt_tokens,
            timeout_seconds=a.timeout_seconds)
    except ValueError as e:
        p.error(str(e))
