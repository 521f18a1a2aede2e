"""What `baton up` starts, decided from its parsed flags before anything runs: each child's
CPU set (`cpu_plan`) or core-sharing slot (`cpu_share_plan`), its KV pool and host tier
(`kv_bytes_per_worker`, `host_tier_bytes_per_worker`), its command line (`prefill_args`,
`decode_args`, `gateway_args`: the role flags given to `baton up`, then what `baton up`
decides), the gateway's workers file (`write_workers_file`) and its environment
(`child_env`, `gateway_env`).

The role flags are generated from the roles' configs (cluster/flags.py), so a child's command
line always parses; tests/test_cluster_plan.py parses each with the role's own parser too.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from baton.cluster.flags import role_argv
from baton.dtypes import ELEMENT_BYTES, resolve_dtype
from baton.engine.kv_budget import FALLBACK_BYTES, cluster_kv_bytes, cluster_share, weight_bytes
from baton.roles import API_KEY_ENV
from baton.worker.cpu_share import create_share_file


def cpu_plan(pin: str, mode: str, num_prefill: int, num_decode: int,
             cpus: list[int] | None = None) -> dict[str, frozenset[int] | None]:
    """Child name -> CPU set for `--pin` (None: unpinned). With one CPU nothing is pinned."""
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else sorted(cpus)
    names = [f"prefill-{i}" for i in range(num_prefill if mode == "disaggregated" else 0)]
    names += [f"decode-{i}" for i in range(num_decode)]
    if pin in ("none", "share") or len(cpus) < 2:
        return {n: None for n in names}
    if mode == "disaggregated":
        half = len(cpus) // 2
        decode, prefill = frozenset(cpus[:half]), frozenset(cpus[half:])
        return {n: prefill if n.startswith("prefill") else decode for n in names}
    workers = len(names)
    if workers >= len(cpus):
        return {n: frozenset([cpus[i % len(cpus)]]) for i, n in enumerate(names)}
    return {n: frozenset(cpus[i::workers]) for i, n in enumerate(names)}


def cpu_share_plan(pin: str, log_dir: Path, names: list[str]) -> dict[str, list[str]]:
    """Child name -> its `--cpu-share FILE:SLOT` flags under `--pin share` (one shared file
    in `log_dir`, one slot per worker, all idle; baton/worker/cpu_share.py), else none."""
    if pin != "share":
        return {n: [] for n in names}
    path = create_share_file(log_dir / "cpu-share", len(names))
    return {n: ["--cpu-share", f"{path}:{i}"] for i, n in enumerate(names)}


def kv_bytes_per_worker(a: argparse.Namespace, folder: Path, free_bytes: int | None) -> int | None:
    """The KV pool bytes each worker gets when neither --num-blocks nor
    --kv-cache-memory-bytes is given (None when one is): one budget, `--kv-memory-fraction`
    of `free_bytes` (MemAvailable, measured once here) less every worker's weights, divided
    evenly (baton/engine/kv_budget.py), so workers starting together do not each count
    the same free memory. Raises KVBudgetError when one max-length request per worker
    does not fit."""
    if a.num_blocks is not None or a.kv_cache_memory_bytes is not None:
        return None
    if free_bytes is None:
        return FALLBACK_BYTES
    return cluster_kv_bytes(folder, free_bytes, _num_workers(a), a.block_size or 16,
                            ELEMENT_BYTES[resolve_dtype(a.dtype or "auto", a.device or "cpu")],
                            a.max_model_len, a.kv_memory_fraction)


def host_tier_bytes_per_worker(a: argparse.Namespace, folder: Path,
                               free_bytes: int | None) -> int | None:
    """Each worker's host KV tier when --kv-host-tier-bytes is not given (None when it is,
    or when --kv-host-tier-fraction is 0, or without /proc/meminfo): that fraction of
    `free_bytes` less every worker's weights, split evenly — beside the pools' share, so
    blocks a full pool evicts are loaded back, not recomputed, and a time-sliced decode is
    swapped out rather than recomputed (baton/engine/time_slice.py)."""
    if "kv_host_tier_bytes" in a.given or a.kv_host_tier_fraction == 0 or free_bytes is None \
            or a.prefix_caching is False:
        return None
    return cluster_share(free_bytes, weight_bytes(folder), _num_workers(a),
                         a.kv_host_tier_fraction)


def _num_workers(a: argparse.Namespace) -> int:
    return a.num_decode + (a.num_prefill if a.mode == "disaggregated" else 0)


def set_role_flag(a: argparse.Namespace, dest: str, value) -> None:
    """Give the children a role flag's value decided here (a KV budget, the store's URL) as
    if it had been given to `baton up`."""
    setattr(a, dest, value)
    a.given[dest] = [f"--{dest.replace('_', '-')}", str(value)]


def prefill_args(a: argparse.Namespace, port: int = 0) -> list[str]:
    """A prefill worker's flags: the prefill flags given to `baton up`, then loopback on any
    free port at first start (port 0) and on the port it had when restarted; its metrics on
    any free port too (the gateway's GET /metrics/workers finds them through
    WorkerStats.metrics_port)."""
    return _worker_args(a, "prefill", port)


def decode_args(a: argparse.Namespace, port: int = 0) -> list[str]:
    """A decode worker's flags: as prefill_args, with the decode flags given."""
    return _worker_args(a, "decode", port)


def _worker_args(a: argparse.Namespace, role: str, port: int) -> list[str]:
    return [*role_argv(a, role), "--model", a.model, "--host", "127.0.0.1", "--port",
            str(port), "--metrics-port", "0", "--log-level", a.log_level,
            "--drain-seconds", "5"]


def gateway_args(a: argparse.Namespace, workers_file: Path) -> list[str]:
    """The gateway's flags: the gateway flags given to `baton up`, then the model, its HTTP
    address and the file it reads the workers' addresses from (`write_workers_file`; the
    gateway starts beside the workers and picks them up when the file changes); colocated:
    every prefill local. Never the API key: it goes in the gateway's environment
    (`gateway_env`), out of `ps`."""
    out = [*role_argv(a, "gateway"), "--model", a.model, "--host", a.host, "--port",
           str(a.port), "--log-level", a.log_level, "--workers-file", str(workers_file)]
    return out + (["--prefill-mode", "local"] if a.mode == "colocated" else [])


def write_workers_file(path: Path, decode: list[str], prefill: list[str]) -> None:
    """Write the workers' addresses as the gateway's --workers-file JSON, atomically (a
    rename), so the gateway never reads half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"decode": decode, "prefill": prefill}))
    os.replace(tmp, path)


def gateway_env(env: dict[str, str], api_key: str | None) -> dict[str, str]:
    """The gateway's environment: `env` with $BATON_API_KEY set to `baton up --api-key`
    (when given; else whatever `env` holds), so the key never shows in `ps`."""
    return env if api_key is None else {**env, API_KEY_ENV: api_key}


def child_env(threads: int) -> dict[str, str]:
    """This process's environment with `threads` BLAS/OpenMP threads and unbuffered output."""
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = str(threads)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("UCX_NET_DEVICES", "lo")  # one machine: keep NIXL/UCX on loopback
    env["PYTHONUNBUFFERED"] = "1"
    return env
