"""Drive the public AgentX harness (PyPI `agentx-harness`, SemiAnalysis, built on NVIDIA AIPerf)
against a Baton gateway: find it, build its command line and environment, run it once.

The harness is a benchmark dependency only: it lives in its own venv, never in
requirements.txt (INSTALL below). It is found, in order, at `--agentx-bin PATH`,
`--agentx-venv DIR` (DIR/bin/agentx), `$BATON_AGENTX` (the binary or its venv), `agentx` on
PATH. One run:

    agentx profile --url URL --model MODEL --tokenizer FOLDER
        --input-file TRACE_DIR --custom-dataset-type weka_trace
        --concurrency C --benchmark-duration S --benchmark-grace-period G
        --warmup-requests-per-lane W --unsafe-override --ui none --artifact-dir DIR

  - `--tokenizer` is a local folder (Baton's converted model folder): nothing is fetched.
  - The harness mishandles local paths when Hugging Face offline variables are set, so they
    are removed from its environment (OFFLINE_VARS).
  - `--unsafe-override` lets the agentx scenario take a local trace folder and a benchmark
    shorter than its 900 s minimum; the harness then marks the run "submission_valid: false"
    in its own report, which is right: these are not leaderboard submissions.
  - The scenario's other rules stay (closed-loop agentic replay, recorded think times capped
    at 10 s, first-turn cache busting, streaming, ignore_eos, server token counts).
"""
from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

ENV_VAR = "BATON_AGENTX"
OFFLINE_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")
INSTALL = (
    "install the AgentX harness in its own venv (not in Baton's):\n"
    "  python3 -m venv /tmp/agentx-venv\n"
    "  /tmp/agentx-venv/bin/pip install agentx-harness==1.0.12\n"
    "then pass --agentx-venv /tmp/agentx-venv (or set BATON_AGENTX=/tmp/agentx-venv)"
)


class HarnessMissing(RuntimeError):
    """No AgentX harness binary where we looked; the message carries the install recipe."""


class HarnessFailed(RuntimeError):
    """The harness exited non-zero or wrote no results; the message names its log."""


def _from_path(path: Path) -> Path | None:
    """A binary itself, or a venv folder holding bin/agentx."""
    path = path.expanduser()
    if path.is_dir():
        path = path / "bin" / "agentx"
    return path if path.is_file() and os.access(path, os.X_OK) else None


def find_harness(agentx_bin: str | None = None, agentx_venv: str | None = None,
                 env: dict | None = None) -> Path:
    """The `agentx` binary (see the module docstring for the search order).

    Raises HarnessMissing, naming what was tried and how to install, when none is found.
    """
    env = os.environ if env is None else env
    for label, value in (("--agentx-bin", agentx_bin), ("--agentx-venv", agentx_venv),
                         (f"${ENV_VAR}", env.get(ENV_VAR))):
        if value:  # the first one given decides: a wrong explicit path is an error
            found = _from_path(Path(value))
            if found is None:
                raise HarnessMissing(f"no AgentX harness at {label}={value} (expected the "
                                     f"agentx binary or a venv with bin/agentx); {INSTALL}")
            return found
    on_path = shutil.which("agentx", path=env.get("PATH"))
    if on_path:
        return Path(on_path)
    tried = ["--agentx-bin", "--agentx-venv", f"${ENV_VAR}", "agentx on PATH"]
    raise HarnessMissing(f"AgentX harness not found (tried {', '.join(tried)}); {INSTALL}")


def harness_env(env: dict | None = None) -> dict:
    """A copy of `env` without the Hugging Face offline variables (see the module docstring)."""
    out = dict(os.environ if env is None else env)
    for name in OFFLINE_VARS:
        out.pop(name, None)
    return out


@dataclass(frozen=True)
class HarnessRun:
    """One harness invocation. Times in seconds; `extra` is appended verbatim."""

    binary: Path
    url: str
    model: str
    tokenizer: Path
    trace_dir: Path
    artifact_dir: Path
    concurrency: int
    duration_s: float
    grace_s: float = 30.0
    warmup_requests_per_lane: int = 2
    seed: int = 42
    extra: tuple[str, ...] = field(default_factory=tuple)

    def argv(self) -> list[str]:
        """The full command line (see the module docstring)."""
        return [str(self.binary), "profile",
                "--url", self.url, "--model", self.model, "--tokenizer", str(self.tokenizer),
                "--input-file", str(self.trace_dir), "--custom-dataset-type", "weka_trace",
                "--concurrency", str(self.concurrency),
                "--benchmark-duration", f"{self.duration_s:g}",
                "--benchmark-grace-period", f"{self.grace_s:g}",
                "--warmup-requests-per-lane", str(self.warmup_requests_per_lane),
                "--random-seed", str(self.seed),
                "--unsafe-override", "--ui", "none",
                "--artifact-dir", str(self.artifact_dir), *self.extra]

    def timeout_s(self, startup_s: float = 600.0) -> float:
        """Wall-clock bound of the whole invocation: warm-up and start-up get `startup_s`."""
        return self.duration_s + self.grace_s + startup_s


def run_harness(run: HarnessRun, log_path: Path, env: dict | None = None,
                startup_s: float = 600.0) -> Path:
    """Run the harness to completion; return the artifact folder holding its exports.

    Its output goes to `log_path`. Raises HarnessFailed on a non-zero exit, a timeout (the
    process group is killed) or a missing `profile_export_aiperf.json`.
    """
    run.artifact_dir.mkdir(parents=True, exist_ok=True)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"[agentx] {' '.join(run.argv())}", flush=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(run.argv(), stdout=log, stderr=subprocess.STDOUT,
                                env=harness_env(env), start_new_session=True)
        try:
            code = proc.wait(run.timeout_s(startup_s))
        except subprocess.TimeoutExpired:
            from baton.bench.local import stop_group
            stop_group(proc, grace_s=10.0)
            raise HarnessFailed(f"harness ran past {run.timeout_s(startup_s):.0f} s; "
                                f"see {log_path}") from None
    if code != 0:
        raise HarnessFailed(f"harness exited with {code}; see {log_path}")
    if not (run.artifact_dir / "profile_export_aiperf.json").is_file():
        raise HarnessFailed(f"harness wrote no profile_export_aiperf.json in "
                            f"{run.artifact_dir}; see {log_path}")
    return run.artifact_dir


def tokenizer_folder(model: str, tokenizer: str | None = None) -> Path:
    """The local tokenizer folder: `tokenizer` if it is a folder, else Baton's model folder
    (converted on first use, baton.models.registry.resolve_model)."""
    if tokenizer and Path(tokenizer).expanduser().is_dir():
        return Path(tokenizer).expanduser().resolve()
    from baton.models.registry import resolve_model
    return resolve_model(model)
