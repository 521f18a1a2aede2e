"""How many CPU threads a process's torch should use, from the CPUs it may run on.

On a small, shared CPU machine more threads than free cores is far worse than fewer: OpenMP
workers spin waiting for each other while another process holds the core (measured here: 8
tokens of SmolLM2 took 21 s at 2 threads on a loaded 2-core machine, 0.8 s at 1 thread).
"""
from __future__ import annotations

import os


def default_num_threads() -> int:
    """OMP_NUM_THREADS when set (an explicit choice: `baton up`, compose, Kubernetes); else the
    CPUs this process may run on (its affinity: `--pin`, a cgroup cpuset) less those busy now
    (the 1-minute load average, rounded down), at least 1."""
    explicit = os.environ.get("OMP_NUM_THREADS", "").strip()
    if explicit.isdigit() and int(explicit) > 0:
        return int(explicit)
    cpus = len(os.sched_getaffinity(0))
    busy = int(os.getloadavg()[0])
    return max(1, min(cpus, cpus - busy))


def set_torch_threads(num_threads: int | None) -> int:
    """Set torch's intra-op threads to `num_threads` (None: `default_num_threads()`); returns
    the number set."""
    import torch

    n = default_num_threads() if num_threads is None else max(1, num_threads)
    torch.set_num_threads(n)
    return n
