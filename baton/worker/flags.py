"""The command-line flags every worker role shares and the frozen configs they build:
`add_engine_args` → EngineConfig (`engine_config_from_args`), `add_server_args` →
ServerConfig (`server_config_from_args`), and `add_role_args` → the fields of `RoleConfig`
(`role_config_kwargs`) that each role's config extends. A role's config.py adds its own
flags beside them.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from baton.config import (
    SCHEDULE_POLICIES,
    SPECULATIVE_METHODS,
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    SpeculativeConfig,
)


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

    host: str = "127.0.0.1"
    port: int = 0
    advertise_address: str | None = None
    metrics_port: int | None = None
    drain_seconds: float = 30.0
    log_level: str = "INFO"
    num_threads: int | None = None
    cpu_share: str | None = None

    def __post_init__(self) -> None:
        if self.cpu_share is not None and not self.cpu_share.rpartition(":")[2].isdigit():
            raise ValueError(f"cpu_share must be FILE:SLOT, got {self.cpu_share!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.drain_seconds < 0:
            raise ValueError("drain_seconds must be ≥ 0")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine flags (model, dtype, KV pool, scheduler budgets, seed)."""
    g = p.add_argument_group("engine")
    g.add_argument("--model", default="smollm2-135m", help="registered name or HF folder")
    g.add_argument("--served-model-name", default=None,
                   help="model identity in KV layouts (default: the folder or registered name)")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="weights and KV dtype (bf16/fp16 are slow on CPUs without them)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                   help="KV pool size in bytes (ignored with --num-blocks; default: "
                        "--kv-memory-fraction of the memory free after the model loads, at "
                        "least one --max-model-len request)")
    g.add_argument("--kv-memory-fraction", type=float, default=0.5,
                   help="share of MemAvailable the default KV pool takes")
    g.add_argument("--num-blocks", type=int, default=None, help="fixed KV pool size (tests)")
    g.add_argument("--no-prefix-caching", action="store_true",
                   help="never reuse cached KV blocks across requests")
    g.add_argument("--kv-host-tier-bytes", type=int, default=0,
                   help="host-memory tier for blocks the KV pool evicts (0 = off)")
    g.add_argument("--kv-disk-tier-dir", default=None,
                   help="disk tier below the host tier: block files go in a fresh folder here")
    g.add_argument("--kv-disk-tier-bytes", type=int, default=8 << 30,
                   help="disk tier budget in bytes (with --kv-disk-tier-dir)")
    g.add_argument("--kv-store-url", "--kv-store", dest="kv_store_url", default=None,
                   help="cluster-wide KV store, mooncake://HOST:PORT (a mooncake_master): "
                        "finished requests' blocks go there, prefills load from it "
                        "(none: off)")
    g.add_argument("--kv-store-segment-bytes", type=int, default=128 << 20,
                   help="memory this worker lends the KV store (with --kv-store-url)")
    g.add_argument("--kv-store-queue-bytes", type=int, default=256 << 20,
                   help="staging for blocks waiting to be written to the KV store; a "
                        "finished request's blocks beyond it are not written (counted)")
    g.add_argument("--kv-store-local-host", default=None,
                   help="address other store clients reach this worker at (default: the "
                        "one toward the master)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="context limit (default: the model's, within the KV pool)")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="token budget of one engine step (decodes + prefill chunks)")
    g.add_argument("--max-num-seqs", type=int, default=64, help="most running requests")
    g.add_argument("--long-prefill-token-threshold", type=int, default=512,
                   help="chunk cap: one request's prefill tokens per step (0 = none)")
    g.add_argument("--max-bypass-s", type=float, default=5.0,
                   help="seconds smaller requests may pass one that cannot get KV blocks "
                        "before admission waits for it (0 = FIFO)")
    g.add_argument("--schedule-policy", choices=list(SCHEDULE_POLICIES),
                   default="shortest_first",
                   help="order of waiting requests: fcfs (arrival) or shortest_first (fewest "
                        "uncached prompt tokens first, with aging; with "
                        "--prefill-target-tokens a running prefill yields to a shorter one)")
    g.add_argument("--max-prefill-wait-s", type=float, default=10.0,
                   help="shortest_first aging: a request waiting longer than this goes "
                        "before younger ones, in arrival order (0 = fcfs)")
    g.add_argument("--prefill-target-tokens", type=int, default=256,
                   help="a step starts no further prefill once it holds this many prompt "
                        "tokens (prefill is compute-bound past it: one request after the "
                        "other gives earlier first tokens than batching them; 0 = fill "
                        "--max-num-batched-tokens)")
    g.add_argument("--time-slice-s", type=float, default=2.0,
                   help="with a KV tier: a request waiting this long for pool space may "
                        "preempt decodes running at least this long (their KV goes to the "
                        "tier and is loaded back, not recomputed; 0 = never)")
    g.add_argument("--seed", type=int, default=0,
                   help="the default RNG's seed (requests without their own seed)")
    add_speculative_args(p)


def add_speculative_args(p: argparse.ArgumentParser) -> None:
    """Speculative decoding flags (SpeculativeConfig)."""
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--speculative-method", choices=[*SPECULATIVE_METHODS, "none"],
                   default="none",
                   help="model-free drafts verified in the decode step, outputs unchanged: "
                        "suffix (the session's tokens and recent outputs, adaptive length), "
                        "ngram (the request's own tokens), none (off)")
    g.add_argument("--num-speculative-tokens", type=int, default=8,
                   help="most drafted tokens a decode row carries per step")
    g.add_argument("--speculative-min-match-tokens", type=int, default=3,
                   help="shortest match of the recent tokens that drafts anything")
    g.add_argument("--spec-benchmark-synthetic-acceptance", type=_rates, default=None,
                   metavar="RATE[,RATE...]",
                   help="BENCHMARK ONLY, outputs are not the model's: keep draft position i "
                        "with probability RATE_i whatever the model says (one RATE r: r, r², "
                        "...; as vLLM's synthetic rejection sampler); needs "
                        "--speculative-method")


def _rates(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected RATE[,RATE...], got {text!r}") from None


def speculative_config_from_args(a: argparse.Namespace) -> SpeculativeConfig:
    """The SpeculativeConfig of parsed `add_speculative_args` flags (ValueError: bad values)."""
    return SpeculativeConfig(
        method=None if a.speculative_method == "none" else a.speculative_method,
        num_speculative_tokens=a.num_speculative_tokens,
        min_match_tokens=a.speculative_min_match_tokens,
        synthetic_acceptance=a.spec_benchmark_synthetic_acceptance or ())


def add_server_args(p: argparse.ArgumentParser, default_port: int) -> None:
    """The server flags (bind address, advertised address, metrics port, drain, logs)."""
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="gRPC bind address")
    g.add_argument("--port", type=int, default=default_port, help="0 = any free port")
    g.add_argument("--advertise-address", default=None,
                   help="host:port peers dial (default: the bound address)")
    g.add_argument("--metrics-port", type=int, default=None,
                   help="Prometheus /metrics port (0 = any free one; default: none)")
    g.add_argument("--drain-seconds", type=float, default=30.0,
                   help="on SIGTERM: seconds in-flight requests may take to finish")
    g.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    g.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: OMP_NUM_THREADS, else the CPUs this process "
                        "may run on less those busy at start)")
    g.add_argument("--cpu-share", default=None, metavar="FILE:SLOT",
                   help="per step, take the cores other workers of FILE leave idle (all of "
                        "this process's CPUs when they are idle, an even share when busy)")


def engine_config_from_args(a: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of parsed `add_engine_args` flags."""
    return EngineConfig(
        model=a.model, dtype=a.dtype, max_model_len=a.max_model_len, seed=a.seed,
        cache=CacheConfig(block_size=a.block_size, kv_cache_memory_bytes=a.kv_cache_memory_bytes,
                          num_blocks=a.num_blocks, kv_memory_fraction=a.kv_memory_fraction,
                          enable_prefix_caching=not a.no_prefix_caching,
                          kv_host_tier_bytes=a.kv_host_tier_bytes,
                          kv_disk_tier_dir=a.kv_disk_tier_dir,
                          kv_disk_tier_bytes=a.kv_disk_tier_bytes,
                          kv_store_url=None if a.kv_store_url in (None, "", "none")
                          else a.kv_store_url,
                          kv_store_segment_bytes=a.kv_store_segment_bytes,
                          kv_store_queue_bytes=a.kv_store_queue_bytes,
                          kv_store_local_host=a.kv_store_local_host,
                          kv_store_model=getattr(a, "served_model_name", None)),
        scheduler=SchedulerConfig(max_num_batched_tokens=a.max_num_batched_tokens,
                                  max_num_seqs=a.max_num_seqs,
                                  long_prefill_token_threshold=a.long_prefill_token_threshold,
                                  max_bypass_s=a.max_bypass_s, policy=a.schedule_policy,
                                  max_prefill_wait_s=a.max_prefill_wait_s,
                                  prefill_target_tokens=a.prefill_target_tokens,
                                  time_slice_s=a.time_slice_s),
        speculative=speculative_config_from_args(a))


def server_config_from_args(a: argparse.Namespace) -> ServerConfig:
    """The ServerConfig of parsed `add_server_args` flags."""
    return ServerConfig(host=a.host, port=a.port, advertise_address=a.advertise_address,
                        metrics_port=a.metrics_port, drain_seconds=a.drain_seconds,
                        log_level=a.log_level, num_threads=a.threads,
                        cpu_share=a.cpu_share)


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
    served_model_name: str | None = None
    transport: str = "nixl"
    max_prompt_tokens: int = 32768

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be nixl, grpc or inproc, got {self.transport!r}")
        if self.max_prompt_tokens < 1:
            raise ValueError("max_prompt_tokens must be ≥ 1")


def add_role_args(p: argparse.ArgumentParser, default_port: int,
                  role: str) -> argparse._ArgumentGroup:
    """Engine and server flags, then the role's group with --transport and
    --max-prompt-tokens; returns that group for the role's own flags."""
    add_engine_args(p)
    add_server_args(p, default_port)
    g = p.add_argument_group(role)
    g.add_argument("--transport", default="nixl", choices=["nixl", "grpc"],
                   help="how KV blocks move between prefill and decode workers")
    g.add_argument("--max-prompt-tokens", type=int, default=32768,
                   help="longest prompt a request may have (INVALID_ARGUMENT above)")
    return g


def role_config_kwargs(a: argparse.Namespace) -> dict:
    """RoleConfig's fields from parsed `add_role_args` flags."""
    return dict(engine=engine_config_from_args(a), server=server_config_from_args(a),
                served_model_name=a.served_model_name, transport=a.transport,
                max_prompt_tokens=a.max_prompt_tokens)
