"""`baton up`: a local Baton cluster — N prefill + M decode workers and a gateway — as processes.

    baton up [--model smollm2-135m] [--port 8000] [--num-prefill 1] [--num-decode 1]
             [--mode disaggregated|colocated] [--routing session|kv|round-robin]
             [--transport nixl|grpc] [--pin none|split] [--shutdown-grace-s 30]
             [--exit-on-child-failure] [--restart-delay-s 1] [--restart-max-delay-s 30]

1. resolve the model once here (a registered model is converted on first use, not by every
   worker at once);
1b. with --kv-store mooncake (and no --kv-store-url), start a local mooncake_master on a
   free port (kv_master.py; killed with this process) and give every worker its URL
   (--kv-store-url); one that dies is restarted on its port like any child (the workers
   serve without the store meanwhile, then reconnect: store_client.py);
2. start every worker as `python -m prefill_service|decode_service --port 0` (its own process
   group, one torch thread, killed with this process if it dies: child.py; flags and CPU
   sets: plan.py) and wait for each one's `READY port=N` line; colocated mode starts decode
   workers only (every prefill local);
3. start `python -m gateway` beside the workers (its imports and tokenizer load overlap
   theirs) with `--workers-file LOG_DIR/workers-PID.json`, written with the workers' addresses
   once each printed READY (the gateway re-reads it within 0.2 s of a change); wait for its
   READY line, then until GET /health is 200 and reports every worker healthy;
4. print the URL and a curl line (with --api-key it reads the key from `$BATON_API_KEY`:
   the key is never printed, and the gateway gets it in its environment, not its command
   line, which `ps` shows); serve until Ctrl-C / SIGTERM. A child that dies is
   restarted on the port it had, with backoff (--restart-delay-s, doubling per death in a
   row up to --restart-max-delay-s, reset after --restart-reset-s up), and the cluster
   serves on meanwhile (supervise.py); `--exit-on-child-failure` (CI) stops it instead,
   with status 1 and the tail of the child's log;
5. stop the gateway (it answers 503 to new requests and lets running streams finish for
   --shutdown-grace-s), then decode, then prefill workers (SIGTERM, then SIGKILL after
   --stop-timeout).
Before anything starts, every fixed port it will bind (the gateway's --port, --grpc-port)
is checked free; a taken one fails at once with one line naming the port and its flag.
A child that dies during start-up ends `baton up` with status 1 and the tail of its log.
`--pin split` pins workers to disjoint CPU sets (sched_setaffinity before exec), so one role
cannot steal another's cores: disaggregated = prefill workers on the upper half of the CPUs
this process may use, decode workers on the lower half; colocated = the CPUs dealt out over the
workers in turn. The gateway stays unpinned. `--pin none` leaves placement to the OS.
`--pin share` (the default) leaves the workers unpinned and gives each a slot of one shared
file in the log folder: per step a worker takes the cores the others leave idle
(baton/worker/cpu_share.py).
Logs: one file per child in --log-dir (a temporary folder unless given).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from baton.cluster.child import Child
from baton.cluster.devices import device_flags
from baton.cluster.flags import backoff, bad_flags, parse_up_args, port_taken
from baton.cluster.kv_master import restart_master, start_master, stop_master
from baton.cluster.plan import (
    child_env,
    cpu_plan,
    cpu_share_plan,
    decode_args,
    gateway_args,
    gateway_env,
    host_tier_bytes_per_worker,
    kv_bytes_per_worker,
    prefill_args,
    set_role_flag,
    write_workers_file,
)
from baton.cluster.supervise import Supervisor, describe_exit
from baton.dtypes import resolve_dtype
from baton.engine.kv_budget import read_mem_available
from baton.gateway_config import default_served_name
from baton.roles import API_KEY_ENV, ROLE_MODULES


class StartupError(RuntimeError):
    """A child died, or did not get ready or healthy in time, during start-up."""


class Interrupted(Exception):
    """Ctrl-C / SIGTERM arrived."""


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
        self.kv_master: Child | None = None
        self.stop_signal: int | None = None
        self.cpus: dict[str, frozenset[int] | None] = {}
        self.share: dict[str, list[str]] = {}  # worker name -> its --cpu-share, --device
        self.roles: dict[str, str] = {}  # child name -> role
        # the gateway's --workers-file, one per run: two clusters given the same --log-dir
        # never read each other's workers
        self.workers_file = log_dir / f"workers-{os.getpid()}.json"

    def request_stop(self, sig: int, _frame=None) -> None:
        """Signal handler: the main loop (or start-up) stops at its next check."""
        self.stop_signal = sig

    @property
    def children(self) -> list[Child]:
        """Started children, in stop order (gateway, decode, prefill, the KV store master)."""
        return [c for c in [self.gateway, *self.decode, *self.prefill, self.kv_master]
                if c is not None]

    def _env(self, role: str) -> dict[str, str]:
        """A child's environment: the gateway's holds the API key (plan.gateway_env)."""
        return gateway_env(self.env, self.a.api_key) if role == "gateway" else self.env

    def _child(self, name: str, role: str, args: list[str],
               cpus: frozenset[int] | None = None) -> Child:
        argv = [sys.executable, "-m", ROLE_MODULES[role], *args, *self.share.get(name, [])]
        child = Child(name, argv, self.log_dir / f"{name}.log", cpus)
        child.start(self._env(role))
        self.roles[name] = role
        return child

    def restart(self, old: Child) -> Child:
        """Start a dead child again with its flags, on the port it had (a worker) or its
        fixed ports (the gateway, the KV store master), so nobody needs its new address;
        same log file."""
        if old is self.kv_master:
            self.kv_master = restart_master(old, self.env)
            return self.kv_master
        role = self.roles[old.name]
        if role == "gateway":  # its addresses again, should anything have removed the file
            self._write_workers()
        argv = old.argv if role == "gateway" else [
            sys.executable, "-m", ROLE_MODULES[role],
            *(prefill_args if role == "prefill" else decode_args)(self.a, old.port),
            *self.share.get(old.name, [])]
        new = Child(old.name, argv, old.log_path, old.cpus, port=old.port)
        new.start(self._env(role))
        self.prefill = [new if c is old else c for c in self.prefill]
        self.decode = [new if c is old else c for c in self.decode]
        if self.gateway is old:
            self.gateway = new
        return new

    def _write_workers(self) -> None:
        """The workers' addresses into the gateway's workers file (they keep their ports)."""
        write_workers_file(self.workers_file, [c.address for c in self.decode],
                           [c.address for c in self.prefill])

    def start(self) -> None:
        """Start the workers and the gateway; once the workers printed READY, hand the
        gateway their addresses (the workers file) and wait until it reports them healthy."""
        a = self.a
        self.cpus = cpu_plan(a.pin, a.mode, a.num_prefill, a.num_decode)
        share = cpu_share_plan(a.pin, self.log_dir, list(self.cpus))
        try:
            placed = device_flags(a, list(self.cpus))
        except ValueError as e:
            raise StartupError(str(e)) from None
        self.share = {n: share[n] + placed[n] for n in self.cpus}
        if a.kv_store == "mooncake" and a.kv_store_url is None:
            try:
                self.kv_master, url = start_master(self.log_dir / "kv-store.log", self.env)
            except RuntimeError as e:
                raise StartupError(str(e)) from None
            set_role_flag(a, "kv_store_url", url)
        if a.mode == "disaggregated":
            self.prefill = [self._child(f"prefill-{i}", "prefill", prefill_args(a),
                                        self.cpus[f"prefill-{i}"])
                            for i in range(a.num_prefill)]
        self.decode = [self._child(f"decode-{i}", "decode", decode_args(a),
                                   self.cpus[f"decode-{i}"])
                       for i in range(a.num_decode)]
        deadline = time.monotonic() + a.startup_timeout
        # the gateway starts beside the workers (its start, seconds of imports and the
        # tokenizer, overlaps theirs) and learns their addresses from the file once they
        # are up; a gateway restarted later reads the same file
        write_workers_file(self.workers_file, [], [])
        self.gateway = self._child("gateway", "gateway", gateway_args(a, self.workers_file))
        self._wait_ready(self.prefill + self.decode, deadline)
        self._write_workers()
        self._wait_ready([self.gateway], deadline)
        self._wait_healthy(deadline)

    def _wait_ready(self, children: list[Child], deadline: float) -> None:
        for child in children:
            while not child.ready.wait(0.1):
                self._check_alive(self.children)
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
        if self.kv_master is not None:
            stop_master(self.kv_master, self.a.stop_timeout)


def _banner(a: argparse.Namespace, cluster: Cluster) -> str:
    host = "127.0.0.1" if a.host in ("0.0.0.0", "::") else a.host
    url = f"http://{host}:{a.port}"
    model = a.served_model_name or default_served_name(a.model)
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello!"}],
                       "max_tokens": 32})
    # the key itself is never printed: the line reads it from the user's own environment
    keyed = a.api_key or cluster.env.get(API_KEY_ENV)  # the flag, or inherited by the gateway
    auth = f' -H "Authorization: Bearer ${API_KEY_ENV}"' if keyed else ""
    dtype = resolve_dtype(a.dtype or "auto", a.device or "cpu")
    roles = (f"{len(cluster.prefill)} prefill + " if cluster.prefill else "colocated: ") + \
        f"{len(cluster.decode)} decode worker(s), {dtype}" + \
        (" (--dtype auto)" if a.dtype in (None, "auto") else "") + \
        (f" on {a.device}" if (a.device or "cpu") != "cpu" else "") + \
        f", routing {a.routing}" + (f", transport {a.transport}" if cluster.prefill else "") + \
        f", pin {a.pin}"
    if a.kv_store_url:
        roles += f", KV store {a.kv_store_url}"
    pins = {n: sorted(c) for n, c in cluster.cpus.items() if c}
    if pins:
        roles += ", CPUs " + " ".join(f"{n}={','.join(map(str, c))}" for n, c in pins.items())
    return (f"[baton up] ready: {url}  ({roles})\n"
            f"[baton up] OpenAI base URL: {url}/v1   logs: {cluster.log_dir}\n"
            f"[baton up] try:\n"
            f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} "
            f"-d {shlex.quote(body)}\n"
            f"[baton up] Ctrl-C to stop.")


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _serve(a: argparse.Namespace, cluster: Cluster) -> int:
    """Serve until Ctrl-C / SIGTERM (0), restarting dead children (supervise.py); with
    --exit-on-child-failure the first death ends it instead (1)."""
    supervisor = Supervisor(cluster, backoff(a), say=_say, ready_timeout_s=a.startup_timeout)
    while cluster.stop_signal is None:
        dead = cluster.dead_child() if a.exit_on_child_failure else None
        if dead is not None:
            _say(f"[baton up] {dead.name} exited with {describe_exit(dead.exited())}; "
                 f"stopping. The end of {dead.log_path}:\n{dead.log_tail()}")
            return 1
        if not a.exit_on_child_failure:
            supervisor.tick()
        time.sleep(0.2)
    return 0


def _size_kv(a: argparse.Namespace, folder: Path) -> None:
    """Each worker's KV pool and host tier from the memory free now, unless given (a CUDA
    worker's pool: from its GPU, cluster/devices.py)."""
    free = read_mem_available()
    cuda = (a.device or "cpu").startswith("cuda")
    pool = None if cuda else kv_bytes_per_worker(a, folder, free)
    if pool is not None:
        set_role_flag(a, "kv_cache_memory_bytes", pool)
        print(f"[baton up] KV pool per worker: {pool / 2**20:.0f} MiB "
              f"({a.kv_memory_fraction:g} of the memory free, split evenly)", flush=True)
    tier = host_tier_bytes_per_worker(a, folder, free)
    if tier:
        set_role_flag(a, "kv_host_tier_bytes", tier)
        print(f"[baton up] host KV tier per worker: {tier / 2**20:.0f} MiB "
              f"({a.kv_host_tier_fraction:g} of the memory free, split evenly)", flush=True)


def main(argv: list[str] | None = None) -> int:
    """`baton up ARGS`; returns the exit status (see the module docstring)."""
    a = parse_up_args(argv)
    if (bad := bad_flags(a)) is not None:
        print(f"baton up: {bad}", file=sys.stderr)
        return 2
    if (taken := port_taken(a)) is not None:
        print(f"baton up: {taken}", file=sys.stderr)
        return 1
    try:
        from baton.models.registry import resolve_model
        folder = resolve_model(a.model)  # convert once here, before the workers race to it
        _size_kv(a, folder)
    except ValueError as e:  # KVBudgetError and an unknown model included
        print(f"baton up: {e}", file=sys.stderr)
        return 1
    if (bad := bad_flags(a, {"prefill": prefill_args(a), "decode": decode_args(a),
                             "gateway": gateway_args(a, Path("workers.json"))})) is not None:
        print(f"baton up: {bad}", file=sys.stderr)
        return 2
    log_dir = Path(a.log_dir or tempfile.mkdtemp(prefix="baton-up-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(a, log_dir)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, cluster.request_stop)
    try:
        print(f"[baton up] starting {a.model} ({a.mode}); logs in {log_dir}", flush=True)
        cluster.start()
        print(_banner(a, cluster), flush=True)
        code = _serve(a, cluster)
        if code == 0:
            print("[baton up] stopping...", flush=True)
        return code
    except Interrupted:
        print("[baton up] interrupted during start-up; stopping...", flush=True)
        return 130
    except StartupError as e:
        print(f"[baton up] start-up failed: {e}", file=sys.stderr)
        return 1
    finally:
        cluster.stop()
        print("[baton up] stopped", flush=True)
