"""`baton up` with real workers (tiny model): the prefill worker is SIGKILLed (as by the OOM
killer); the cluster keeps answering (decode prefills locally meanwhile), the supervisor
restarts the worker on the port it had, and once it is back (READY) the next remote
prefill is `ok` on the new process (issue 27: each one used to be recomputed on decode,
the decode worker still holding the dead process's handshake)."""
from __future__ import annotations

import os
import select
import signal
from pathlib import Path

import openai
import pytest

from tests.restart_helpers import process_metrics, remote_outcomes, worker_addresses
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
        (prefill,), (decode,) = worker_addresses(url, "prefill"), worker_addresses(url, "decode")
        lines: list[str] = []
        # 1. a request while it is down: prefilled here; the next ones use it again
        os.kill(_child_pid(proc.pid, "prefill_service"), signal.SIGKILL)
        _read_until(proc, "prefill-0 exited with status -9 (SIGKILL); restart 1", lines, 30)
        assert ask("while it is down ") in ("stop", "length")
        _read_until(proc, "prefill-0 is back on port", lines, 180)
        assert next_remote_outcome(decode, lambda i: ask(f"once it is back {i} ")) == "ok"
        # 2. no request while it is down: decode still holds the old process's handshake
        # when the first one after READY comes; it is served by the new process all the same
        old_epoch = process_metrics("prefill", prefill).kv_epoch
        os.kill(_child_pid(proc.pid, "prefill_service"), signal.SIGKILL)
        _read_until(proc, "prefill-0 is back on port", lines, 180)
        outcome = next_remote_outcome(decode, lambda i: ask(f"after the second restart {i} "))
        assert outcome == "ok", "".join(lines)
        new = process_metrics("prefill", prefill)
        assert new.kv_epoch != old_epoch
        assert sum(s.value for s in new.samples if s.name == "baton_prefill_requests_total"
                   and s.labels["status"] == "PREFILL_STATUS_OK") == 1
        assert proc.poll() is None  # still serving
        client.close()


def next_remote_outcome(decode: str, ask, tries: int = 20) -> str:
    """Send requests one at a time (`ask(i)`) until the decode worker counts a remote
    prefill; its outcome. A request prefilled locally because the prefill worker's address
    did not answer yet (gRPC reconnects with a backoff of up to 2 s) is no remote prefill:
    the next one is sent."""
    before = remote_outcomes(process_metrics("decode", decode).samples)
    for i in range(tries):
        assert ask(i) in ("stop", "length")
        after = remote_outcomes(process_metrics("decode", decode).samples)
        moved = [o for o in after if after[o] > before[o]]
        if moved:
            return moved[0]
    raise AssertionError(f"no remote prefill in {tries} requests")
