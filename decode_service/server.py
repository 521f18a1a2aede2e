"""The decode worker process: build everything from one config, serve, drain on SIGTERM.

    main(argv) → parse_args → DecodeConfig → run_worker(parse_args, Server, argv): uvloop, serve until SIGTERM, drain
    serve: DecodeServer.start() → start_worker (baton/worker/start.py) with the decode parts:
      1. the engine (model, dtype, KV pool) and its thread (AsyncEngine); the grpc.aio server
         and health service (start_worker)
      2. here: the KV receiver over the engine's kv_cache (--transport nixl | grpc; the gRPC
         receiver is a KVTransfer servicer on this same server), metrics, the prefill peers,
         the DecodeWorker and DecodeService
      3. serve (SERVING: the model is loaded), metrics HTTP (--metrics-port), then print
         `READY port=N` for launchers
    SIGTERM/SIGINT → health NOT_SERVING, refuse new requests, let running ones finish
    (--drain-seconds), abort the rest (clients get Finished{ABORT}), stop.
"""
from __future__ import annotations

import sys

from baton.engine.remote_kv import RemoteKV
from baton.transfer import make_receiver
from baton.worker.process import run_worker
from baton.worker.start import RoleParts, WorkerRuntime, WorkerServer
from decode_service.config import parse_args
from decode_service.metrics import DecodeMetrics
from decode_service.peers import PrefillPeers
from decode_service.servicer import DecodeServicer
from decode_service.worker import DecodeWorker
from protos import decode_pb2, decode_pb2_grpc

SERVICE_NAME = decode_pb2.DESCRIPTOR.services_by_name["DecodeService"].full_name


class DecodeServer(WorkerServer):
    """One decode worker. `await start()` binds and serves; `await stop()` drains and ends.

    Tests run it in-process (port 0): `port`, `address`, `engine` (the LLMEngine), `worker`,
    `receiver`, `peers` and `metrics` are there to look at (the shared ones once start()
    returned; `runtime` holds the rest of the skeleton).
    """

    role = "decode"
    service_name = SERVICE_NAME

    def add_role(self, rt: WorkerRuntime) -> RoleParts:
        """The role's parts (module docstring, step 2), kept on self for tests."""
        cfg = self.config
        self.engine, self.ae, self.layout = rt.engine, rt.ae, rt.layout
        self.receiver = make_receiver(cfg.transport, rt.engine.kv_cache, rt.layout)
        if cfg.transport == "grpc":
            self.receiver.add_to_server(rt.server)
            self.receiver.set_address(rt.address)
        self.metrics = DecodeMetrics(rt.layout.model)
        self.metrics.watch(rt.engine)
        self.peers = PrefillPeers(rt.layout, cfg.transport, rt.address,
                                  cfg.handshake_timeout_seconds, cfg.abort_timeout_seconds)
        self.remote_kv = RemoteKV(rt.engine)
        self.worker = DecodeWorker(cfg, rt.ae, self.remote_kv, self.receiver, self.peers,
                                   self.metrics)
        self.servicer = DecodeServicer(self.worker, rt.layout, rt.address)
        decode_pb2_grpc.add_DecodeServiceServicer_to_server(self.servicer, rt.server)
        return RoleParts(self.metrics.registry, self.worker.drain, self._close,
                         self.servicer.stats)

    async def _close(self) -> None:
        await self.peers.close()
        self.receiver.close()


def main(argv: list[str] | None = None) -> int:
    """`python -m decode_service ARGS`; returns the exit status."""
    return run_worker(parse_args, DecodeServer, argv)


if __name__ == "__main__":
    sys.exit(main())
