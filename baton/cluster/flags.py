"""The flags of `baton up` (build_parser) and the checks made on them before anything starts:
values that cannot work (bad_flags) and fixed ports already taken (port_taken)."""
from __future__ import annotations

import argparse
import errno
import socket

from baton.cluster.plan import fixed_ports
from baton.cluster.supervise import Backoff
from baton.engine.store_client import parse_store_url


def build_parser() -> argparse.ArgumentParser:
    """The flags of `baton up`."""
    p = argparse.ArgumentParser(prog="baton up", description="Run a local Baton cluster.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="registered name or HF folder")
    p.add_argument("--port", type=int, default=8000, help="HTTP port of the gateway")
    p.add_argument("--host", default="127.0.0.1", help="HTTP host of the gateway")
    p.add_argument("--grpc-port", type=int, default=None,
                   help="port of the gateway's gRPC front (None: off)")
    p.add_argument("--num-prefill", type=int, default=1,
                   help="prefill workers (disaggregated mode)")
    p.add_argument("--num-decode", type=int, default=1, help="decode workers")
    p.add_argument("--mode", choices=["disaggregated", "colocated"], default="disaggregated",
                   help="colocated: no prefill workers, decode workers prefill locally")
    p.add_argument("--routing", choices=["session", "kv", "round-robin"], default="session",
                   help="how the gateway picks a decode worker")
    p.add_argument("--transport", choices=["nixl", "grpc"], default="nixl",
                   help="how KV blocks move from prefill to decode workers")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' at the gateway")
    p.add_argument("--dtype", default=None, help="worker dtype (default: the workers')")
    p.add_argument("--block-size", type=int, default=None,
                   help="tokens per KV block (default: the workers')")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context limit (default: the model's, within the KV pool)")
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks per worker")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                   help="KV pool bytes per worker (default: --kv-memory-fraction of the "
                        "memory free at start, less every worker's weights, split evenly)")
    p.add_argument("--kv-memory-fraction", type=float, default=0.5,
                   help="share of MemAvailable the workers' KV pools take together")
    p.add_argument("--kv-host-tier-bytes", type=int, default=None,
                   help="host-memory KV tier per worker, below its pool (default: off)")
    p.add_argument("--kv-disk-tier-dir", default=None,
                   help="disk KV tier below the host tier: each worker makes a fresh folder here")
    p.add_argument("--kv-disk-tier-bytes", type=int, default=None,
                   help="disk KV tier budget per worker (with --kv-disk-tier-dir)")
    p.add_argument("--slo-ttft-ms", type=float, default=None,
                   help="gateway: answer 429 + Retry-After to a request whose predicted "
                        "TTFT exceeds this (default: no admission control)")
    p.add_argument("--prefill-max-seconds", type=float, default=None,
                   help="decode: cap of one remote prefill, and so of how long blocks an "
                        "unconfirmed transfer may still write stay held (default: decode's)")
    p.add_argument("--min-remote-tokens", type=int, default=None,
                   help="decode: fixed P/D threshold, shortest uncached suffix prefilled "
                        "remotely (default: the cost-based decider)")
    p.add_argument("--kv-store", choices=["none", "mooncake"], default="none",
                   help="mooncake: start a local mooncake_master and point every worker at it "
                        "(finished turns' KV blocks are loaded by the next prefill anywhere)")
    p.add_argument("--kv-store-url", default=None,
                   help="an existing store's master, mooncake://HOST:PORT (instead of a local one)")
    p.add_argument("--kv-store-segment-bytes", type=int, default=None,
                   help="memory each worker lends the KV store")
    p.add_argument("--speculative-method", choices=["suffix", "ngram", "none"], default=None,
                   help="workers' speculative decoding (default: the workers', off)")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="workers' most drafted tokens a decode row (default: the workers')")
    p.add_argument("--spec-benchmark-synthetic-acceptance", default=None, metavar="RATES",
                   help="BENCHMARK ONLY (outputs are not the model's): the workers' forced "
                        "draft acceptance per position (see baton serve-decode --help)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--pin", choices=["none", "split", "share"], default="none",
                   help="split: pin prefill and decode workers to disjoint CPU sets; share: "
                        "unpinned, each worker steps with the cores the others leave idle "
                        "(all of them alone, an even share when several are busy)")
    p.add_argument("--log-level", default="WARNING", help="workers' and gateway's log level")
    p.add_argument("--log-dir", default=None, help="one log file per process (default: temp)")
    p.add_argument("--startup-timeout", type=float, default=600.0,
                   help="seconds every child may take to become ready (at start, and after "
                        "each restart: a restarted child with no READY by then is killed)")
    _add_restart_args(p)
    return p


def _add_restart_args(p: argparse.ArgumentParser) -> None:
    """What happens when a child dies, and how long stopping may take."""
    p.add_argument("--exit-on-child-failure", action="store_true",
                   help="stop the cluster when a child dies (CI) instead of restarting it")
    p.add_argument("--restart-delay-s", type=float, default=1.0,
                   help="first restart delay; doubles per death in a row")
    p.add_argument("--restart-max-delay-s", type=float, default=30.0,
                   help="cap of the restart delay")
    p.add_argument("--restart-reset-s", type=float, default=60.0,
                   help="a child up this long starts its next backoff from the first delay")
    p.add_argument("--shutdown-grace-s", type=float, default=30.0,
                   help="on Ctrl-C: seconds the gateway lets running streams finish")
    p.add_argument("--stop-timeout", type=float, default=15.0,
                   help="seconds a child may take to stop (the gateway: after its grace)")


def port_taken(a: argparse.Namespace) -> str | None:
    """The one-line error for the first fixed port already in use, or None when all are free.
    Binds each one as the gateway will (SO_REUSEADDR, so a TIME_WAIT leftover is no conflict)."""
    for p in fixed_ports(a):
        family = socket.AF_INET6 if ":" in p.host else socket.AF_INET
        try:
            socket.create_server((p.host, p.port), family=family).close()
        except OSError as e:
            why = "is in use" if e.errno == errno.EADDRINUSE else f"cannot be bound ({e.strerror})"
            return f"port {p.port} on {p.host} {why} ({p.what}); choose another with {p.flag}"
    return None


def backoff(a: argparse.Namespace) -> Backoff:
    """The restart policy the --restart-* flags give (ValueError when they cannot work)."""
    return Backoff(a.restart_delay_s, a.restart_max_delay_s, a.restart_reset_s)


def bad_flags(a: argparse.Namespace) -> str | None:
    """What is wrong with the flags (one line), or None."""
    if a.num_decode < 1 or (a.mode == "disaggregated" and a.num_prefill < 1):
        return "need --num-decode >= 1 (and --num-prefill >= 1 when disaggregated)"
    if a.shutdown_grace_s < 0:
        return "--shutdown-grace-s must be >= 0"
    if not 0 < a.kv_memory_fraction <= 1:
        return "--kv-memory-fraction must be in (0, 1]"
    try:
        backoff(a)
    except ValueError as e:
        return f"--restart-delay-s / --restart-max-delay-s / --restart-reset-s: {e}"
    if a.kv_store_url is not None:
        try:
            parse_store_url(a.kv_store_url)
        except ValueError as e:
            return f"--kv-store-url: {e}"
    return None
