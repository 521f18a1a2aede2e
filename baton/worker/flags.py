"""The configs every worker role shares, their flags declared on the fields
(baton/flagspec.py): ServerConfig (where and how a worker serves) and RoleConfig (engine,
server, and what both roles hold: served_model_name, transport, max_prompt_tokens), which each
role's config extends (baton/worker/role_configs.py); `parse_role` builds a role's config
from its generated command line (flagspec.parser_for).
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field

from baton.config import EngineConfig
from baton.flagspec import build, flag


@dataclass(frozen=True)
class ServerConfig:
    """Where and how a worker serves.

    host/port: bind address (127.0.0.1 unless told otherwise; port 0 = any free port).
    advertise_address: host:port peers dial (its worker id); None = host:bound port.
    metrics_port: Prometheus HTTP port on `host` (0 = any free port, None = no HTTP server).
    drain_seconds: on SIGTERM, how long in-flight requests may take to finish.
    num_threads: torch threads (None: baton.threads.default_num_threads, from the CPUs the
    process may run on).
    cpu_share: "FILE:SLOT" — share the host's cores with the other workers of FILE per
    step (baton/worker/cpu_share.py; `baton up --pin share`); None = fixed num_threads.
    """

    host: str = flag("127.0.0.1", "gRPC bind address", cluster=False)
    port: int = flag(0, "gRPC port (0 = any free port)", cluster=False)
    advertise_address: str | None = flag(
        None, "host:port peers dial (default: the bound address)", cluster=False)
    metrics_port: int | None = flag(
        None, "Prometheus /metrics port (0 = any free one; default: none)", cluster=False)
    drain_seconds: float = flag(
        30.0, "on SIGTERM: seconds in-flight requests may take to finish", cluster=False)
    log_level: str = flag("INFO", "DEBUG, INFO, WARNING or ERROR")
    num_threads: int | None = flag(
        None, "torch threads (default: OMP_NUM_THREADS, else the CPUs this process may run "
              "on less those busy at start)", name="--threads", cluster=False)
    cpu_share: str | None = flag(
        None, "per step and layer, take the cores other workers of FILE leave idle (all of "
              "this process's CPUs when they are idle, an even share when busy)",
        metavar="FILE:SLOT", cluster=False)

    def __post_init__(self) -> None:
        if self.cpu_share is not None and not self.cpu_share.rpartition(":")[2].isdigit():
            raise ValueError(f"cpu_share must be FILE:SLOT, got {self.cpu_share!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.drain_seconds < 0:
            raise ValueError("drain_seconds must be ≥ 0")


def served_model_name(engine: EngineConfig, override: str | None) -> str:
    """The model identity both ends put in their KV layouts."""
    return override or engine.model.rstrip("/").rsplit("/", 1)[-1]


TRANSPORTS = ("nixl", "grpc", "inproc")  # inproc: unit tests only (one process)


@dataclass(frozen=True)
class RoleConfig:
    """What every worker role's frozen config holds (DecodeConfig, PrefillConfig extend it).

    served_model_name: model identity in KV layouts (default: the folder or registered name).
    transport: how KV blocks move ("nixl" | "grpc"; "inproc" for tests).
    max_prompt_tokens: per-request prompt limit (INVALID_ARGUMENT above it).
    """

    engine: EngineConfig = field(default_factory=EngineConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    served_model_name: str | None = flag(
        None, "model identity in KV layouts and store keys (default: the folder or "
              "registered name)")
    transport: str = flag("nixl", "how KV blocks move between prefill and decode workers",
                          choices=("nixl", "grpc"))
    max_prompt_tokens: int = flag(32768, "longest prompt a request may have "
                                         "(INVALID_ARGUMENT above)")

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be nixl, grpc or inproc, got {self.transport!r}")
        if self.max_prompt_tokens < 1:
            raise ValueError("max_prompt_tokens must be ≥ 1")


def parse_role(cls: type, parser: argparse.ArgumentParser, argv: list[str] | None):
    """`argv` → a frozen `cls`; exits with a usage message on bad flags. The KV store's
    model identity follows --served-model-name (workers that exchange blocks share keys)."""
    a = parser.parse_args(argv)
    try:
        config = build(cls, a)
        cache = dataclasses.replace(config.engine.cache,
                                    kv_store_model=config.served_model_name)
        return dataclasses.replace(config, engine=dataclasses.replace(config.engine,
                                                                      cache=cache))
    except ValueError as e:
        parser.error(str(e))
