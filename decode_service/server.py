"""The decode worker process: build everything from one config, serve, drain on SIGTERM.

    main(argv) → parse_args → DecodeConfig → run_worker(parse_args, Server, argv): uvloop, serve until SIGTERM, drain
    serve: DecodeServer.start()
      1. load the engine (model, dtype, KV pool) and start its thread (AsyncEngine)
      2. make the KV receiver over the engine's kv_cache (--transport nixl | grpc; the gRPC
         receiver is a KVTransfer servicer on this same server)
      3. grpc.aio server: DecodeService (+ KVTransfer) + health (SERVING: the model is loaded)
      4. metrics HTTP (--metrics-port), then print `READY port=N` for launchers
    SIGTERM/SIGINT → health NOT_SERVING, refuse new requests, let running ones finish
    (--drain-seconds), abort the rest (clients get Finished{ABORT}), stop.
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
from baton.transfer import kv_layout, make_receiver
from decode_service.config import DecodeConfig, parse_args
from decode_service.metrics import DecodeMetrics
from decode_service.peers import PrefillPeers
from decode_service.servicer import DecodeServicer
from decode_service.worker import DecodeWorker
from protos import decode_pb2, decode_pb2_grpc

log = logging.getLogger(__name__)
SERVICE_NAME = decode_pb2.DESCRIPTOR.services_by_name["DecodeService"].full_name


class DecodeServer:
    """One decode worker. `await start()` binds and serves; `await stop()` drains and ends.

    Tests run it in-process (port 0): `port`, `address`, `engine` (the LLMEngine), `worker`,
    `receiver` and `metrics` are there to look at.
    """

    def __init__(self, config: DecodeConfig) -> None:
        self.config = config
        self.port = 0
        self.address = ""
        self.metrics_port: int | None = None

    async def start(self) -> DecodeServer:
        cfg = self.config
        self.engine = LLMEngine(cfg.engine)
        self.ae = AsyncEngine(self.engine)
        self.ae.start()
        kv_cache = self.engine.runner.kv_cache
        self.layout = kv_layout(served_model_name(cfg.engine, cfg.served_model_name), kv_cache)
        self.receiver = make_receiver(cfg.transport, kv_cache, self.layout)
        self.server = grpc.aio.server(options=CHANNEL_OPTIONS)
        if cfg.transport == "grpc":
            self.receiver.add_to_server(self.server)
        self.port, self.address = bind(self.server, cfg.server)
        if cfg.transport == "grpc":
            self.receiver.set_address(self.address)
        self.metrics = DecodeMetrics()
        self.metrics.watch(self.engine)
        self.peers = PrefillPeers(self.layout, cfg.transport, self.address,
                                  cfg.handshake_timeout_seconds, cfg.abort_timeout_seconds)
        self.worker = DecodeWorker(cfg, self.ae, self.receiver, self.peers, self.metrics)
        decode_pb2_grpc.add_DecodeServiceServicer_to_server(
            DecodeServicer(self.worker, self.layout, self.address), self.server)
        self.health = add_health(self.server)
        await self.server.start()
        await set_serving(self.health, [SERVICE_NAME], True)
        self.metrics_port = start_metrics_server(cfg.server.host, cfg.server.metrics_port,
                                                 self.metrics.registry)
        log.info("decode worker serving", extra={"address": self.address,
                                                 "transport": cfg.transport,
                                                 "num_blocks": self.engine.kv.num_blocks})
        return self

    async def stop(self, drain_s: float | None = None) -> None:
        """Drain (NOT_SERVING, finish or abort running requests), then stop."""
        await self.health.enter_graceful_shutdown()
        drain = self.config.server.drain_seconds if drain_s is None else drain_s
        await self.worker.drain(drain)
        await self.server.stop(grace=1.0)
        await self.peers.close()
        self.receiver.close()
        self.ae.shutdown()
        log.info("decode worker stopped", extra={"address": self.address})


def main(argv: list[str] | None = None) -> int:
    return run_worker(parse_args, DecodeServer, argv)


if __name__ == "__main__":
    sys.exit(main())
