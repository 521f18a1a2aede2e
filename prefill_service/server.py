"""The prefill worker process: build everything from one config, serve, drain on SIGTERM.

    main(argv) → parse_args → PrefillConfig → run_worker(parse_args, Server, argv): uvloop, serve until SIGTERM, drain
    serve: PrefillServer.start()
      1. load the engine (model, dtype, KV pool) and start its thread (AsyncEngine)
      2. make the KV sender over the engine's kv_cache (--transport nixl | grpc)
      3. grpc.aio server: PrefillService + health (SERVING now that the model is loaded)
      4. metrics HTTP (--metrics-port), then print `READY port=N` for launchers
    SIGTERM/SIGINT → health NOT_SERVING, refuse new prefills, let in-flight ones finish
    (--drain-seconds), release held blocks, stop the server and the engine.
"""
from __future__ import annotations

import logging
import sys

import grpc

from baton.worker.async_engine import AsyncEngine
from baton.engine.llm_engine import LLMEngine
from baton.grpc_options import CHANNEL_OPTIONS
from baton.worker.process import (
    add_health,
    bind,
    served_model_name,
    set_serving,
    run_worker,
    start_metrics_server,
)
from baton.transfer import kv_layout, make_sender
from prefill_service.config import PrefillConfig, parse_args
from prefill_service.metrics import PrefillMetrics
from prefill_service.servicer import PrefillServicer
from prefill_service.worker import PrefillWorker
from protos import prefill_pb2, prefill_pb2_grpc

log = logging.getLogger(__name__)
SERVICE_NAME = prefill_pb2.DESCRIPTOR.services_by_name["PrefillService"].full_name


class PrefillServer:
    """One prefill worker. `await start()` binds and serves; `await stop()` drains and ends.

    Tests run it in-process (port 0): `port`, `address`, `engine` (the LLMEngine), `worker`
    and `metrics` are there to look at.
    """

    def __init__(self, config: PrefillConfig) -> None:
        self.config = config
        self.port = 0
        self.address = ""
        self.metrics_port: int | None = None

    async def start(self) -> PrefillServer:
        cfg = self.config
        self.engine = LLMEngine(cfg.engine)
        self.ae = AsyncEngine(self.engine)
        self.ae.start()
        kv_cache = self.engine.runner.kv_cache
        self.layout = kv_layout(served_model_name(cfg.engine, cfg.served_model_name), kv_cache)
        self.sender = make_sender(cfg.transport, kv_cache, self.layout)
        self.metrics = PrefillMetrics()
        self.worker = PrefillWorker(cfg, self.ae, self.sender, self.metrics)
        self.metrics.watch(self.engine, self.worker.entries)
        self.server = grpc.aio.server(options=CHANNEL_OPTIONS)
        self.port, self.address = bind(self.server, cfg.server)
        self.servicer = PrefillServicer(self.worker, self.layout, cfg.transport, self.address)
        prefill_pb2_grpc.add_PrefillServiceServicer_to_server(self.servicer, self.server)
        self.health = add_health(self.server)
        await self.server.start()
        self.worker.start()
        await set_serving(self.health, [SERVICE_NAME], True)
        self.metrics_port = start_metrics_server(cfg.server.host, cfg.server.metrics_port,
                                                 self.metrics.registry)
        log.info("prefill worker serving", extra={"address": self.address,
                                                  "transport": cfg.transport,
                                                  "num_blocks": self.engine.kv.num_blocks})
        return self

    async def stop(self, drain_s: float | None = None) -> None:
        """Drain (NOT_SERVING, finish in-flight prefills, release held blocks), then stop."""
        await self.health.enter_graceful_shutdown()
        drain = self.config.server.drain_seconds if drain_s is None else drain_s
        await self.worker.drain(drain)
        await self.server.stop(grace=1.0)
        self.sender.close()
        self.ae.shutdown()
        log.info("prefill worker stopped", extra={"address": self.address})


def main(argv: list[str] | None = None) -> int:
    return run_worker(parse_args, PrefillServer, argv)


if __name__ == "__main__":
    sys.exit(main())
