"""How many cores other programs keep busy on this host, for `--pin share` (cpu_share.py).

The shared busy bytes count only Baton's own workers. Another program busy on the same
cores (a benchmark harness, a second server, a build) is not seen there, and OpenMP threads
that outnumber the free cores wait on each other: on this project's 2-core machine an 8-row
decode step of SmolLM2-135M beside one process spinning on a core took 72–78 ms (p90
156–160) at 2 threads and 55–60 ms (p90 62–63) at 1; quiet, 34–45 ms at 2 threads and 59–62
at 1 (BENCHMARKS.md, seventh pass). So a worker also measures the others' load:

    external cores = (host busy − this process − the other Baton workers) / window

over a window of at least WINDOW_S (the busy time of the cores this process may run on, its
affinity, from /proc/stat's per-core lines: user, nice, system, irq and softirq; idle,
iowait and a hypervisor's steal are not busy; this process's from os.times(); the other
workers', whose pids cpu_share.py lists, from /proc/<pid>/stat, since the shared bytes
already count them while they are busy), and
`cap(cpus)` = cpus less the external cores, rounded to the nearest, at least 1. Sampled at
most once per WINDOW_S (a few small reads), so a step or a layer asks for free. Where
/proc/stat cannot be read (not Linux) the cap is never lower than cpus.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable

WINDOW_S = 0.5
_BUSY_FIELDS = (0, 1, 2, 5, 6)  # user nice system (idle iowait) irq softirq


def host_busy_seconds(path: str = "/proc/stat", cpus=None) -> float | None:
    """CPU seconds the host's cores `cpus` (None: all, the first line) spent busy since boot
    (None: unreadable). A container sees the whole host's /proc/stat: its own cores are
    the ones its affinity (cpuset) names, and other tenants' cores are none of its business."""
    want = None if cpus is None else {f"cpu{c}".encode() for c in cpus}
    try:
        with open(path, "rb") as f:
            lines = [f.readline()] if want is None else \
                [ln for ln in f if ln.split(maxsplit=1)[0] in want]
        if not lines:
            return None
        busy = sum(int(ln.split()[1:][i]) for ln in lines for i in _BUSY_FIELDS)
        return busy / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def affinity_busy_seconds() -> float | None:
    """host_busy_seconds of the cores this process may run on (its affinity)."""
    return host_busy_seconds(cpus=sorted(os.sched_getaffinity(0)))


def process_cpu_seconds(pids) -> dict[int, float]:
    """CPU seconds (user + system) of each pid that can be read (a gone one is left out)."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            out[pid] = (int(fields[11]) + int(fields[12])) / tick
        except (OSError, ValueError, IndexError):
            continue
    return out


def own_cpu_seconds() -> float:
    """CPU seconds this process (every thread) spent, user + system."""
    t = os.times()
    return t.user + t.system


class HostLoad:
    """The cores other programs keep busy, measured over windows of ≥ `window_s`.

    host, own, others: readers of the host's busy seconds (None: unknown), this process's
    CPU seconds and the other Baton workers' (pid → seconds; a pid in only one of two samples
    counts 0 between them: it started or ended); clock: monotonic seconds (tests pass
    fakes)."""

    def __init__(self, window_s: float = WINDOW_S,
                 host: Callable[[], float | None] = affinity_busy_seconds,
                 own: Callable[[], float] = own_cpu_seconds,
                 others: Callable[[], dict[int, float]] = dict,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s, self._clock = window_s, clock
        self._host, self._own, self._others = host, own, others
        self.external = 0.0  # cores, over the last full window
        self._last = (clock(), host(), own(), others())

    def sample(self) -> float:
        """The external cores, updated once a window has passed since the last update."""
        now = self._clock()
        t0, h0, o0, w0 = self._last
        if now - t0 < self.window_s:
            return self.external
        h1, o1, w1 = self._host(), self._own(), self._others()
        if h0 is not None and h1 is not None:
            workers = sum(max(0.0, w1[p] - w0[p]) for p in w1.keys() & w0.keys())
            self.external = max(0.0, ((h1 - h0) - (o1 - o0) - workers) / (now - t0))
        self._last = (now, h1, o1, w1)
        return self.external

    def cap(self, cpus: int) -> int:
        """Threads that fit beside the others' load: cpus − external, rounded, ≥ 1."""
        return max(1, min(cpus, round(cpus - self.sample())))
