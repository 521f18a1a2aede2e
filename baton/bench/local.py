"""Start a server for a benchmark run and stop it after: a local Baton cluster (`baton up`,
as its own process group), the plain transformers baseline (`hf_baseline.py`), or vLLM's CPU
build on the same model folder (vllm_server.py, from its own venv).

Readiness = `GET /health` answers 200 and one tiny streamed chat request completes.
Stopping = SIGINT to the process group (graceful: `baton up` stops its workers, which run in
their own groups and die with it), then SIGTERM, then SIGKILL.
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from baton.bench.vllm_server import VllmSpec


@dataclass(frozen=True)
class ServerSpec:
    """A configuration to start. kind: "baton" (baton up), "hf" (transformers baseline),
    "vllm" (`vllm` says how; served as `model`, from the folder Baton resolves it to) or
    "vllm-pd" (the same vLLM as a prefill and a decode server sharing the cores,
    vllm_pd.py)."""

    name: str
    kind: str = "baton"
    mode: str = "disaggregated"
    routing: str = "session"
    num_decode: int = 1
    num_prefill: int = 1
    extra_args: tuple[str, ...] = ()
    vllm: VllmSpec | None = None

    def argv(self, model: str, port: int, log_dir: Path | None = None) -> list[str]:
        if self.kind in ("vllm", "vllm-pd"):
            from baton.models.registry import resolve_model

            if self.kind == "vllm-pd":
                return self.vllm.pd_argv(resolve_model(model), model, port)
            return self.vllm.argv(resolve_model(model), model, port) + list(self.extra_args)
        if self.kind == "hf":
            return [sys.executable, "-m", "baton.bench.hf_baseline", "--model", model,
                    "--port", str(port), *self.extra_args]
        args = [sys.executable, "-m", "baton.cli", "up", "--model", model, "--port", str(port),
                "--mode", self.mode, "--routing", self.routing,
                "--num-decode", str(self.num_decode)]
        if self.mode == "disaggregated":
            args += ["--num-prefill", str(self.num_prefill)]
        if log_dir is not None:
            args += ["--log-dir", str(log_dir)]
        return args + list(self.extra_args)

    def env(self) -> dict[str, str] | None:
        """The process's environment (None: this process's)."""
        return self.vllm.env() if self.kind in ("vllm", "vllm-pd") else None

    def describe(self) -> dict:
        out = {"name": self.name, "kind": self.kind, "mode": self.mode, "routing": self.routing,
               "num_decode": self.num_decode, "num_prefill": self.num_prefill,
               "extra_args": list(self.extra_args)}
        if self.vllm is not None:
            out["vllm"] = {"python": self.vllm.python, "dtype": self.vllm.resolved_dtype,
                           "kv_cache_bytes": self.vllm.kv_cache_bytes}
        return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerStartError(RuntimeError):
    pass


def _probe(url: str, model: str) -> bool:
    try:
        if httpx.get(f"{url}/health", timeout=5).status_code != 200:
            return False
        body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
            if r.status_code != 200:
                return False
            return any(line.startswith("data:") for line in r.iter_lines())
    except httpx.HTTPError:
        return False


@contextlib.contextmanager
def running_server(spec: ServerSpec, model: str, log_path: Path, timeout_s: float = 600.0):
    """Start `spec`, yield its base URL when it answers, stop the whole process group after."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    argv = spec.argv(model, port, log_path.parent / f"{log_path.stem}-logs")
    print(f"[bench] starting {spec.name}: {' '.join(argv[1:])} (log: {log_path})", flush=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, env=spec.env())
        try:
            deadline = time.monotonic() + timeout_s
            while not _probe(url, model):
                if proc.poll() is not None:
                    raise ServerStartError(f"{spec.name} exited with {proc.returncode}; "
                                           f"see {log_path}")
                if time.monotonic() > deadline:
                    raise ServerStartError(f"{spec.name} not ready in {timeout_s:.0f} s; "
                                           f"see {log_path}")
                time.sleep(1.0)
            yield url
        finally:
            stop_group(proc)


def stop_group(proc: subprocess.Popen, grace_s: float = 60.0) -> None:
    """SIGINT, SIGTERM, SIGKILL to the process group we started (by its id), in turn."""
    for sig, wait in ((signal.SIGINT, grace_s), (signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        if proc.poll() is not None:
            break
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(wait)
    # Children that outlive the leader still belong to its group.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
