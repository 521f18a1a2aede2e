"""A health probe for containers: exit 0 when a Baton process is serving, 1 otherwise.

    python -m baton.worker.healthcheck HOST:PORT [--service NAME]   gRPC worker (grpc.health.v1 Check)
    python -m baton.worker.healthcheck --http URL                   gateway (GET URL answers 200)

Docker Compose `healthcheck:` runs it inside the container; Kubernetes uses its own native
`grpc:` / `httpGet:` probes instead. It imports only grpcio and the standard library, so a
check costs well under a second (never torch).
"""
from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request


def check_grpc(address: str, service: str, timeout: float) -> tuple[bool, str]:
    """grpc.health.v1 Check(service) on `address`: (serving, what was seen)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as e:
            return False, f"{e.code().name}: {e.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, status


def check_http(url: str, timeout: float) -> tuple[bool, str]:
    """GET `url`: (answered 200, status line or error)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return reply.status == 200, f"HTTP {reply.status}"
    except urllib.error.HTTPError as e:
        return False, f"HTTP {e.code}"
    except (urllib.error.URLError, OSError) as e:
        return False, f"{type(e).__name__}: {e}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m baton.worker.healthcheck", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("address", nargs="?", help="gRPC worker HOST:PORT")
    p.add_argument("--service", default="", help="health service name ('' = the server)")
    p.add_argument("--http", metavar="URL", help="check an HTTP endpoint instead")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds (default 3)")
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args(argv)
    if (a.address is None) == (a.http is None):
        p.error("give a gRPC HOST:PORT or --http URL (one of them)")
    ok, seen = check_http(a.http, a.timeout) if a.http else \
        check_grpc(a.address, a.service, a.timeout)
    if not a.quiet:
        print(f"{a.http or a.address}: {seen}", file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
