"""ASGI pieces under the FastAPI routes: the guard in front, SSE and disconnect handling behind.

- `Guard` (the outermost middleware after CORS, whose preflights never reach it:
  gateway/http_api.py): stamps the arrival time, checks the API key (every path but the
  operators' /health, /ping, /metrics, /metrics/workers and /version, open in vLLM too, so
  a Prometheus scrape or a probe needs no key; `Authorization: Bearer KEY`, the scheme in any
  case, or Anthropic's `x-api-key: KEY`), bounds the body
  (Content-Length, and counted while it streams in), answers in the shape of the path's API
  (Anthropic's under /v1/messages, gateway/errors.py), counts
  every response by endpoint and status for /metrics, and while the gateway drains refuses
  new requests with 503 + Retry-After and counts the running ones (gateway/drain.py).
- `SSEResponse`: sends events while watching for the client to leave; when it leaves, the
  producer is cancelled and the generators are closed in order, so the decode Generate call
  is cancelled right away (not when the garbage collector gets to it). At the shutdown
  deadline it ends the stream itself with its API's error ending (`end_error`; chat and
  completions: an error event, then `data: [DONE]`); a bug in the producer ends it the same
  way.
- `until_disconnect`: the same for non-streaming requests (503 at the shutdown deadline).
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.exceptions import HTTPException
from starlette.responses import StreamingResponse

from gateway.api_key import bearer_matches
from gateway.drain import Drain, shutting_down
from gateway.errors import DONE, GatewayError, error_body_for, sse_error
from gateway.metrics import GatewayMetrics

logger = logging.getLogger(__name__)

ARRIVAL_KEY = "baton.arrival"
_ENDPOINTS = {"/v1/chat/completions", "/v1/completions", "/v1/messages",
              "/v1/messages/count_tokens", "/v1/responses", "/v1/models", "/health", "/ping",
              "/metrics", "/metrics/workers", "/tokenize", "/detokenize", "/version"}
_MODEL_CARD = "/v1/models/{id}"  # one label for every model id (ids come from clients)
# answered while draining
_NOT_DRAINED = ("/health", "/ping", "/metrics", "/metrics/workers", "/version")
_KEYLESS = _NOT_DRAINED  # answered without the API key (vLLM guards only /v1 and its siblings)


class BodyTooLarge(HTTPException):
    """Raised from `receive` while the body streams in: an HTTPException, so FastAPI's body
    reader passes it on (it turns other errors into a 400)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"Request body larger than {limit} bytes.")


class ClientGone(Exception):
    pass


class Guard:
    def __init__(self, app, api_key: str | None, max_body_bytes: int,
                 metrics: GatewayMetrics, drain: Drain) -> None:
        self.app = app
        self._key = api_key.encode() if api_key else None
        self._max_body = max_body_bytes
        self._metrics = metrics
        self._drain = drain

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope[ARRIVAL_KEY] = time.monotonic()
        path = scope["path"]
        endpoint = path if path in _ENDPOINTS else \
            _MODEL_CARD if path.startswith("/v1/models/") else "other"
        counted_send = self._counting_send(send, endpoint)
        headers = dict(scope["headers"])
        if self._key is not None and path not in _KEYLESS and not self._authorized(headers):
            return await _json(counted_send, 401, error_body_for(
                path, 401, "Incorrect or missing API key (send 'Authorization: Bearer KEY' "
                           "or 'x-api-key: KEY').", code="invalid_api_key"))
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self._max_body:
            return await _json(counted_send, 413, self.too_large_body(path))
        if path in _NOT_DRAINED:
            return await self._serve(scope, receive, counted_send)
        if self._drain.draining:
            error = shutting_down()
            return await _json(counted_send, 503, error_body_for(
                path, 503, error.message, code=error.code), error.headers())
        self._drain.enter()
        try:
            await self._serve(scope, receive, counted_send)
        finally:
            self._drain.leave()

    async def _serve(self, scope, receive, send) -> None:
        """The app; a bug's exception becomes a 500 in the path's API shape, logged, and goes
        no further: re-raised (as Starlette's ServerErrorMiddleware does after its handler
        answered), the server closed the connection, and the client's next request on it
        failed with a reset."""
        started = False

        async def tracked(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)
        try:
            await self.app(scope, self._bounded_receive(receive), tracked)
        except Exception as e:
            logger.exception("internal error on %s", scope["path"])
            if started:  # nothing more can be said on this response
                raise
            await _json(send, 500, error_body_for(scope["path"], 500,
                                                  f"internal error: {type(e).__name__}"))

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        """The key came as `Authorization: Bearer KEY` (gateway/api_key.py) or as
        `x-api-key: KEY`; compared in constant time."""
        bearer = bearer_matches(headers.get(b"authorization", b""), self._key)
        return hmac.compare_digest(headers.get(b"x-api-key", b""), self._key) or bearer

    def too_large_body(self, path: str = "") -> dict:
        """The 413 body (in the shape of `path`'s API)."""
        return error_body_for(path, 413, BodyTooLarge(self._max_body).detail,
                              code="request_too_large")

    def _bounded_receive(self, receive):
        seen = 0

        async def bounded():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self._max_body:
                    raise BodyTooLarge(self._max_body)
            return message
        return bounded

    def _counting_send(self, send, endpoint: str):
        async def counted(message):
            if message["type"] == "http.response.start":
                status = message["status"]
                self._metrics.requests.labels(endpoint, str(status)).inc()
                if status >= 400:
                    self._metrics.errors.labels(str(status), "response").inc()
            await send(message)
        return counted


async def _json(send, status: int, body: dict, headers: dict[str, str] | None = None) -> None:
    data = json.dumps(body).encode()
    extra = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(data)).encode()), *extra]})
    await send({"type": "http.response.body", "body": data})


async def wait_disconnect(receive) -> None:
    """Returns when the client has gone (the request body must have been read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(receive, work: Awaitable, expired: asyncio.Event):
    """Run `work`; if the client leaves first, cancel it and raise ClientGone; if the
    shutdown deadline (`expired`) comes first, cancel it and raise the 503 shutting_down."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_disconnect(receive))
    deadline = asyncio.ensure_future(expired.wait())
    try:
        await asyncio.wait({task, watcher, deadline}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (watcher, deadline):
            t.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, watcher, deadline, return_exceptions=True)
    if task.cancelled():
        raise shutting_down() if expired.is_set() else ClientGone()
    return task.result()


class SSEResponse(StreamingResponse):
    """text/event-stream of `events`; `closers` are async generators closed at the end, in
    order (outermost first); `on_disconnect` runs when the client left before the end;
    `expired` set (the shutdown deadline) ends the stream with an error event and [DONE];
    `headers` are added to the response's."""

    def __init__(self, events: AsyncIterator[bytes], closers: list, expired: asyncio.Event,
                 on_disconnect: Callable[[], None] = lambda: None,
                 headers: dict[str, str] | None = None,
                 end_error: Callable[[GatewayError], bytes] | None = None) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                  **(headers or {})})
        self._closers = closers
        self._expired = expired
        self._on_disconnect = on_disconnect
        self._end_error = end_error or openai_end_error
        self._completed = False

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        pump = asyncio.ensure_future(self._pump(send))
        watcher = asyncio.ensure_future(wait_disconnect(receive))
        deadline = asyncio.ensure_future(self._expired.wait())
        done: set = set()
        try:
            done, _ = await asyncio.wait({pump, watcher, deadline},
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (pump, watcher, deadline):
                t.cancel()
            await asyncio.gather(pump, watcher, deadline, return_exceptions=True)
            for gen in self._closers:
                await gen.aclose()
        if done == {deadline} and not self._completed:  # the client is still there
            await self._end_shutting_down(send)
        elif not self._completed:
            self._on_disconnect()

    async def _end_shutting_down(self, send) -> None:
        """The shutdown deadline came mid-stream: end it cleanly, never with a reset."""
        body = self._end_error(shutting_down())
        await send({"type": "http.response.body", "body": body, "more_body": False})
        self._completed = True

    async def _pump(self, send) -> None:
        try:
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except (OSError, asyncio.CancelledError):
            raise
        except Exception as e:  # a bug: tell the client instead of hanging up silently
            logger.exception("stream failed")
            error = GatewayError(500, f"internal error while streaming: {type(e).__name__}")
            await send({"type": "http.response.body", "more_body": True,
                        "body": self._end_error(error)})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        self._completed = True


def openai_end_error(error: GatewayError) -> bytes:
    """How a chat or completions stream ends on an error: the error event, then [DONE]."""
    return sse_error(error) + DONE
