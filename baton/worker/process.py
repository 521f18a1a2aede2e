"""How every serving process (prefill, decode, gateway) runs: structured logs, shutdown
signals and the readiness line launchers wait for. Light on purpose (no engine, no torch):
the gateway starts through it too.

A role's `main(argv)` does, in order:
    config = its parse_args(argv)                    (a frozen config)
    run_process(start, log_level)                    → configure_logging(log_level)
      uvloop.run(serve_until_signalled(start)):
        SIGTERM/SIGINT → a stop event (install_stop_signals)
        serving = await start()                      (raises StartFailed: exit status 1)
        announce(Ready(serving.port, serving.metrics_port))   → `READY port=N [metrics_port=M]`
        wait for the stop event; await serving.stop() (drain) in any case
Workers go through `run_worker(parse_args, server_cls, argv)`; a launcher reads the line
back with `parse_ready` (baton/cluster/child.py).
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import grpc

# Request ids travel in logs and key engine state: keep them short.
MAX_REQUEST_ID_LEN = 256


class Rejected(Exception):
    """A request refused with a specific gRPC status (ValueError means INVALID_ARGUMENT)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


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
    """JSON log lines (JsonFormatter) on stderr at `level`, for the whole process."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


# ---- the readiness line: writer and parser side by side ----------------------------------
@dataclass(frozen=True)
class Ready:
    """What a serving process announces once it serves: its port (gRPC for a worker, HTTP
    for the gateway) and its Prometheus port when it has one."""

    port: int
    metrics_port: int | None = None

    def line(self) -> str:
        """`READY port=N` or `READY port=N metrics_port=M` (parse_ready reads it back)."""
        extra = f" metrics_port={self.metrics_port}" if self.metrics_port is not None else ""
        return f"READY port={self.port}{extra}"


_READY = re.compile(r"READY port=(\d+)(?: metrics_port=(\d+))?$")


def parse_ready(line: str) -> Ready | None:
    """The Ready a stdout line announces, or None when it is some other line."""
    match = _READY.match(line.strip())
    if match is None:
        return None
    metrics = match.group(2)
    return Ready(int(match.group(1)), None if metrics is None else int(metrics))


def announce(ready: Ready) -> None:
    """Print the line launchers wait for (stdout, flushed)."""
    print(ready.line(), flush=True)


# ---- serving until signalled ---------------------------------------------------------------
class Serving(Protocol):
    """What a role's start() returns: the ports to announce and how to stop (drain)."""

    port: int
    metrics_port: int | None

    async def stop(self) -> None:
        """Drain and stop (called once, after the stop event or a failure)."""


class StartFailed(Exception):
    """Raised by a role's start() after it said why on stderr: the process exits with 1."""


def install_stop_signals(stop: asyncio.Event) -> None:
    """SIGTERM / SIGINT set `stop` (the serve loop then drains and exits)."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)


async def serve_until_signalled(start: Callable[[], Awaitable[Serving]]) -> int:
    """Start a role, print READY, serve until SIGTERM/SIGINT, then stop it (drain) in any
    case; returns the exit status (1 when start() raised StartFailed)."""
    stop = asyncio.Event()
    install_stop_signals(stop)
    try:
        serving = await start()
    except StartFailed:
        return 1
    announce(Ready(serving.port, serving.metrics_port))
    try:
        await stop.wait()
    finally:
        await serving.stop()
    return 0


def run_process(start: Callable[[], Awaitable[Serving]], log_level: str) -> int:
    """Process entry of any role: JSON logs at `log_level`, then serve_until_signalled on
    uvloop; returns the exit status."""
    import uvloop

    configure_logging(log_level)
    return uvloop.run(serve_until_signalled(start))


def run_worker(parse_args, server_cls, argv: list[str] | None) -> int:
    """Process entry of a worker role: parse flags into its frozen config and run
    `server_cls(config).start()` through run_process."""
    config = parse_args(argv)
    return run_process(lambda: server_cls(config).start(), config.server.log_level)
