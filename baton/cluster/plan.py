"""What `baton up` starts, decided from its parsed flags before anything runs: each child's
CPU set (`cpu_plan`) or core-sharing slot (`cpu_share_plan`), its command line
(`prefill_args`, `decode_args`, `gateway_args`), its environment (`child_env`; the gateway's
API key in `gateway_env`, never on its command line) and the fixed
ports it will bind (`fixed_ports`, checked free before anything starts).

The command lines re-emit `baton up`'s flags as each role's own flags. baton/ never imports
a service, so these are checked where services may be imported: tests/test_cluster_plan.py
parses every argv built here with the role's own parser (a renamed flag fails it).
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import NamedTuple

from baton.engine.kv_budget import FALLBACK_BYTES, cluster_kv_bytes
from baton.roles import API_KEY_ENV
from baton.worker.cpu_share import create_share_file

# `baton up` flags passed on unchanged (when given) to every worker / to the gateway.
_WORKER_FLAGS = ("dtype", "block_size", "max_model_len", "num_blocks", "kv_cache_memory_bytes",
                 "kv_host_tier_bytes", "kv_disk_tier_dir", "kv_disk_tier_bytes",
                 "kv_store_url", "kv_store_segment_bytes")
# (Not --api-key: the key goes through the gateway's environment, gateway_env.)
_GATEWAY_FLAGS = ("grpc_port", "max_model_len", "block_size", "shutdown_grace_s",
                  "slo_ttft_ms")


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


_ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


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
    workers = a.num_decode + (a.num_prefill if a.mode == "disaggregated" else 0)
    return cluster_kv_bytes(folder, free_bytes, workers, a.block_size or 16,
                            _ELEMENT_BYTES[a.dtype or "float32"], a.max_model_len,
                            a.kv_memory_fraction)


def _passed_on(a: argparse.Namespace, flags: tuple[str, ...]) -> list[str]:
    out = []
    for flag in flags:
        value = vars(a)[flag]
        if value is not None:
            out += [f"--{flag.replace('_', '-')}", str(value)]
    return out


def prefill_args(a: argparse.Namespace, port: int = 0) -> list[str]:
    """A prefill worker's flags: loopback, on any free port at first start (port 0) and on
    the port it had when restarted; its metrics on any free port too (the gateway's GET
    /metrics/workers finds them through WorkerStats.metrics_port)."""
    return ["--model", a.model, "--host", "127.0.0.1", "--port", str(port),
            "--metrics-port", "0",
            "--transport", a.transport, "--log-level", a.log_level, "--drain-seconds", "5",
            *_passed_on(a, _WORKER_FLAGS)]


def decode_args(a: argparse.Namespace, port: int = 0) -> list[str]:
    """A decode worker's flags: a prefill worker's, and --min-remote-tokens and
    --prefill-max-seconds when given."""
    return prefill_args(a, port) + _passed_on(a, ("min_remote_tokens", "prefill_max_seconds"))


def gateway_args(a: argparse.Namespace, decode: list[str], prefill: list[str]) -> list[str]:
    """The gateway's flags, with the workers' addresses (no prefill worker: colocated)."""
    out = ["--model", a.model, "--host", a.host, "--port", str(a.port),
           "--routing", a.routing, "--log-level", a.log_level, "--decode", ",".join(decode)]
    out += ["--prefill", ",".join(prefill)] if prefill else ["--prefill-mode", "local"]
    return out + _passed_on(a, _GATEWAY_FLAGS)


class FixedPort(NamedTuple):
    """A port `baton up` was told to use: where it is bound, what it is, the flag that sets it."""

    host: str
    port: int
    what: str
    flag: str


def fixed_ports(a: argparse.Namespace) -> list[FixedPort]:
    """Every non-zero port a child will bind (workers bind port 0 on first start)."""
    out = [FixedPort(a.host, a.port, "the gateway's HTTP port", "--port")]
    if a.grpc_port is not None:  # the gateway's gRPC front binds its default 127.0.0.1
        out.append(FixedPort("127.0.0.1", a.grpc_port, "the gateway's gRPC front", "--grpc-port"))
    return [p for p in out if p.port != 0]


def gateway_env(env: dict[str, str], api_key: str | None) -> dict[str, str]:
    """The gateway's environment: `env`, with the API key as $BATON_API_KEY when one is
    given (a command line shows in `ps`; an environment only to its owner and root)."""
    return {**env, API_KEY_ENV: api_key} if api_key else env


def child_env(threads: int) -> dict[str, str]:
    """This process's environment with `threads` BLAS/OpenMP threads and unbuffered output."""
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = str(threads)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("UCX_NET_DEVICES", "lo")  # one machine: keep NIXL/UCX on loopback
    env["PYTHONUNBUFFERED"] = "1"
    return env
