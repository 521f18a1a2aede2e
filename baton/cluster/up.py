"""`baton up`: a local Baton cluster — N prefill + M decode workers and a gateway — as processes.

    baton up [--model smollm2-135m] [--port 8000] [--num-prefill 1] [--num-decode 1]
             [--mode disaggregated|colocated] [--routing session|kv|round-robin]
             [--transport nixl|grpc] [--pin none|split]

1. resolve the model once here (a registered model is converted on first use, not by every
   worker at once);
2. start every worker as `python -m prefill_service|decode_service --port 0` (its own process
   group, one torch thread, killed with this process if it dies: child.py; flags and CPU
   sets: plan.py) and wait for each one's `READY port=N` line; colocated mode starts decode
   workers only (every prefill local);
3. start `python -m gateway` with the workers' addresses, wait for its READY line, then
   until GET /health is 200 and reports every worker healthy;
4. print the URL and a curl line; serve until Ctrl-C / SIGTERM or until a child dies;
5. stop the gateway (it answers 503 to new requests and lets running streams finish for
   --shutdown-grace-s), then decode, then prefill workers (SIGTERM, then SIGKILL after
   --stop-timeout).
Before anything starts, every fixed port it will bind (the gateway's --port, --grpc-port)
is checked free; a taken one fails at once with one line naming the port and its flag.
A child that dies during start-up ends `baton up` with status 1 and the tail of its log.
`--pin split` pins workers to disjoint CPU sets (sched_setaffinity before exec), so one role
cannot steal another's cores: disaggregated = prefill workers on the upper half of the CPUs
this process may use, decode workers on the lower half; colocated = the CPUs dealt out over the
workers in turn. The gateway stays unpinned. `--pin none` (default) leaves placement to the OS.
Logs: one file per child in --log-dir (a temporary folder unless given).
"""
from __future__ import annotations

import argparse
import errno
import json
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from baton.cluster.child import Child
from baton.cluster.plan import (
    child_env,
    cpu_plan,
    decode_args,
    fixed_ports,
    gateway_args,
    prefill_args,
)
from baton.roles import ROLE_MODULES


class StartupError(RuntimeError):
    """A child died, or did not get ready or healthy in time, during start-up."""


class Interrupted(Exception):
    """Ctrl-C / SIGTERM arrived."""


def build_parser() -> argparse.ArgumentParser:
    """The flags of `baton up`."""
    p = argparse.ArgumentParser(prog="baton up", description="Run a local Baton cluster.")
    p.add_argument("--model", default="smollm2-135m", help="registered name or HF folder")
    p.add_argument("--port", type=int, default=8000, help="HTTP port of the gateway")
    p.add_argument("--host", default="127.0.0.1", help="HTTP host of the gateway")
    p.add_argument("--grpc-port", type=int, default=None, help="gateway gRPC front (off)")
    p.add_argument("--num-prefill", type=int, default=1)
    p.add_argument("--num-decode", type=int, default=1)
    p.add_argument("--mode", choices=["disaggregated", "colocated"], default="disaggregated")
    p.add_argument("--routing", choices=["session", "kv", "round-robin"], default="session")
    p.add_argument("--transport", choices=["nixl", "grpc"], default="nixl")
    p.add_argument("--api-key", default=None)
    p.add_argument("--dtype", default=None, help="worker dtype (default: the workers')")
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks per worker")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    p.add_argument("--min-remote-tokens", type=int, default=None,
                   help="decode: shortest uncached suffix prefilled remotely")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--pin", choices=["none", "split"], default="none",
                   help="split: pin prefill and decode workers to disjoint CPU sets")
    p.add_argument("--log-level", default="WARNING", help="workers' and gateway's log level")
    p.add_argument("--log-dir", default=None, help="one log file per process (default: temp)")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--shutdown-grace-s", type=float, default=30.0,
                   help="on Ctrl-C: seconds the gateway lets running streams finish")
    p.add_argument("--stop-timeout", type=float, default=15.0,
                   help="seconds a child may take to stop (the gateway: after its grace)")
    return p


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


def _health(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return json.loads(r.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None


class Cluster:
    """The supervisor: starts the children in order, watches them, stops them in order."""

    def __init__(self, a: argparse.Namespace, log_dir: Path) -> None:
        self.a = a
        self.log_dir = log_dir
        self.env = child_env(a.threads)
        self.prefill: list[Child] = []
        self.decode: list[Child] = []
        self.gateway: Child | None = None
        self.stop_signal: int | None = None
        self.cpus: dict[str, frozenset[int] | None] = {}

    def request_stop(self, sig: int, _frame=None) -> None:
        """Signal handler: the main loop (or start-up) stops at its next check."""
        self.stop_signal = sig

    @property
    def children(self) -> list[Child]:
        """Started children, in stop order (gateway, decode, prefill)."""
        return [c for c in [self.gateway, *self.decode, *self.prefill] if c is not None]

    def _child(self, name: str, role: str, args: list[str],
               cpus: frozenset[int] | None = None) -> Child:
        argv = [sys.executable, "-m", ROLE_MODULES[role], *args]
        child = Child(name, argv, self.log_dir / f"{name}.log", cpus)
        child.start(self.env)
        return child

    def start(self) -> None:
        """Start the workers, wait for their READY lines, then the gateway until healthy."""
        a = self.a
        self.cpus = cpu_plan(a.pin, a.mode, a.num_prefill, a.num_decode)
        if a.mode == "disaggregated":
            self.prefill = [self._child(f"prefill-{i}", "prefill", prefill_args(a),
                                        self.cpus[f"prefill-{i}"])
                            for i in range(a.num_prefill)]
        self.decode = [self._child(f"decode-{i}", "decode", decode_args(a),
                                   self.cpus[f"decode-{i}"])
                       for i in range(a.num_decode)]
        deadline = time.monotonic() + a.startup_timeout
        self._wait_ready(self.prefill + self.decode, deadline)
        self.gateway = self._child("gateway", "gateway", gateway_args(
            a, [c.address for c in self.decode], [c.address for c in self.prefill]))
        self._wait_ready([self.gateway], deadline)
        self._wait_healthy(deadline)

    def _wait_ready(self, children: list[Child], deadline: float) -> None:
        for child in children:
            while not child.ready.wait(0.1):
                self._check_alive(children)
                if time.monotonic() > deadline:
                    raise StartupError(f"{child.name} not ready after "
                                       f"{self.a.startup_timeout:g} s")

    def _wait_healthy(self, deadline: float) -> None:
        host = "127.0.0.1" if self.a.host in ("0.0.0.0", "::") else self.a.host
        url = f"http://{host}:{self.a.port}/health"
        want = {"decode": len(self.decode), "prefill": len(self.prefill)}
        while True:
            body = _health(url)
            if body and all(body["workers"][r]["healthy"] == n for r, n in want.items()):
                return
            self._check_alive(self.children)
            if time.monotonic() > deadline:
                raise StartupError(f"{url} did not report every worker healthy within "
                                   f"{self.a.startup_timeout:g} s (last answer: {body})")
            time.sleep(0.2)

    def _check_alive(self, children: list[Child]) -> None:
        if self.stop_signal is not None:
            raise Interrupted()
        for child in children:
            code = child.exited()
            if code is not None:
                raise StartupError(f"{child.name} exited with status {code} during start-up; "
                                   f"the end of {child.log_path}:\n{child.log_tail()}")

    def dead_child(self) -> Child | None:
        """A child that has exited, if any."""
        return next((c for c in self.children if c.exited() is not None), None)

    def stop(self) -> None:
        """Gateway first (no new requests), then decode, then prefill workers."""
        for group in ([self.gateway] if self.gateway else [], self.decode, self.prefill):
            running = [c for c in group if c.exited() is None]
            for c in running:
                c.proc.send_signal(signal.SIGTERM)
            grace = self.a.shutdown_grace_s if group and group[0] is self.gateway else 0.0
            end = time.monotonic() + grace + self.a.stop_timeout
            for c in running:
                try:
                    c.proc.wait(max(0.1, end - time.monotonic()))
                except subprocess.TimeoutExpired:
                    print(f"[baton up] {c.name} did not stop in "
                          f"{grace + self.a.stop_timeout:g} s; killing it", file=sys.stderr)
                    c.proc.kill()
                    c.proc.wait()


def _banner(a: argparse.Namespace, cluster: Cluster) -> str:
    host = "127.0.0.1" if a.host in ("0.0.0.0", "::") else a.host
    url = f"http://{host}:{a.port}"
    body = json.dumps({"model": a.model, "messages": [{"role": "user", "content": "Hello!"}],
                       "max_tokens": 32})
    auth = f" -H {shlex.quote('Authorization: Bearer ' + a.api_key)}" if a.api_key else ""
    roles = (f"{len(cluster.prefill)} prefill + " if cluster.prefill else "colocated: ") + \
        f"{len(cluster.decode)} decode worker(s), routing {a.routing}, transport {a.transport}"
    pins = {n: sorted(c) for n, c in cluster.cpus.items() if c}
    if pins:
        roles += ", CPUs " + " ".join(f"{n}={','.join(map(str, c))}" for n, c in pins.items())
    return (f"[baton up] ready: {url}  ({roles})\n"
            f"[baton up] OpenAI base URL: {url}/v1   logs: {cluster.log_dir}\n"
            f"[baton up] try:\n"
            f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} "
            f"-d {shlex.quote(body)}\n"
            f"[baton up] Ctrl-C to stop.")


def main(argv: list[str] | None = None) -> int:
    """`baton up ARGS`; returns the exit status (see the module docstring)."""
    a = build_parser().parse_args(argv)
    if a.num_decode < 1 or (a.mode == "disaggregated" and a.num_prefill < 1):
        print("baton up: need --num-decode >= 1 (and --num-prefill >= 1 when disaggregated)",
              file=sys.stderr)
        return 2
    if (taken := port_taken(a)) is not None:
        print(f"baton up: {taken}", file=sys.stderr)
        return 1
    try:
        from baton.models.registry import resolve_model
        resolve_model(a.model)  # convert once here, before the workers race to it
    except ValueError as e:
        print(f"baton up: {e}", file=sys.stderr)
        return 1
    log_dir = Path(a.log_dir or tempfile.mkdtemp(prefix="baton-up-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(a, log_dir)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, cluster.request_stop)
    try:
        print(f"[baton up] starting {a.model} ({a.mode}); logs in {log_dir}", flush=True)
        cluster.start()
        print(_banner(a, cluster), flush=True)
        while cluster.stop_signal is None:
            dead = cluster.dead_child()
            if dead is not None:
                print(f"[baton up] {dead.name} exited with status {dead.exited()}; stopping. "
                      f"The end of {dead.log_path}:\n{dead.log_tail()}", file=sys.stderr)
                return 1
            time.sleep(0.2)
        print("[baton up] stopping...", flush=True)
        return 0
    except Interrupted:
        print("[baton up] interrupted during start-up; stopping...", flush=True)
        return 130
    except StartupError as e:
        print(f"[baton up] start-up failed: {e}", file=sys.stderr)
        return 1
    finally:
        cluster.stop()
        print("[baton up] stopped", flush=True)
