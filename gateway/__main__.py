"""`python -m gateway ARGS` (also `baton gateway ARGS`); see gateway/config.py for the flags."""
from __future__ import annotations

import asyncio
import logging
import signal
import sys

import uvloop

from gateway.config import GatewayConfig, parse_args
from gateway.server import Gateway

logger = logging.getLogger("gateway")


async def serve(config: GatewayConfig) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    gateway = Gateway(config)
    try:
        await gateway.start()
    except Exception as e:
        print(f"[gateway] failed to start: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        await gateway.stop()
        return 1
    grpc_note = f", gRPC on {gateway.grpc_address}" if gateway.grpc_address else ""
    print(f"[gateway] serving {config.served_model_name} on {gateway.http_url}{grpc_note} "
          f"(routing {config.router.policy.value}; decode {','.join(config.decode) or '-'}; "
          f"prefill {','.join(config.prefill) or '-'})", flush=True)
    await stop.wait()
    logger.info("shutting down")
    await gateway.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    logging.basicConfig(level=config.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s [gateway] %(name)s: %(message)s")
    return uvloop.run(serve(config))


if __name__ == "__main__":
    sys.exit(main())
