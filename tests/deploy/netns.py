"""A tiny multi-host lab on one machine: Linux network namespaces joined by a bridge.

    netns <lab>-hub  (the "client" host, 10.99.47.1 on br0)
        br0 ── hv-prefill ══veth══ bveth0  netns <lab>-prefill  10.99.47.11
            ── hv-decode  ══veth══ bveth0  netns <lab>-decode   10.99.47.12
            ── hv-gateway ══veth══ bveth0  netns <lab>-gateway  10.99.47.13

Every host sees only its own loopback and `bveth0`; the /24 exists only on these veths and
the bridge, inside namespaces this lab made (the root namespace is never touched), so no
packet can leave the machine. `close()` kills every process started here and deletes the
namespaces (which deletes the veths and the bridge), also after a failure; `sweep_stale()`
deletes what a killed earlier run left behind.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field

SUBNET = "10.99.47"
PREFIX = "baton-lab-"
HOSTS = {"hub": 1, "prefill": 11, "decode": 12, "gateway": 13}
IFACE = "bveth0"  # every role host's one interface (UCX_NET_DEVICES names it)
_CMD_TIMEOUT = 20.0


def _ip(*args: str, timeout: float = _CMD_TIMEOUT) -> str:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")
    return out.stdout


def why_unavailable() -> str | None:
    """None when this process may create network namespaces, else the reason it may not."""
    if os.geteuid() != 0:
        return "needs root (ip netns add)"
    probe = f"{PREFIX}probe-{os.getpid()}"
    try:
        _ip("netns", "add", probe)
        _ip("-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1")
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as e:
        return f"network namespaces not permitted here: {e}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=_CMD_TIMEOUT)
    return None


def sweep_stale() -> None:
    """Delete namespaces of earlier labs whose creating process is gone."""
    names = _ip("netns", "list").split()
    for name in names:
        if not name.startswith(PREFIX):
            continue
        pid = name[len(PREFIX):].split("-")[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            subprocess.run(["ip", "netns", "del", name], capture_output=True,
                           timeout=_CMD_TIMEOUT)


@dataclass
class Lab:
    """Namespaces per host name; `address(host)`; processes started with `spawn`."""

    name: str = field(default_factory=lambda: f"{PREFIX}{os.getpid()}-{int(time.time())}")
    procs: list[subprocess.Popen] = field(default_factory=list)
    created: list[str] = field(default_factory=list)

    def ns(self, host: str) -> str:
        return f"{self.name}-{host}"

    @staticmethod
    def address(host: str) -> str:
        return f"{SUBNET}.{HOSTS[host]}"

    def up(self) -> Lab:
        hub = self.ns("hub")
        for host in HOSTS:
            _ip("netns", "add", self.ns(host))
            self.created.append(self.ns(host))
            _ip("-n", self.ns(host), "link", "set", "lo", "up")
        _ip("-n", hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", hub, "addr", "add", f"{self.address('hub')}/24", "dev", "br0")
        _ip("-n", hub, "link", "set", "br0", "up")
        for host in HOSTS:
            if host == "hub":
                continue
            _ip("-n", hub, "link", "add", f"hv-{host}", "type", "veth",
                "peer", "name", IFACE, "netns", self.ns(host))
            _ip("-n", hub, "link", "set", f"hv-{host}", "master", "br0", "up")
            _ip("-n", self.ns(host), "addr", "add", f"{self.address(host)}/24", "dev", IFACE)
            _ip("-n", self.ns(host), "link", "set", IFACE, "up")
        return self

    def spawn(self, host: str, argv: list[str], env: dict[str, str], log) -> subprocess.Popen:
        """Start argv inside `host`'s namespace, in its own process group."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.ns(host), *argv], env=env,
                                stdout=subprocess.PIPE, stderr=log, text=True,
                                start_new_session=True)
        self.procs.append(proc)
        return proc

    def run(self, host: str, argv: list[str], timeout: float, env: dict[str, str] | None = None,
            stdin: str | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.ns(host), *argv], env=env,
                              input=stdin, capture_output=True, text=True, timeout=timeout)

    def iface_bytes(self, host: str) -> tuple[int, int]:
        """(rx_bytes, tx_bytes) of `host`'s veth."""
        info = json.loads(_ip("-n", self.ns(host), "-s", "-j", "link", "show", IFACE))
        stats = info[0]["stats64"]
        return stats["rx"]["bytes"], stats["tx"]["bytes"]

    def stop_processes(self, grace: float = 15.0) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait(timeout=10)
        self.procs.clear()

    def close(self) -> None:
        try:
            self.stop_processes()
        finally:
            for ns in reversed(self.created):
                subprocess.run(["ip", "netns", "del", ns], capture_output=True,
                               timeout=_CMD_TIMEOUT)
            self.created.clear()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
