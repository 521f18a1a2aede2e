"""What was benchmarked, for report.json: this client's Baton version and commit, and what the
server says of itself.

A Baton gateway answers `GET /version` → {"version", "commit"?} and `GET /v1/models` → the
OpenAI model list (with `max_model_len`). Any other server is asked the same and its answer
is recorded as it comes: a JSON body, or {"status", "body"} for a non-200 answer, or
{"error"} when nothing answers. Asking never fails the run.

After a run, `save_metrics` keeps the server's Prometheus text (a Baton gateway's own
`/metrics` and its workers' through `/metrics/workers`: P/D decisions, preemptions, cache
hits), which would otherwise go with a cluster the benchmark stops.
"""
from __future__ import annotations

import functools
from pathlib import Path

import httpx

import baton

PROBES = {"version": "/version", "models": "/v1/models"}


@functools.lru_cache(maxsize=1)
def client_version() -> dict:
    """{"version", "commit"} of the Baton package running the benchmark (commit: None when
    it does not run from a git checkout, or git is missing)."""
    return {"version": baton.__version__, "commit": baton.source_commit()}


def _ask(client: httpx.Client, path: str):
    try:
        r = client.get(path)
    except httpx.HTTPError as exc:
        return {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    if r.status_code != 200:
        return {"status": r.status_code, "body": r.text[:200]}
    try:
        return r.json()
    except ValueError:
        return {"status": r.status_code, "body": r.text[:200]}


def probe_server(url: str, timeout_s: float = 5.0) -> dict:
    """{"version": <GET /version>, "models": <GET /v1/models>} as the server answered."""
    with httpx.Client(base_url=url, timeout=timeout_s) as client:
        return {key: _ask(client, path) for key, path in PROBES.items()}


METRICS_PATHS = ("/metrics", "/metrics/workers")


def save_metrics(url: str, path: Path, timeout_s: float = 5.0) -> bool:
    """Write `url`'s GET /metrics and /metrics/workers answers (Prometheus text) to `path`, each
    under a `# ---- GET <path>` line; an unanswered or non-200 path is noted there instead.
    True when any answered; never raises for the server's answers (an OSError writing
    `path` does raise)."""
    parts, answered = [], False
    with httpx.Client(base_url=url, timeout=timeout_s) as client:
        for p in METRICS_PATHS:
            try:
                r = client.get(p)
            except httpx.HTTPError as exc:
                parts.append(f"# ---- GET {p}: {type(exc).__name__}\n")
                continue
            if r.status_code != 200:
                parts.append(f"# ---- GET {p}: HTTP {r.status_code}\n")
                continue
            answered = True
            parts.append(f"# ---- GET {p}\n{r.text}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(parts))
    return answered
