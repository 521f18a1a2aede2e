"""Plumbing both worker processes share: command-line engine flags, server settings,
structured logs, the gRPC health service, Prometheus export and shutdown signals.

A worker's `main` does, in order:
    args = parser (add_engine_args + add_server_args + its own flags)
    config = its frozen config (engine_config_from_args, server_config_from_args, ...)
    configure_logging(level); uvloop.run(serve(config))
and `serve` loads the engine, builds the grpc.aio server (baton.grpc_options), adds the health
service (SERVING once the model is loaded), starts the metrics server, prints `READY port=N`
for launchers, waits for SIGTERM/SIGINT (stop_event), drains, stops.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import socket
import sys
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from baton.config import CacheConfig, EngineConfig, SchedulerConfig

logger = logging.getLogger(__name__)

# Request ids travel in logs and key engine state: keep them short.
MAX_REQUEST_ID_LEN = 256


@dataclass(frozen=True)
class ServerConfig:
    """Where and how a worker serves.

    host/port: bind address (127.0.0.1 unless told otherwise; port 0 = any free port).
    advertise_address: host:port peers dial (its worker id); None = host:bound port.
    metrics_port: Prometheus HTTP port on `host` (0 = any free port, None = no HTTP server).
    drain_seconds: on SIGTERM, how long in-flight requests may take to finish.
    """

    host: str = "127.0.0.1"
    port: int = 0
    advertise_address: str | None = None
    metrics_port: int | None = None
    drain_seconds: float = 30.0
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.drain_seconds < 0:
            raise ValueError("drain_seconds must be ≥ 0")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default="smollm2-135m", help="registered name or HF folder")
    g.add_argument("--served-model-name", default=None,
                   help="model identity in KV layouts (default: the folder or registered name)")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--kv-cache-memory-bytes", type=int, default=2 << 30)
    g.add_argument("--num-blocks", type=int, default=None, help="fixed KV pool size (tests)")
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--long-prefill-token-threshold", type=int, default=512,
                   help="chunk cap: one request's prefill tokens per step (0 = none)")
    g.add_argument("--max-bypass-s", type=float, default=5.0,
                   help="seconds smaller requests may pass one that cannot get KV blocks "
                        "before admission waits for it (0 = FIFO)")
    g.add_argument("--seed", type=int, default=0)


def add_server_args(p: argparse.ArgumentParser, default_port: int) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=default_port, help="0 = any free port")
    g.add_argument("--advertise-address", default=None)
    g.add_argument("--metrics-port", type=int, default=None)
    g.add_argument("--drain-seconds", type=float, default=30.0)
    g.add_argument("--log-level", default="INFO")


def engine_config_from_args(a: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=a.model, dtype=a.dtype, max_model_len=a.max_model_len, seed=a.seed,
        cache=CacheConfig(block_size=a.block_size, kv_cache_memory_bytes=a.kv_cache_memory_bytes,
                          num_blocks=a.num_blocks, enable_prefix_caching=not a.no_prefix_caching),
        scheduler=SchedulerConfig(max_num_batched_tokens=a.max_num_batched_tokens,
                                  max_num_seqs=a.max_num_seqs,
                                  long_prefill_token_threshold=a.long_prefill_token_threshold,
                                  max_bypass_s=a.max_bypass_s))


def server_config_from_args(a: argparse.Namespace) -> ServerConfig:
    return ServerConfig(host=a.host, port=a.port, advertise_address=a.advertise_address,
                        metrics_port=a.metrics_port, drain_seconds=a.drain_seconds,
                        log_level=a.log_level)


def served_model_name(engine: EngineConfig, override: str | None) -> str:
    """The model identity both ends put in their KV layouts."""
    return override or engine.model.rstrip("/").rsplit("/", 1)[-1]


# ---- logs -------------------------------------------------------------------------------
class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg and any `extra=` fields
    (request_id, peer, ...), so logs can be filtered by request id."""

    _STD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": round(record.created, 6), "level": record.levelname,
               "logger": record.name, "msg": record.getMessage()}
        out.update({k: v for k, v in vars(record).items() if k not in self._STD})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def configure_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


# ---- server pieces ------------------------------------------------------------------------
def bind(server: grpc.aio.Server, config: ServerConfig) -> tuple[int, str]:
    """Bind the insecure port; returns (bound port, advertised address)."""
    port = server.add_insecure_port(f"{config.host}:{config.port}")
    if port == 0:
        raise RuntimeError(f"could not bind {config.host}:{config.port}")
    return port, advertised_address(config.host, port, config.advertise_address)


_WILDCARDS = ("", "0.0.0.0", "::", "[::]")


def advertised_address(host: str, port: int, advertise: str | None = None) -> str:
    """The host:port peers dial: `advertise` when given, else host:port. A wildcard bind
    (0.0.0.0, ::) cannot be dialled, so it advertises this machine's primary address instead
    (the source address of its default route). IPv6 literals are bracketed."""
    if advertise:
        return advertise
    if host in _WILDCARDS:
        host = _primary_address(ipv6=":" in host)
        logger.warning("bound to a wildcard address without --advertise-address: "
                       "advertising %s", host)
    host = host.strip("[]")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _primary_address(ipv6: bool) -> str:
    family = socket.AF_INET6 if ipv6 else socket.AF_INET
    probe = ("2001:db8::1", 9) if ipv6 else ("192.0.2.1", 9)  # documentation ranges
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(probe)  # UDP connect picks a route and sends nothing
            return s.getsockname()[0]
    except OSError:  # no default route (an isolated namespace): the host name's address
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return "::1" if ipv6 else "127.0.0.1"


def add_health(server: grpc.aio.Server) -> health.aio.HealthServicer:
    """The standard grpc.health.v1 service; starts NOT_SERVING (see set_serving)."""
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    return servicer


async def set_serving(servicer: health.aio.HealthServicer, services: list[str],
                      serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving \
        else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *services]:
        await servicer.set(name, status)


def start_metrics_server(host: str, port: int | None, registry) -> int | None:
    """Serve `registry` at http://host:port/metrics on a daemon thread; returns the port."""
    if port is None:
        return None
    from prometheus_client import start_http_server

    httpd, _ = start_http_server(port, addr=host, registry=registry)
    return httpd.server_port


def install_stop_signals(stop: asyncio.Event) -> None:
    """SIGTERM / SIGINT set `stop` (the serve loop then drains and exits)."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)


def announce(port: int, metrics_port: int | None) -> None:
    """The line launchers wait for (stdout, flushed)."""
    extra = f" metrics_port={metrics_port}" if metrics_port is not None else ""
    print(f"READY port={port}{extra}", flush=True)


class Rejected(Exception):
    """A request refused with a specific gRPC status (ValueError means INVALID_ARGUMENT)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


async def serve_until_signalled(start) -> None:
    """Start a worker (`await start()` returns an object with port, metrics_port and an async
    stop()), print READY, serve until SIGTERM/SIGINT, then stop it (drain) in any case."""
    stop = asyncio.Event()
    install_stop_signals(stop)
    server = await start()
    announce(server.port, server.metrics_port)
    try:
        await stop.wait()
    finally:
        await server.stop()


def run_worker(parse_args, server_cls, argv: list[str] | None) -> int:
    """Process entry of a worker role: parse flags into its frozen config, configure logging,
    run `server_cls(config)` on uvloop until signalled."""
    import uvloop

    config = parse_args(argv)
    configure_logging(config.server.log_level)
    uvloop.run(serve_until_signalled(lambda: server_cls(config).start()))
    return 0
