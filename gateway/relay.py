"""What every HTTP front does once its body is prepared: dispatch, then stream or collect.

    prepared = await relay.prepare(request, job)   # job(ctx, raw, routing) in the pool
    return await relay.respond(request, prepared, rid, presenter, headers)

`respond`:
  1. one TokenizedRequest per prompt (several prompts of /v1/completions run as separate
     requests merged into one answer: gateway/batch.py), each `Dispatcher.stream`ed;
  2. a stream: the first message is awaited before any byte is sent, watching the
     connection meanwhile, so routing failures still get a real status (429/503/504 with
     Retry-After) and a client that leaves before its first token aborts the chain at once;
     then the presenter's events go out through SSEResponse (gateway/asgi.py), which ends
     the stream with the presenter's error ending at the shutdown deadline;
  3. not a stream: the presenter collects the messages into one body, the client's
     departure cancelling the work (499).
A `Presenter` is one API's output shape (chat and completions: gateway/responses.py;
Anthropic Messages: gateway/anthropic_output.py; OpenAI Responses:
gateway/responses_output.py).
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from gateway.asgi import ARRIVAL_KEY, ClientGone, SSEResponse, until_disconnect
from gateway.batch import merge_streams
from gateway.chat_templates import TOOLS_IGNORED, WARNING_HEADER, warn_tools_ignored
from gateway.dispatch import Dispatcher, tokenized_requests
from gateway.drain import Drain
from gateway.errors import GatewayError
from gateway.front_door import Prepared, Routing
from gateway.ignored_fields import IgnoredFieldLog, ignored_header
from gateway.metrics import GatewayMetrics
from gateway.prep_pool import PrepPool
from gateway.sessions import affinity_key


class Presenter(Protocol):
    """One API's output: a body, SSE events, its stream's error ending, its error events."""

    async def collect(self, messages: AsyncIterator) -> dict:
        """The whole answer as one JSON body (GatewayError on a failed request)."""

    def events(self, messages: AsyncIterator) -> AsyncIterator[bytes]:
        """The answer as SSE events, ending as the API ends streams (errors included)."""

    def end_error(self, error: GatewayError) -> bytes:
        """The bytes that end a stream with `error` (shutdown deadline, a bug)."""

    def error_code(self, event: bytes) -> str | None:
        """The error code when `event` is an error event (for the metrics), else None."""


class Relay:
    """The shared half of every HTTP front (see the module docstring)."""

    def __init__(self, prep: PrepPool, dispatcher: Dispatcher, metrics: GatewayMetrics,
                 drain: Drain, ignored: IgnoredFieldLog) -> None:
        self.prep, self.dispatcher, self.metrics = prep, dispatcher, metrics
        self.drain, self.ignored = drain, ignored

    async def prepare(self, request: Request, job: Callable[..., Any]) -> Any:
        """`job(ctx, raw body, Routing)` in the preparation pool, by the child of the
        session the headers name."""
        headers = dict(request.headers)
        raw = await request.body()
        return await self.prep.run(job, raw, Routing(headers, self.dispatcher.hash_block_size()),
                                   affinity=affinity_key(headers.get))

    @staticmethod
    def headers(prepared: Prepared, tools_ignored: bool) -> dict[str, str]:
        """The response headers every front sends: the ignored fields
        (gateway/ignored_fields.py) and, when the request's tools are dropped by the chat
        template, X-Baton-Warning (logged once)."""
        headers = ignored_header(list(prepared.ignored))
        if prepared.offered_tools and tools_ignored:
            warn_tools_ignored()
            headers[WARNING_HEADER] = TOOLS_IGNORED
        return headers

    def messages(self, request: Request, rid: str, prepared: Prepared) -> AsyncIterator:
        """The decode workers' messages for every prompt of `prepared`, as one stream."""
        arrival = request.scope.get(ARRIVAL_KEY, time.monotonic())
        jobs = tokenized_requests(prepared, rid, arrival)
        if len(jobs) == 1:
            return self.dispatcher.stream(jobs[0])
        return merge_streams([self.dispatcher.stream(j) for j in jobs], prepared.view.n)

    async def respond(self, request: Request, prepared: Prepared, rid: str,
                      presenter: Presenter, headers: dict[str, str]) -> Response:
        """Dispatch, then stream or collect (see the module docstring)."""
        self.ignored.note(request.url.path, list(prepared.ignored))
        messages = self.messages(request, rid, prepared)
        if prepared.view.stream:
            return await self._stream(request, messages, presenter, headers)
        try:
            result = await until_disconnect(request.receive, presenter.collect(messages),
                                            self.drain.expired)
        except ClientGone:
            self.metrics.disconnects.inc()
            return Response(status_code=499)
        finally:
            await messages.aclose()
        return JSONResponse(result, headers=headers)

    async def _stream(self, request: Request, messages: AsyncIterator, presenter: Presenter,
                      headers: dict[str, str]) -> Response:
        try:
            first = await until_disconnect(request.receive, anext(messages),
                                           self.drain.expired)
        except ClientGone:
            await messages.aclose()
            self.metrics.disconnects.inc()
            return Response(status_code=499)
        except BaseException:
            await messages.aclose()
            raise

        async def with_first():
            yield first
            async for msg in messages:
                yield msg

        relayed = with_first()
        sse = presenter.events(relayed)
        events = self._count_errors(sse, presenter)
        return SSEResponse(events, closers=[events, sse, relayed, messages],
                           expired=self.drain.expired, on_disconnect=self.metrics.disconnects.inc,
                           headers=headers, end_error=presenter.end_error)

    async def _count_errors(self, events: AsyncIterator[bytes], presenter: Presenter):
        async for event in events:
            code = presenter.error_code(event)
            if code is not None:
                self.metrics.errors.labels(code, "stream").inc()
            yield event

