"""One start path for every worker role: the engine, its thread, the KV layout, the gRPC
server and its health service, metrics and the log lines; the role adds only its own parts.

    rt = await start_worker("decode", SERVICE_NAME, config, build)
      1. LLMEngine(config.engine) and its thread (AsyncEngine); the KV layout of engine.kv_cache
      2. grpc.aio server (CHANNEL_OPTIONS) bound to config.server; health (NOT_SERVING yet)
      3. parts = build(rt): the role makes its transport, metrics, worker and servicer over
         rt.engine / rt.ae / rt.layout and adds its services to rt.server (rt.address known)
      4. server.start(); health SERVING; metrics HTTP (--metrics-port); "<role> worker serving"
    await rt.stop(drain_s)
      health NOT_SERVING (enter_graceful_shutdown), parts.drain(s), server.stop(grace=1),
      parts.close(), the engine thread ends; "<role> worker stopped"
The server pieces it uses (bind, advertised_address, add_health, set_serving,
start_metrics_server) follow it below.
"""
from __future__ import annotations

import logging
import socket
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from baton.engine.kv_budget import KVBudgetError
from baton.engine.llm_engine import LLMEngine
from baton.grpc_options import CHANNEL_OPTIONS
from baton.threads import set_torch_threads
from baton.worker.cpu_share import CpuShare
from baton.transfer import kv_layout
from baton.worker.async_engine import AsyncEngine
from baton.worker.flags import RoleConfig, ServerConfig, served_model_name
from baton.models.registry import ModelNotFoundError, UnsupportedModelError
from baton.worker.process import StartFailed
from baton.worker.stats_rpc import StatsRpc
from protos import common_pb2

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

logger = logging.getLogger(__name__)


@dataclass
class RoleParts:
    """What a role's build callback hands back to its runtime."""

    registry: CollectorRegistry  # its metrics, served on --metrics-port
    drain: Callable[[float], Awaitable[None]]  # finish in-flight work within s seconds
    close: Callable[[], Awaitable[None]]  # after the server stopped: close the role's parts
    stats: StatsRpc | None = None  # its GetStats, told the metrics port once it is bound


@dataclass
class WorkerRuntime:
    """A started worker's shared skeleton (see the module docstring)."""

    role: str  # "decode" | "prefill": names the log lines
    config: ServerConfig
    engine: LLMEngine
    ae: AsyncEngine
    layout: common_pb2.KVLayout
    server: grpc.aio.Server
    health: health.aio.HealthServicer
    port: int
    address: str
    metrics_port: int | None = None
    parts: RoleParts | None = None

    async def stop(self, drain_s: float | None = None) -> None:
        """Drain (NOT_SERVING, then the role's drain), stop the server, close, end the engine."""
        await self.health.enter_graceful_shutdown()
        await self.parts.drain(self.config.drain_seconds if drain_s is None else drain_s)
        await self.server.stop(grace=1.0)
        await self.parts.close()
        self.ae.shutdown()
        if self.ae.cpu_share is not None:
            self.ae.cpu_share.close()
        logger.info("%s worker stopped", self.role, extra={"address": self.address})


async def start_worker(role: str, service_name: str, config: RoleConfig,
                       build: Callable[[WorkerRuntime], RoleParts]) -> WorkerRuntime:
    """Start a worker of `role` serving `service_name` (steps 1-4 of the module docstring)."""
    threads = set_torch_threads(config.server.num_threads)
    try:
        engine = LLMEngine(config.engine)
    except (KVBudgetError, ModelNotFoundError, UnsupportedModelError) as e:
        # the default pool does not fit, or no such model: one line, exit 1
        print(f"{role} worker: {e}", file=sys.stderr, flush=True)
        raise StartFailed(str(e)) from None
    ae = AsyncEngine(engine)
    if config.server.cpu_share is not None:
        path, _, slot = config.server.cpu_share.rpartition(":")
        ae.cpu_share = CpuShare(path, int(slot))
        ae.cpu_share.start_host_load()
    ae.start()
    layout = kv_layout(served_model_name(config.engine, config.served_model_name),
                       engine.kv_cache)
    server = grpc.aio.server(options=CHANNEL_OPTIONS)
    port, address = bind(server, config.server)
    rt = WorkerRuntime(role, config.server, engine, ae, layout, server, add_health(server),
                       port, address)
    rt.parts = build(rt)
    await server.start()
    await set_serving(rt.health, [service_name], True)
    rt.metrics_port = start_metrics_server(config.server.host, config.server.metrics_port,
                                           rt.parts.registry)
    if rt.parts.stats is not None:
        rt.parts.stats.metrics_port = rt.metrics_port or 0
    logger.info("%s worker serving in %s (--dtype %s) on %s", role,
                config.engine.resolved_dtype, config.engine.dtype, config.engine.device,
                extra={"address": address, "transport": config.transport,
                       "num_blocks": engine.num_blocks, "threads": threads})
    return rt


class WorkerServer:
    """One worker process's server: `await start()` loads, binds and serves; `await stop()`
    drains and ends. A role (DecodeServer, PrefillServer) sets `role` and `service_name` and
    builds its parts in `add_role(runtime) -> RoleParts`; everything else is this skeleton.

    Tests run it in-process (port 0): `port`, `address`, `metrics_port` once started, and
    `runtime` (engine, ae, layout, server, health) — plus whatever `add_role` kept.
    """

    role: str = ""  # "decode" | "prefill"
    service_name: str = ""  # the gRPC service whose health turns SERVING

    def __init__(self, config: RoleConfig) -> None:
        self.config = config
        self.port = 0
        self.address = ""
        self.metrics_port: int | None = None
        self.runtime: WorkerRuntime | None = None

    async def start(self) -> WorkerServer:
        """Load, bind and serve (start_worker with this role's parts)."""
        self.runtime = rt = await start_worker(self.role, self.service_name, self.config,
                                               self.add_role)
        self.port, self.address, self.metrics_port = rt.port, rt.address, rt.metrics_port
        return self

    def add_role(self, rt: WorkerRuntime) -> RoleParts:
        """Build the role's parts on the started skeleton (before it serves)."""
        raise NotImplementedError

    async def stop(self, drain_s: float | None = None) -> None:
        """Drain (NOT_SERVING, the role's drain within drain_s or --drain-seconds), stop."""
        await self.runtime.stop(drain_s)


# ---- server pieces --------------------------------------------------------------------------
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
    """Set the overall ("") and each named service's health status."""
    status = health_pb2.HealthCheckResponse.SERVING if serving \
        else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *services]:
        await servicer.set(name, status)


def start_metrics_server(host: str, port: int | None,
                         registry: CollectorRegistry) -> int | None:
    """Serve `registry` at http://host:port/metrics on a daemon thread; returns the port."""
    if port is None:
        return None
    from prometheus_client import start_http_server

    httpd, _ = start_http_server(port, addr=host, registry=registry)
    return httpd.server_port
