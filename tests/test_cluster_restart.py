"""`baton up` with real workers (tiny model): the prefill worker is SIGKILLed (as by the OOM
killer); the cluster keeps answering (decode prefills locally meanwhile), the supervisor
restarts the worker on the port it had, and requests succeed once it is back."""
from __future__ import annotations

import os
import select
import signal
from pathlib import Path

import openai
import pytest

from tests.test_cluster_e2e import baton_up

pytestmark = pytest.mark.slow


def _child_pid(parent: int, module: str) -> int:
    children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
    for pid in children:
        if module in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
            return int(pid)
    raise AssertionError(f"no {module} child of {parent}")


def _read_until(proc, text: str, lines: list[str], timeout_s: float) -> None:
    """Read `baton up`'s output until a line contains text (bounded by timeout_s)."""
    for _ in range(int(timeout_s * 10)):
        ready, _, _ = select.select([proc.stdout], [], [], 0.1)
        if ready:
            line = proc.stdout.readline()
            lines.append(line)
            if text in line:
                return
    raise AssertionError(f"no {text!r} in:\n{''.join(lines)}")


def test_killed_prefill_worker_is_restarted_and_the_cluster_serves_on(tiny_llama):
    with baton_up(tiny_llama, "--restart-delay-s", "0.5", "--shutdown-grace-s", "5",
                  "--min-remote-tokens", "16") as (url, proc):  # the remote path
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                               timeout=120)
        model = client.models.list().data[0].id

        def ask(text: str) -> str:
            r = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": text * 8}], max_tokens=4,
                temperature=0)
            return r.choices[0].finish_reason

        assert ask("before the kill ") in ("stop", "length")
        os.kill(_child_pid(proc.pid, "prefill_service"), signal.SIGKILL)
        lines: list[str] = []
        _read_until(proc, "prefill-0 exited with status -9 (SIGKILL); restart 1", lines, 30)
        assert ask("while it is down ") in ("stop", "length")
        _read_until(proc, "prefill-0 is back on port", lines, 180)
        assert ask("once it is back ") in ("stop", "length")
        assert proc.poll() is None  # still serving
        client.close()
