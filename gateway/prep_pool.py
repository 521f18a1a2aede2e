"""The pool that prepares requests off the event loop: parse, check, template, tokenize.

    pool = PrepPool(prompts, settings, processes=2, timeout_s=10.0)
    await pool.start()                  # the children, ready (Gateway.start)
    value = await pool.run(fn, *args, affinity=session_id)
                                        # fn(PrepContext, *args) in a child, within timeout_s
    await pool.close()

Why processes, not threads: the event loop must keep relaying every running stream and
answering /health while one request is prepared, and preparing costs in proportion to the
request (more for its schemas). Pure-Python work on a thread gives the loop the GIL back every
5 ms, but the heavy steps are C calls that keep it throughout: `json.loads` of a 3 MB body of
nested objects (about 1.5 s here), pydantic's validation of it, the tokenizer's `encode`
(1.8 s for 2 MB of text). On a thread each of those stalls the loop as long; in a process
nothing does, and a process can be stopped.

Children are forked from multiprocessing's fork server, which is started once per gateway
process (by exec, so no thread of the gateway is copied) with the preparation modules
imported; a new child is ready in about 0.3 s: it unpickles the served tokenizer into its
own PromptBuilder. As in any multiprocessing program, a child imports the gateway process's
main module: it must do nothing on import (`python -m gateway`'s does nothing). Each child
holds its own caches of recent sessions (the tokenized pieces, gateway/piece_cache.py; the
block hashes, gateway/prefix_hashes.py), so a job goes to the child its session's key
(`affinity`) maps to when that one is free, else to any free one.

One job: the parent sends (fn, args) over the child's socket (asyncio streams: no thread, no
blocking call on the loop) and waits for the answer; before each costly step the child notes
the field it works on (`ctx.note`).
- no answer within timeout_s: the child is killed (SIGKILL) and replaced; the request gets a
  400 `request_too_complex` naming the last noted field (a schema, `tools`, `messages`);
- the client leaves (the job is cancelled): the same kill and replace, as the work is nobody's;
- the child dies: 500, replaced;
- no child free within timeout_s: 503 + Retry-After.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import multiprocessing
import multiprocessing.forkserver
import pickle
import signal
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from gateway.errors import GatewayError
from gateway.limits import RequestLimits
from gateway.prefix_hashes import SessionHashCache
from gateway.prompts import PromptBuilder

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Imported by the fork server before it forks any child. The last one is the base of
# transformers' fast tokenizers (the served tokenizer's own class, if another module, is
# imported by each child as it unpickles it); a module that does not exist is skipped.
PRELOAD = ("gateway.server", "gateway.prepare", "gateway.tokenize_api", "gateway.grpc_request",
           "gateway.anthropic_protocol", "gateway.responses_protocol", "jsonschema",
           "xgrammar", "transformers.tokenization_utils_tokenizers")
_READY_TIMEOUT_S = 120.0  # a child's start: the fork server's first start imports torch


@dataclass(frozen=True)
class PrepSettings:
    """What a child knows of the gateway's configuration."""

    model_names: frozenset[str]
    tool_call_parser: str
    limits: RequestLimits = field(default_factory=RequestLimits)


@dataclass(frozen=True)
class PrepContext:
    """A job's view of its child: the served model's prompts, the settings, `note(param)` to
    name the field the next step works on, and the child's block hashes of recent sessions
    (gateway/prefix_hashes.py)."""

    prompts: PromptBuilder
    settings: PrepSettings
    note: Callable[[str], None]
    hashes: SessionHashCache = field(default_factory=SessionHashCache)


class _Job:
    """One job's last noted field (read after a deadline)."""

    param: str | None = None


class _Child:
    """One child process and the parent's end of its socket (asyncio streams, so a job
    costs the loop no thread and no blocking call)."""

    def __init__(self, proc, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.proc, self.reader, self.writer = proc, reader, writer

    @classmethod
    async def start(cls, ctx, blob: bytes) -> _Child:
        ours, theirs = socket.socketpair()
        proc = ctx.Process(target=_child_main, args=(theirs, blob), daemon=True,
                           name="gateway-prep")
        await asyncio.to_thread(proc.start)  # talks to the fork server (its start: seconds)
        theirs.close()
        reader, writer = await asyncio.open_unix_connection(sock=ours)
        child = cls(proc, reader, writer)
        try:
            ready = await asyncio.wait_for(_read(reader), _READY_TIMEOUT_S)
        except (TimeoutError, EOFError, OSError):
            ready = None
        if ready != ("ready", None):
            await child.kill()
            raise RuntimeError("a request-preparation process did not start")
        return child

    async def call(self, job: _Job, fn: Callable, args: tuple) -> tuple[str, Any]:
        """("ok", value) or ("error", exception); EOFError/OSError when the child died."""
        _write(self.writer, (fn, args))
        await self.writer.drain()
        while True:
            kind, value = await _read(self.reader)
            if kind != "note":
                return kind, value
            job.param = value

    async def kill(self) -> None:
        self.writer.close()
        if self.proc.is_alive():
            self.proc.kill()
        await asyncio.to_thread(self.proc.join)


# Framing on a child's socket: an 8-byte little-endian length, then a pickle.
def _write(writer: asyncio.StreamWriter, message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    writer.write(len(data).to_bytes(8, "little"))
    writer.write(data)


async def _read(reader: asyncio.StreamReader) -> Any:
    """The next message (asyncio.IncompleteReadError, an EOFError, when the child died)."""
    size = int.from_bytes(await reader.readexactly(8), "little")
    return pickle.loads(await reader.readexactly(size))


def start_fork_server() -> None:
    """Start multiprocessing's fork server now, without waiting for it: an exec'd process
    that imports PRELOAD (about 3 s of CPU here). Called first thing by Gateway.start, so
    those imports run beside the gateway's own tokenizer load instead of after it;
    PrepPool.start then finds it running. A no-op when it already runs."""
    multiprocessing.set_forkserver_preload(list(PRELOAD))
    multiprocessing.forkserver.ensure_running()


class PrepPool:
    """`processes` children preparing requests (see the module docstring)."""

    def __init__(self, prompts: PromptBuilder, settings: PrepSettings, processes: int,
                 timeout_s: float) -> None:
        self._prompts = prompts
        self._settings = settings
        self._processes = processes
        self.timeout_s = timeout_s
        self._blob = b""
        self._slots: list[_Child | None] = [None] * processes  # None: (re)starting
        self._idle: set[int] = set()  # slots whose child waits for a job
        self._freed = asyncio.Condition()
        self._tasks: set[asyncio.Task] = set()
        self._ctx = multiprocessing.get_context("forkserver")

    async def start(self) -> None:
        """Start every child and wait until each is ready (the fork server first, unless
        start_fork_server already did)."""
        start_fork_server()
        self._blob = await asyncio.to_thread(pickle.dumps, (self._prompts, self._settings))
        await asyncio.gather(*(self._spawn(i) for i in range(self._processes)))

    async def run(self, fn: Callable[..., T], *args, affinity: str | None = None) -> T:
        """fn(PrepContext, *args) in a child; GatewayError as the module docstring says, and
        whatever fn raised. Jobs with the same `affinity` (a session id) go to the same child
        when it is free, so its caches of the session's pieces and hashes hit."""
        slot = await self._acquire(affinity)
        child = self._slots[slot]
        job = _Job()
        try:
            kind, value = await asyncio.wait_for(child.call(job, fn, args), self.timeout_s)
        except TimeoutError:
            self._replace(slot)
            raise GatewayError(400, "preparing the request took longer than "
                               f"{self.timeout_s:g} s (the gateway's --prep-timeout-s)"
                               + (f"; it was on {job.param}" if job.param else ""),
                               param=job.param, code="request_too_complex") from None
        except (EOFError, OSError) as e:
            self._replace(slot)
            logger.error("a request-preparation process died: %r", e)
            raise GatewayError(500, "the request's preparation failed: its process died",
                               code="internal_error") from None
        except BaseException:  # cancelled: the client left
            self._replace(slot)
            raise
        await self._release(slot)
        if kind == "error":
            raise value
        return value

    async def close(self) -> None:
        """Kill every child (a job still running fails)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        children = [c for c in self._slots if c is not None]
        self._slots = [None] * self._processes
        self._idle.clear()
        await asyncio.gather(*(c.kill() for c in children))

    async def _acquire(self, affinity: str | None) -> int:
        """A free slot: affinity's own when free, else any (503 after timeout_s)."""
        own = _slot_of(affinity, self._processes) if affinity else None
        try:
            async with self._freed:
                await asyncio.wait_for(self._freed.wait_for(lambda: self._idle),
                                       self.timeout_s)
                slot = own if own in self._idle else next(iter(self._idle))
                self._idle.discard(slot)
                return slot
        except TimeoutError:
            raise GatewayError(503, "the gateway is busy preparing other requests; retry "
                               "shortly", code="service_unavailable", retry_after=1) from None

    async def _release(self, slot: int) -> None:
        async with self._freed:
            self._idle.add(slot)
            self._freed.notify()

    async def _spawn(self, slot: int) -> None:
        self._slots[slot] = await _Child.start(self._ctx, self._blob)
        await self._release(slot)

    def _replace(self, slot: int) -> None:
        """Kill the slot's child and start another there, in the background."""
        child, self._slots[slot] = self._slots[slot], None

        async def replace() -> None:
            await child.kill()
            await self._spawn(slot)

        task = asyncio.get_running_loop().create_task(replace())
        self._tasks.add(task)
        task.add_done_callback(self._replaced)

    def _replaced(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("could not replace a request-preparation process: %r",
                         task.exception())


def _slot_of(key: str, slots: int) -> int:
    """A stable, evenly spread slot for `key` (crc32's low bits are too regular for it)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest()) % slots


def _child_main(sock: socket.socket, blob: bytes) -> None:
    """A child: build the PromptBuilder, then run jobs until the parent goes away."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C hits the group: the gateway decides
    prompts, settings = pickle.loads(blob)
    ctx = PrepContext(prompts, settings, lambda param: _send(sock, ("note", param)))
    _send(sock, ("ready", None))
    while True:
        try:
            fn, args = _receive(sock)
        except (EOFError, OSError):
            return
        try:
            answer = ("ok", fn(ctx, *args))
        except Exception as e:  # the request's fault (GatewayError) or a bug: the parent's
            answer = ("error", e)
        try:
            _send(sock, answer)
        except (pickle.PicklingError, TypeError, AttributeError) as e:  # it does not pickle
            logger.exception("unpicklable request-preparation answer")
            _send(sock, ("error", GatewayError(500, f"internal error: {type(e).__name__}")))


def _send(sock: socket.socket, message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(len(data).to_bytes(8, "little") + data)


def _receive(sock: socket.socket) -> Any:
    size = int.from_bytes(_exactly(sock, 8), "little")
    return pickle.loads(_exactly(sock, size))


def _exactly(sock: socket.socket, size: int) -> bytearray:
    buf = bytearray(size)
    view, got = memoryview(buf), 0
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise EOFError("the gateway went away")
        got += n
    return buf
