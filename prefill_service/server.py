"""The prefill worker process: build everything from one config, serve, drain on SIGTERM.

    main(argv) → parse_args → PrefillConfig → run_worker(parse_args, Server, argv): uvloop, serve until SIGTERM, drain
    serve: PrefillServer.start() → start_worker (baton/worker/start.py) with the prefill parts:
      1. the engine (model, dtype, KV pool) and its thread (AsyncEngine); the grpc.aio server
         and health service (start_worker)
      2. here: the KV sender over the engine's kv_cache (--transport nixl | grpc), metrics,
         per-chunk sends (--kv-send-per-chunk, on by default: NIXL and gRPC stream each
         step's blocks), the PrefillWorker (its lease reaper started)
         and PrefillService
      3. serve (SERVING now that the model is loaded), metrics HTTP (--metrics-port), then
         print `READY port=N` for launchers
    SIGTERM/SIGINT → health NOT_SERVING, refuse new prefills, let in-flight ones finish
    (--drain-seconds), release held blocks, stop the server and the engine.
"""
from __future__ import annotations

import logging
import sys

from baton.engine.block_holds import BlockHolds
from baton.transfer import make_sender
from baton.worker.process import run_worker
from baton.worker.start import RoleParts, WorkerRuntime, WorkerServer
from prefill_service.config import parse_args
from prefill_service.kv_stream import KVStreams
from prefill_service.metrics import PrefillMetrics
from prefill_service.servicer import PrefillServicer
from prefill_service.worker import PrefillWorker
from protos import prefill_pb2, prefill_pb2_grpc

log = logging.getLogger(__name__)
SERVICE_NAME = prefill_pb2.DESCRIPTOR.services_by_name["PrefillService"].full_name


class PrefillServer(WorkerServer):
    """One prefill worker. `await start()` binds and serves; `await stop()` drains and ends.

    Tests run it in-process (port 0): `port`, `address`, `engine` (the LLMEngine), `worker`,
    `sender`, `servicer` and `metrics` are there to look at (the shared ones once start()
    returned; `runtime` holds the rest of the skeleton).
    """

    role = "prefill"
    service_name = SERVICE_NAME

    def add_role(self, rt: WorkerRuntime) -> RoleParts:
        """The role's parts (module docstring, step 2), kept on self for tests."""
        cfg = self.config
        self.engine, self.ae, self.layout = rt.engine, rt.ae, rt.layout
        self.sender = make_sender(cfg.transport, rt.engine.kv_cache, rt.layout)
        self.metrics = PrefillMetrics(rt.layout.model)
        self.holds = BlockHolds(rt.engine)
        self.streams = self._streams()
        self.worker = PrefillWorker(cfg, rt.ae, self.holds, self.sender, self.metrics,
                                    self.streams)
        self.metrics.watch(rt.engine, self.worker.entries)
        self.servicer = PrefillServicer(self.worker, rt.layout, cfg.transport, rt.address)
        prefill_pb2_grpc.add_PrefillServiceServicer_to_server(self.servicer, rt.server)
        self.worker.start()  # the lease reaper; nothing is leased before the server serves
        return RoleParts(self.metrics.registry, self.worker.drain, self._close,
                         self.servicer.stats)

    def _streams(self) -> KVStreams | None:
        """Per-chunk sends when asked for and the transport can stream them."""
        if not self.config.kv_send_per_chunk:
            return None
        if not self.sender.streams:
            log.info("--kv-send-per-chunk: the %s transport sends whole transfers only; "
                     "KV is sent once, after each prefill", self.config.transport)
            return None
        streams = KVStreams(self.holds, self.sender, self.config.engine.cache.block_size)
        self.ae.after_step = streams.after_step
        return streams

    async def _close(self) -> None:
        self.sender.close()


def main(argv: list[str] | None = None) -> int:
    """`python -m prefill_service ARGS`; returns the exit status."""
    return run_worker(parse_args, PrefillServer, argv)


if __name__ == "__main__":
    sys.exit(main())
