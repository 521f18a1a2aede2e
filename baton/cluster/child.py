"""One child process of `baton up` (a worker or the gateway), as the supervisor sees it.

    child = Child(name, argv, log_path, cpus)
    child.start(env)   Popen in its own session; before exec it asks to be SIGTERMed when
                       `baton up` dies (PR_SET_PDEATHSIG) and pins itself to `cpus`; stderr
                       goes to log_path, stdout is copied there line by line by a thread
                       that sets `ready` (and `port`) at the `READY port=N` line
                       (baton/worker/process.py::parse_ready)
    child.exited()     its exit status, None while it runs
    child.kill()       SIGKILL its process group (the supervisor's READY timeout)
    child.log_tail()   the end of its log, for error messages
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import signal
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path

from baton.worker.process import parse_ready

_PR_SET_PDEATHSIG = 1


@dataclass
class Child:
    """One role process; `port` is set from its READY line."""

    name: str
    argv: list[str]
    log_path: Path
    cpus: frozenset[int] | None = None  # CPU affinity (None: unpinned)
    proc: subprocess.Popen | None = None
    port: int | None = None
    ready: threading.Event = field(default_factory=threading.Event)

    def start(self, env: dict[str, str]) -> None:
        """Start the process (see the module docstring)."""
        log = open(self.log_path, "ab", buffering=0)
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=log, env=env,
                                     start_new_session=True,
                                     preexec_fn=functools.partial(_before_exec, self.cpus))
        threading.Thread(target=self._read_stdout, args=(log,), daemon=True).start()

    def _read_stdout(self, log) -> None:
        for line in iter(self.proc.stdout.readline, b""):
            log.write(line)
            ready = parse_ready(line.decode(errors="replace"))
            if ready is not None:
                self.port = ready.port
                self.ready.set()

    @property
    def address(self) -> str:
        """host:port to dial it on (it binds loopback)."""
        return f"127.0.0.1:{self.port}"

    def exited(self) -> int | None:
        """Its exit status, or None while it runs (or before start)."""
        return None if self.proc is None else self.proc.poll()

    def kill(self) -> None:
        """SIGKILL its process group (a child that never got ready); `exited()` then tells."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)

    def log_tail(self, lines: int = 25) -> str:
        """The last `lines` lines of its log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it when `baton up` dies, even by SIGKILL."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def _before_exec(cpus: frozenset[int] | None) -> None:
    _die_with_parent()
    if cpus:
        os.sched_setaffinity(0, cpus)
