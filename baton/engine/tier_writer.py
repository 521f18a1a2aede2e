"""One background thread that runs the disk tier's file jobs (block writes, unlinks) in the
order they were submitted, so the engine thread does not wait for the disk.

    engine thread: submit(job, tag) ──jobs──▶ writer thread: job() ──done──▶ reap() → tags

Only the engine thread submits and reaps; a job touches nothing but its file (os.writev
and zlib.crc32 release the GIL, so a write overlaps the model's compute). FIFO order keeps
"unlink h" then "write h" meaning what it says.
"""
from __future__ import annotations

import functools
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

from baton.engine.tier_store import unlink_quiet

log = logging.getLogger(__name__)


class Done(NamedTuple):
    tag: Any
    result: Any  # the job's return value; None when it raised
    error: OSError | None


class FileWriter:
    """A FIFO of file jobs on one daemon thread. `pending` counts jobs not yet reaped."""

    def __init__(self, name: str = "baton-kv-tier-writer") -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self.pending = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], Any], tag: Any = None) -> None:
        self.pending += 1
        self._jobs.put((job, tag))

    def unlink(self, path: str) -> None:
        """Queue deleting `path` (after the jobs before it; a missing file is fine)."""
        self.submit(functools.partial(unlink_quiet, path))

    def reap(self, wait: bool = False) -> list[Done]:
        """Finished jobs, oldest first; with `wait`, at least one when any is pending."""
        out = []
        if wait and self.pending:
            out.append(self._done.get())
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                break
        self.pending -= len(out)
        return out

    def close(self, timeout_s: float = 10.0) -> None:
        """Finish the queued jobs and stop the thread (results are discarded); gives up
        after `timeout_s` (a stuck disk must not hang the process's exit)."""
        self._jobs.put((None, None))
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            job, tag = self._jobs.get()
            if job is None:
                return
            try:
                self._done.put(Done(tag, job(), None))
            except OSError as e:
                self._done.put(Done(tag, None, e))
            except Exception as e:  # a bug: report it as a failed job, keep the thread
                log.exception("KV tier file job failed")
                self._done.put(Done(tag, None, OSError(repr(e))))
