"""`baton up`'s watch over a started cluster: a child that dies is started again, with
backoff, the way a Kubernetes Deployment restarts a pod's container.

    child exits ─▶ "[baton up] prefill-0 exited with status -9 (SIGKILL); restart 1 in 1 s
                    on port 50123" (+ the end of its log)
       │           meanwhile the cluster serves on: the gateway routes around a dead decode
       │           worker (failed calls and health polls mark it unhealthy), decode prefills
       │           locally while no prefill worker answers (--on-prefill-failure recompute)
       ▼
    after the delay: the same command on the port it had (`--port N`), so neither the gateway
    nor decode needs telling; "[baton up] prefill-0 is back on port N" at its READY line.
    A restart that dies again (the port still held, the same crash) is one more failure,
    and so is one that stays alive without printing READY for `ready_timeout_s` (baton up's
    --startup-timeout: a hang in start-up, e.g. a store it cannot reach): it is killed,
    "[baton up] prefill-0 printed no READY in N s; killing it", then restarted as any death.

    delay = min(max_s, initial_s * 2^(failures - 1)); failures count the deaths since the
    last run that stayed up stable_s (then they start from 1 again); restarts count all.

`baton up --exit-on-child-failure` does not supervise: the first death stops the cluster.
"""
from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from baton.cluster.child import Child


@dataclass(frozen=True)
class Backoff:
    """Restart delays: exponential from initial_s, capped at max_s, reset after stable_s."""

    initial_s: float = 1.0
    max_s: float = 30.0
    stable_s: float = 60.0

    def __post_init__(self) -> None:
        if not 0 < self.initial_s <= self.max_s or self.stable_s <= 0:
            raise ValueError("need 0 < initial_s <= max_s and stable_s > 0")

    def delay(self, failures: int) -> float:
        """The wait before the restart after the `failures`-th death in a row (from 1)."""
        return min(self.max_s, self.initial_s * 2 ** (failures - 1))


class Restartable(Protocol):
    """What the supervisor needs of the cluster (baton/cluster/up.py::Cluster)."""

    @property
    def children(self) -> list[Child]: ...

    def restart(self, child: Child) -> Child:
        """Start `child` again (same name, command and port); returns the new Child."""


@dataclass
class _Record:
    started_at: float
    restarts: int = 0            # all restarts of this child, as Kubernetes' restartCount
    failures: int = 0            # deaths since its last run that lasted stable_s
    due: float | None = None     # when the pending restart starts (None: none pending)
    announced: bool = True       # "is back" printed for its current run
    killed: bool = False         # its current run was killed for printing no READY


def describe_exit(status: int) -> str:
    """`status 3` or `status -9 (SIGKILL)` for a Popen return code."""
    if status < 0:
        try:
            return f"status {status} ({signal.Signals(-status).name})"
        except ValueError:
            pass
    return f"status {status}"


class Supervisor:
    """Call `tick()` every few hundred ms from the main loop; it never blocks."""

    def __init__(self, cluster: Restartable, backoff: Backoff,
                 clock: Callable[[], float] = time.monotonic,
                 say: Callable[[str], None] | None = None,
                 ready_timeout_s: float = 600.0) -> None:
        self.cluster = cluster
        self.backoff = backoff
        self.ready_timeout_s = ready_timeout_s
        self.clock = clock
        self.say = say or (lambda line: print(line, file=sys.stderr, flush=True))
        now = clock()
        self.records = {c.name: _Record(started_at=now) for c in cluster.children}

    def tick(self) -> None:
        """Schedule a restart for each newly dead child, start the ones that are due."""
        now = self.clock()
        for child in list(self.cluster.children):
            record = self.records[child.name]
            if record.due is None and child.exited() is not None:
                self._schedule(child, record, now)
            elif record.due is not None and now >= record.due:
                self._restart(child, record, now)
            elif not record.announced and child.ready.is_set():
                record.announced = True
                self.say(f"[baton up] {child.name} is back on port {child.port} "
                         f"(restart {record.restarts})")
            elif (not record.announced and not record.killed
                  and now - record.started_at >= self.ready_timeout_s):
                record.killed = True  # its death is scheduled as a failure on a later tick
                self.say(f"[baton up] {child.name} printed no READY in "
                         f"{self.ready_timeout_s:g} s; killing it. The end of "
                         f"{child.log_path}:\n{child.log_tail(10)}")
                child.kill()

    def _schedule(self, child: Child, record: _Record, now: float) -> None:
        if now - record.started_at >= self.backoff.stable_s:
            record.failures = 0  # it had stayed up: this is a fresh failure, not a crash loop
        record.failures += 1
        delay = self.backoff.delay(record.failures)
        record.due = now + delay
        port = f" on port {child.port}" if child.port is not None else ""
        self.say(f"[baton up] {child.name} exited with {describe_exit(child.exited())}; "
                 f"restart {record.restarts + 1} in {delay:g} s{port}. "
                 f"The end of {child.log_path}:\n{child.log_tail(10)}")

    def _restart(self, child: Child, record: _Record, now: float) -> None:
        record.restarts += 1
        record.due, record.started_at, record.announced = None, now, False
        record.killed = False
        try:
            self.cluster.restart(child)
        except OSError as e:  # could not even spawn it: one more failure, try again later
            self.say(f"[baton up] cannot restart {child.name}: {e}")
            record.failures += 1
            record.due = now + self.backoff.delay(record.failures)
