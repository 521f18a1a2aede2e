"""`python -m gateway ARGS` (also `baton gateway ARGS`); see gateway/config.py for the flags.

    main(argv) → parse_args → GatewayConfig → run_process(start, log_level)
    (baton/worker/process.py, as the workers: JSON logs, uvloop, SIGTERM/SIGINT → stop event)
      start: Gateway(config).start(); the heap built so far (transformers, torch, the
             tokenizer: millions of objects) is moved out of the garbage collector's sight
             (`gc.freeze()`), else each full collection walks it and stalls every stream
             for 0.1-1 s; prints `[gateway] serving ...` (for people), then
             run_process prints `READY port=<HTTP port>` (for launchers); a failed start
             prints `[gateway] failed to start: ...` and the process exits with status 1
      on the stop event: Gateway.stop(): /health and new requests 503 (Retry-After),
             running requests get --shutdown-grace-s; streams still running then end
             with an error event and [DONE] (gateway/drain.py); then close
"""
from __future__ import annotations

import gc
import logging
import sys

from baton.worker.process import StartFailed, run_process
from gateway.config import GatewayConfig, parse_args
from gateway.server import Gateway

logger = logging.getLogger("gateway")


class _Serving:
    """A started gateway as run_process sees it: its HTTP port, no separate metrics port
    (GET /metrics is on the HTTP port), and stop()."""

    metrics_port = None

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.port = gateway.http_port

    async def stop(self) -> None:
        """Stop the gateway (drain for --shutdown-grace-s, then close)."""
        logger.info("shutting down")
        await self.gateway.stop()


async def start(config: GatewayConfig) -> _Serving:
    """Start a gateway and say so; StartFailed (after saying why) when it cannot start."""
    gateway = Gateway(config)
    try:
        await gateway.start()
    except Exception as e:
        print(f"[gateway] failed to start: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        await gateway.stop()
        raise StartFailed from e
    freeze_heap()
    grpc_note = f", gRPC on {gateway.grpc_address}" if gateway.grpc_address else ""
    auth = "API key required" if config.api_key else "no API key"  # never the key itself
    workers = f"decode {','.join(config.decode) or '-'}; prefill {','.join(config.prefill) or '-'}"
    if config.workers_file:
        workers += f"; workers file {config.workers_file}"
    print(f"[gateway] serving {config.served_model_name} on {gateway.http_url}{grpc_note} "
          f"(routing {config.router.policy.value}; {workers}; {auth})", flush=True)
    return _Serving(gateway)


def freeze_heap() -> None:
    """Collect once, then exempt every object alive now from later collections (what lives
    from start-up lives for good); new objects are collected as usual."""
    gc.collect()
    gc.freeze()


def main(argv: list[str] | None = None) -> int:
    """`python -m gateway ARGS`; returns the exit status."""
    config = parse_args(argv)
    return run_process(lambda: start(config), config.log_level)


if __name__ == "__main__":
    sys.exit(main())
