"""A local Mooncake Store master for `baton up --kv-store mooncake` (and the tests): the
`mooncake_master` binary of PyPI `mooncake-transfer-engine-non-cuda`, on 127.0.0.1 and a
free port, killed with `baton up` (child.py's PR_SET_PDEATHSIG).

    mooncake_master --rpc_address=127.0.0.1 --rpc_port=P --metrics_port=M --rpc_thread_num=2
        --default_kv_lease_ttl=1s

The master holds only metadata: the blocks live in the segments the workers' clients lend
(store_client.py, --kv-store-segment-bytes); no HTTP metadata server (clients handshake peer
to peer). One that dies is started again on its port by `baton up`'s supervisor
(`restart_master`); it comes back empty, and the workers' clients notice and reconnect
(store_client.py). Lease: a read pins an object against eviction for that long (Mooncake's default
10 s would keep a full store from taking new blocks while old ones are being read).
"""
from __future__ import annotations

import importlib.util
import os
import socket
import threading
import time
from pathlib import Path

from baton.cluster.child import Child


def master_binary() -> str | None:
    """Path of the mooncake_master binary inside the installed `mooncake` package, or None."""
    spec = importlib.util.find_spec("mooncake")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(folder, "mooncake_master")
        if os.path.isfile(path):
            return path
    return None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (bind port 0, read it, close)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def master_argv(binary: str, port: int, metrics_port: int) -> list[str]:
    """The command line of the module docstring."""
    return [binary, "--rpc_address=127.0.0.1", f"--rpc_port={port}",
            f"--metrics_port={metrics_port}", "--rpc_thread_num=2",
            "--default_kv_lease_ttl=1000"]


def wait_listening(port: int, child: Child, timeout_s: float = 30.0) -> None:
    """Return once 127.0.0.1:port accepts a connection. RuntimeError if the child exits
    first or `timeout_s` passes (with the end of its log)."""
    end = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1.0):
                return
        except OSError:
            pass
        if child.exited() is not None or time.monotonic() > end:
            raise RuntimeError(f"mooncake_master did not listen on {port} "
                               f"(exit {child.exited()}); log:\n{child.log_tail()}")
        time.sleep(0.05)


def start_master(log_path: Path, env: dict[str, str] | None = None,
                 port: int | None = None) -> tuple[Child, str]:
    """Start a master (module docstring) on `port` (None: a free one); returns (its Child,
    mooncake://127.0.0.1:PORT) once it listens. RuntimeError when the package is missing or
    the master does not come up."""
    binary = master_binary()
    if binary is None:
        raise RuntimeError("mooncake_master not found: pip install -r requirements.txt "
                           "(mooncake-transfer-engine-non-cuda)")
    port = port or free_port()
    child = Child("kv-store", master_argv(binary, port, free_port()), log_path, port=port)
    child.start(dict(os.environ) if env is None else env)
    try:
        wait_listening(port, child)
    except RuntimeError:
        stop_master(child)
        raise
    child.ready.set()
    return child, f"mooncake://127.0.0.1:{port}"


def restart_master(old: Child, env: dict[str, str]) -> Child:
    """Start a dead master again: same command, port and log. Returns at once; the new
    Child's `ready` is set once it listens (a thread waits: the supervisor's tick never
    blocks), never when it dies first (the supervisor sees that)."""
    child = Child(old.name, old.argv, old.log_path, port=old.port)
    child.start(env)

    def mark_ready() -> None:
        try:
            wait_listening(child.port, child)
        except RuntimeError:
            return
        child.ready.set()
    threading.Thread(target=mark_ready, name="kv-store-ready", daemon=True).start()
    return child


def stop_master(child: Child, timeout_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after `timeout_s`."""
    if child.proc is None or child.proc.poll() is not None:
        return
    child.proc.terminate()
    try:
        child.proc.wait(timeout_s)
    except Exception:
        child.proc.kill()
        child.proc.wait()
