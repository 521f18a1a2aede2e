"""Runs an LLMEngine on its own thread and bridges it to asyncio (the gRPC servers' loop).

    asyncio loop (gRPC servicers)             engine thread
    ──────────────────────────────            ──────────────────────────────────────
    generate(): call(add_request) ──cmd──▶    run commands; engine.step() while work
                await queue.get() ◀──outputs── call_soon_threadsafe(queue.put_nowait)
    abort(): call(abort_request)   ──cmd──▶   finish + free blocks, final output

Every engine method runs on the engine thread (the engine is not thread-safe); `call` runs any
function of the engine there and awaits its result. torch releases the GIL in its kernels, so
the loop stays responsive while a step runs. A step that raises fails only the requests in
it (they get a FINISHED error output); the loop keeps serving the others.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from baton.engine.llm_engine import LLMEngine
from baton.outputs import StepOutput
from baton.sampling_params import SamplingParams
from baton.worker.cpu_share import CpuShare

logger = logging.getLogger(__name__)
T = TypeVar("T")


class AsyncEngine:
    """Owns the engine thread. Use `start()` from the loop, `shutdown()` to stop."""

    def __init__(self, engine: LLMEngine, idle_wait_s: float = 0.05) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue[StepOutput]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._stop = threading.Event()
        self._idle_wait_s = idle_wait_s
        self.num_steps = 0
        # Called on the engine thread after every step (e.g. to send the KV blocks that step
        # completed); an exception it raises is logged, never fails the step's requests.
        self.after_step: Callable[[LLMEngine], None] | None = None
        # Set before start(): this worker's threads follow the other workers' load per step
        # and per layer (cpu_share.py); marked idle whenever there is nothing to step.
        self.cpu_share: CpuShare | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self.cpu_share is not None:  # also between layers: a prefill step lasts ~1 s here
            self.engine.runner.model.layer_hook = self._share_cpus
        self._thread.start()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._commands.put(lambda: None)
        self._thread.join(timeout_s)

    # ---- asyncio side --------------------------------------------------------------------
    async def call(self, fn: Callable[[LLMEngine], T], deliver: bool = False) -> T:
        """Run fn(engine) on the engine thread; return its result or raise its exception.

        deliver: fn returns a StepOutput (or None) of a streamed request, e.g. from
        RemoteKV.finish; it is delivered to its stream ahead of the outputs of any
        later step (delivering it after the await could let the next token overtake it).
        """
        assert self._loop is not None, "start() first"
        fut: asyncio.Future[T] = self._loop.create_future()

        def run() -> None:
            try:
                result: Any = fn(self.engine)
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting caller
                self._loop.call_soon_threadsafe(_set_exception, fut, exc)
            else:
                if deliver and result is not None:
                    self._loop.call_soon_threadsafe(self.deliver, [result])
                self._loop.call_soon_threadsafe(_set_result, fut, result)

        self._commands.put(run)
        return await fut

    def open_stream(self, request_id: str) -> asyncio.Queue[StepOutput]:
        """Register a queue for a request's outputs before adding it to the engine."""
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already streaming")
        q: asyncio.Queue[StepOutput] = asyncio.Queue()
        self._streams[request_id] = q
        return q

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[StepOutput]:
        """Add a request and yield its outputs until it finishes.

        Raises ValueError (bad prompt/limits) before yielding anything. If the consumer stops
        early (cancellation, disconnect) the request is aborted and its blocks freed.
        """
        q = self.open_stream(request_id)
        try:
            await self.call(lambda e: e.add_request(request_id, prompt_token_ids, params))
            async with contextlib.aclosing(self.stream(request_id, q)) as outputs:
                async for out in outputs:
                    yield out
        finally:
            self.close_stream(request_id)

    async def stream(self, request_id: str,
                     q: asyncio.Queue[StepOutput]) -> AsyncIterator[StepOutput]:
        """Yield outputs from `q` until a finished one; abort the request if left early."""
        finished = False
        try:
            while not finished:
                out = await q.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                await asyncio.shield(self.abort(request_id))

    async def abort(self, request_id: str) -> bool:
        """Abort a request in any state; True if the engine knew it."""
        out = await self.call(lambda e: e.abort_request(request_id))
        if out is not None:
            self.deliver([out])
        return out is not None

    def deliver(self, outputs: list[StepOutput]) -> None:
        """Route outputs to their streams (loop thread)."""
        for out in outputs:
            q = self._streams.get(out.request_id)
            if q is not None:
                q.put_nowait(out)

    # ---- engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            idle = not self.engine.has_unfinished_requests()
            if idle:
                if self.cpu_share is not None:
                    self.cpu_share.idle()
                self._restore_sessions()
            self._drain_commands(block=idle)
            if self._stop.is_set() or not self.engine.has_unfinished_requests():
                continue
            if self.cpu_share is not None:
                self._share_cpus()
            try:
                outputs = self.engine.step()
                self.num_steps += 1
            except Exception as exc:  # noqa: BLE001 - keep serving the other requests
                logger.exception("engine step failed")
                outputs = self._fail_running(repr(exc))
            self._after_step()
            if outputs:
                self._loop.call_soon_threadsafe(self.deliver, outputs)

    def _share_cpus(self) -> None:
        """This step's threads from the other workers' load (cpu_share.py)."""
        try:
            self.cpu_share.apply()
        except Exception:  # noqa: BLE001 - step with the threads already set
            logger.exception("cpu share failed; keeping the current threads")

    def _restore_sessions(self) -> None:
        """Idle: pinned sessions' demoted blocks back from the KV tier (cheap when none)."""
        try:
            self.engine.restore_sessions()
        except Exception:  # noqa: BLE001 - the thread must outlive any one failure
            logger.exception("restoring session blocks failed")

    def _after_step(self) -> None:
        if self.after_step is None:
            return
        try:
            self.after_step(self.engine)
        except Exception:  # noqa: BLE001 - the thread must outlive any one failure
            logger.exception("after_step hook failed")

    def _fail_running(self, error: str) -> list[StepOutput]:
        try:
            return self.engine.fail_running(error)
        except Exception:  # noqa: BLE001 - the thread must outlive any one failure
            logger.exception("failing the running requests failed")
            return []

    def _drain_commands(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=self._idle_wait_s) if block \
                else self._commands.get_nowait()
        except queue.Empty:
            return
        cmd()
        while True:
            try:
                self._commands.get_nowait()()
            except queue.Empty:
                return


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
