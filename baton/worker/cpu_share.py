"""Workers on one CPU host lend each other their cores while idle (`baton up --pin share`).

A prefill and a decode worker pinned one core each (`--pin split`) leave a core idle whenever
one of them has nothing to step: between an agent's turns the decode worker decodes alone at
one thread while the prefill core sleeps, and a cold prefill runs at one thread while decode
waits for it. Colocated serving uses both cores for whatever runs. Here each worker marks
itself busy in a small shared file (one byte per worker, mmap'd) while it has work and idle
when it has none, and before every engine step and every model layer sets its own torch
threads to

    threads = max(1, cpus // (1 + other busy workers))

so a worker stepping alone takes every core and two busy workers one each (no more threads
than cores: OpenMP threads that outnumber free cores spin for each other, measured in
baton/threads.py at 26x slower). The file is written only on idle/busy transitions and read
with one small mmap slice per step and per layer (microseconds). A race (both see the other
idle and start a step) costs one oversubscribed layer; the next layer sees both busy.

Per layer because a prefill step of 256–512 tokens lasts 0.5–1 s here: one that started with
both cores while the decode worker was idle ran beside it, once decode had work again, with
three threads on two cores until the step ended (two threads beside a busy one ran 1.8–2.4x
slower than one thread: benchmarks/prefill_oversubscribe.py); DecoderModel.layer_hook reads
the load again before every layer (~20 ms of such a step).

The bytes count only Baton's own workers; another program busy on the same cores is measured
apart (host_load.py: the host's busy time less Baton's workers', whose pids sit in a side
file, FILE.pids) and caps the threads too: threads = min(the rule above, cpus − the other
programs' busy cores, rounded), at least 1. `--threads` is only the count a worker starts
with. Threads are set on the engine thread itself: torch/OpenMP thread counts are per calling
thread (a thread's first parallel region copies the global count once), so the worker's
start-up `set_num_threads` does not reach later changes on the engine thread.
"""
from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path

from baton.worker.host_load import HostLoad, process_cpu_seconds


def create_share_file(path: Path, num_workers: int) -> Path:
    """Make the shared file for `num_workers` workers (all idle) and its side file of their
    pids (FILE.pids, 4 bytes each, 0 = none yet). Raises ValueError if < 1."""
    if num_workers < 1:
        raise ValueError("num_workers must be ≥ 1")
    path.write_bytes(bytes(num_workers))
    pids_path(path).write_bytes(bytes(4 * num_workers))
    return path


def pids_path(path: str | os.PathLike) -> Path:
    """The side file holding the sharing workers' pids."""
    return Path(f"{os.fspath(path)}.pids")


class CpuShare:
    """One worker's view of the shared busy bytes.

    Args:
        path: the file `create_share_file` made (its size = the number of workers).
        slot: this worker's byte, 0 <= slot < size.
        cpus: cores the workers share (default: this process's affinity).
        load: the other programs' load (host_load.py) that caps the threads; None: not
            measured (`start_host_load` makes the real one).
    Raises ValueError for a slot outside the file; OSError if it cannot be opened.
    """

    def __init__(self, path: str | os.PathLike, slot: int, cpus: int | None = None,
                 load: HostLoad | None = None) -> None:
        self._f = open(path, "r+b")  # noqa: SIM115 - held for the worker's life
        self._mm = mmap.mmap(self._f.fileno(), 0)
        if not 0 <= slot < len(self._mm):
            size = len(self._mm)
            self._mm.close()
            self._f.close()
            raise ValueError(f"cpu share slot {slot} outside 0..{size - 1}")
        self.slot = slot
        self.cpus = cpus or len(os.sched_getaffinity(0))
        self._mm[slot] = 0  # idle until it has work (a restarted worker clears its old mark)
        self._busy = False
        self._threads = 0  # last count set (0: none yet)
        self.load = load
        self._pids = pids_path(path)
        try:  # this worker's pid, for the others' HostLoad
            with open(self._pids, "r+b") as f:
                f.seek(4 * slot)
                f.write(struct.pack("<I", os.getpid()))
        except OSError:  # a file made without the side file: the others count it external
            pass

    def other_pids(self) -> list[int]:
        """The pids the other sharing workers wrote (none if the side file is missing)."""
        try:
            raw = self._pids.read_bytes()
        except OSError:
            return []
        pids = struct.unpack(f"<{len(raw) // 4}I", raw[:len(raw) // 4 * 4])
        return [p for i, p in enumerate(pids) if p and i != self.slot]

    def start_host_load(self) -> HostLoad:
        """Measure the other programs' load from now on (host_load.py); returns it."""
        self.load = HostLoad(others=lambda: process_cpu_seconds(self.other_pids()))
        return self.load

    def threads_for_step(self) -> int:
        """Mark this worker busy and return the threads its next step should use (capped by
        the other programs' load when measured)."""
        if not self._busy:
            self._mm[self.slot] = 1
            self._busy = True
        others = sum(self._mm[:]) - 1
        n = max(1, self.cpus // (1 + others))
        return n if self.load is None else min(n, self.load.cap(self.cpus))

    def apply(self) -> int:
        """`threads_for_step`, set with torch.set_num_threads when it changed; the count."""
        n = self.threads_for_step()
        if n != self._threads:
            import torch

            torch.set_num_threads(n)
            self._threads = n
        return n

    def shared_fraction(self) -> float:
        """The share of this worker's cores another busy worker takes: 1 − (cpus // 2) /
        cpus, 0 when no other worker shares the file. An upper bound of the step rate lost
        (decode scales below linearly in threads: a batch-4 step of SmolLM2-135M took 50 ms
        on two threads and 79 on one, 0.36 lost: benchmarks/thread_scaling.py): the P/D
        cost model's `remote_stall_fraction` (baton/pd_cost.py)."""
        if len(self._mm) < 2:
            return 0.0
        return 1.0 - max(1, self.cpus // 2) / self.cpus

    def idle(self) -> None:
        """Mark this worker idle (nothing to step): the others may take its cores."""
        if self._busy:
            self._mm[self.slot] = 0
            self._busy = False

    def close(self) -> None:
        """Idle, and release the mapping."""
        self.idle()
        self._mm.close()
        self._f.close()
