"""Assembles one gateway: tokenizer, preparation pool (gateway/prep_pool.py: the processes
that parse, check and tokenize requests), worker pool, router, dispatcher, HTTP app, gRPC
front.

    gw = Gateway(config)          # or Gateway(config, prompts) with a tokenizer already loaded
    await gw.start()              # binds config.host:config.port (0 = any) and the gRPC port
    ... gw.http_url, gw.grpc_address ...
    await gw.stop()               # drain (gateway/drain.py): new requests and /health get 503,
                                  # running ones get shutdown_grace_s, streams still running
                                  # then end with an error event and [DONE]; then close

Used by `python -m gateway` and, in-process, by the tests.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time

import grpc
import uvicorn
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gateway.config import GatewayConfig, RoutingPolicy
from gateway.dispatch import Dispatcher
from gateway.drain import Drain
from gateway.grpc_front import ApiKeyInterceptor, GatewayServicer
from gateway.http_api import create_app
from gateway.metrics import GatewayMetrics
from gateway.prep_pool import PrepPool, PrepSettings, start_fork_server
from gateway.prompts import PromptBuilder
from gateway.router import Router
from gateway.workers import WorkerPool
from protos import gateway_pb2_grpc

logger = logging.getLogger(__name__)

# After the drain nothing should be running: uvicorn then only closes idle connections.
_CLOSE_TIMEOUT_S = 2.0
# At the deadline, how long the ended requests may take to send their last bytes.
_END_TIMEOUT_S = 2.0


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the gateway's main owns the signals."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class Gateway:
    def __init__(self, config: GatewayConfig, prompts: PromptBuilder | None = None) -> None:
        self.config = config
        self.prompts = prompts
        self.metrics = GatewayMetrics()
        self.router = Router(config.router)
        self.pool = WorkerPool(config, config.router.policy is not RoutingPolicy.ROUND_ROBIN,
                               on_worker_removed=self.router.forget_worker,
                               on_worker_restarted=self.metrics.count_restart)
        self.dispatcher = Dispatcher(config, self.pool, self.router, self.metrics)
        self.drain = Drain()
        self.http_port: int | None = None
        self.grpc_port: int | None = None
        self._http: _Server | None = None
        self._http_task: asyncio.Task | None = None
        self._grpc: grpc.aio.Server | None = None
        self._grpc_health: health.aio.HealthServicer | None = None
        self._janitor: asyncio.Task | None = None
        self.prep: PrepPool | None = None

    @property
    def http_url(self) -> str:
        host = self.config.host if self.config.host not in ("0.0.0.0", "::") else "127.0.0.1"
        return f"http://{_bracket(host)}:{self.http_port}"

    @property
    def grpc_address(self) -> str | None:
        return None if self.grpc_port is None else \
            f"{_bracket(self.config.grpc_host)}:{self.grpc_port}"

    async def start(self) -> None:
        start_fork_server()  # its imports overlap the tokenizer's load below
        if self.prompts is None:
            self.prompts = await asyncio.to_thread(self._load_prompts)
        config = self.config
        self.prep = PrepPool(self.prompts, PrepSettings(
            frozenset({config.served_model_name, config.model}), config.tool_call_parser,
            config.limits), config.prep_processes, config.prep_timeout_s)
        await self.prep.start()
        await self.pool.start()
        if self.config.grpc_port is not None:
            await self._start_grpc()
        await self._start_http()
        self._janitor = asyncio.create_task(self._expire_sessions())

    def _load_prompts(self) -> PromptBuilder:
        from baton.models.registry import resolve_model
        prompts = PromptBuilder.from_folder(resolve_model(self.config.model),
                                            self.config.max_model_len, self.config.chat_template)
        # logprobs' token bytes (gateway/token_bytes.py) import xgrammar and build its table,
        # ~1.4 s: off the start path and before a first logprobs request would block the loop
        threading.Thread(target=prompts.token_text.bytes, args=(0,), daemon=True,
                         name="token-bytes").start()
        return prompts

    async def _start_grpc(self) -> None:
        key = self.config.api_key
        self._grpc = grpc.aio.server(interceptors=[ApiKeyInterceptor(key)] if key else None)
        gateway_pb2_grpc.add_GatewayServiceServicer_to_server(
            GatewayServicer(self.config, self.prep, self.dispatcher,
                            on_disconnect=self.metrics.disconnects.inc), self._grpc)
        self._grpc_health = health.aio.HealthServicer()
        await self._grpc_health.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(self._grpc_health, self._grpc)
        address = f"{_bracket(self.config.grpc_host)}:{self.config.grpc_port}"
        self.grpc_port = self._grpc.add_insecure_port(address)
        if not self.grpc_port:
            raise OSError(f"cannot bind the gRPC front to {address}")
        await self._grpc.start()

    async def _start_http(self) -> None:
        app = create_app(self.config, self.prompts, self.prep, self.dispatcher, self.pool,
                         self.metrics, self.drain)
        family = socket.AF_INET6 if ":" in self.config.host else socket.AF_INET
        sock = socket.create_server((self.config.host, self.config.port), family=family,
                                    backlog=2048)
        self.http_port = sock.getsockname()[1]
        self._http = _Server(uvicorn.Config(
            app, log_config=None, access_log=self.config.access_log, lifespan="off",
            timeout_graceful_shutdown=_CLOSE_TIMEOUT_S, timeout_keep_alive=30))
        self._http_task = asyncio.create_task(self._http.serve(sockets=[sock]))
        while not self._http.started:
            if self._http_task.done():
                self._http_task.result()
                raise RuntimeError("the HTTP server stopped during start-up")
            await asyncio.sleep(0.005)

    async def stop(self) -> None:
        """Drain, then close (see the module docstring); the gRPC front drains alongside."""
        if self._janitor:
            self._janitor.cancel()
        grace = self.config.shutdown_grace_s
        grpc_stop = None
        if self._grpc is not None:
            await self._grpc_health.enter_graceful_shutdown()
            grpc_stop = asyncio.ensure_future(self._grpc.stop(grace))
        if self._http is not None:
            await self._drain_http(grace)
            await self._close_http()
        if grpc_stop is not None:
            await grpc_stop
        await self.pool.close()
        if self.prep is not None:
            await self.prep.close()

    async def _drain_http(self, grace: float) -> None:
        self.drain.begin()
        if self.drain.running:
            logger.info("draining: %d request(s) running, up to %g s", self.drain.running,
                        grace)
        if not await self.drain.wait_idle(grace):
            logger.warning("%d request(s) still running after the %g s shutdown grace; "
                           "ending them", self.drain.running, grace)
            self.drain.expire()
            await self.drain.wait_idle(_END_TIMEOUT_S)

    async def _close_http(self) -> None:
        self._http.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._http_task), _CLOSE_TIMEOUT_S + 5)
        except (asyncio.TimeoutError, Exception):
            self._http.force_exit = True
            self._http_task.cancel()
            await asyncio.gather(self._http_task, return_exceptions=True)

    async def _expire_sessions(self) -> None:
        while True:
            await asyncio.sleep(60)
            self.router.expire_sessions(time.monotonic())


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host
