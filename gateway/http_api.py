"""The OpenAI-compatible HTTP API (FastAPI).

A request's life here:
  1. `Guard` (gateway/asgi.py): API key, body size, arrival time.
  2. FastAPI + pydantic parse the body (bad JSON / types → 400 in OpenAI's error shape).
  3. model check (404), template + tokenize (gateway/prompts.py), context check (400),
     SamplingParams (gateway/protocol.py) → a `TokenizedRequest`.
  4. `Dispatcher.stream(job)` routes and relays the decode worker's messages. For a stream the
     first message is awaited before answering, so routing failures still get a real status
     (429/503/504 with Retry-After); after that, failures are SSE error events.
  5. Client gone → the Generate call is cancelled (abort on the workers).
While the gateway drains (gateway/drain.py) new requests get 503 + Retry-After and /health
says "draining" with 503; at the shutdown deadline a running stream ends with an error event
and [DONE], a request not yet answered with the same 503.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.asgi import ARRIVAL_KEY, ClientGone, Guard, SSEResponse, until_disconnect
from gateway.config import GatewayConfig
from gateway.dispatch import Dispatcher, TokenizedRequest
from gateway.drain import Drain
from gateway.errors import GatewayError, error_body, status_phrase
from gateway.metrics import GatewayMetrics
from gateway.prompts import PromptBuilder, PromptError
from gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    to_sampling_params,
)
from gateway.responses import OutputSpec, collect, sse_events
from gateway.workers import DECODE, PREFILL, WorkerPool

# Prompts longer than this (characters) are templated and tokenized on a thread, so one huge
# agent context does not stall every other stream on the event loop.
_THREAD_TOKENIZE_CHARS = 16_384


def create_app(config: GatewayConfig, prompts: PromptBuilder, dispatcher: Dispatcher,
               pool: WorkerPool, metrics: GatewayMetrics, drain: Drain) -> FastAPI:
    """The FastAPI app: Guard in front, the routes, errors in OpenAI's shape."""
    app = FastAPI(title="Baton gateway", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(Guard, api_key=config.api_key, max_body_bytes=config.max_body_bytes,
                       metrics=metrics, drain=drain)
    _add_error_handlers(app)
    routes = Routes(config, prompts, dispatcher, pool, metrics, drain)
    app.add_api_route("/health", routes.health, methods=["GET"])
    app.add_api_route("/metrics", routes.metrics_text, methods=["GET"])
    app.add_api_route("/v1/models", routes.models, methods=["GET"])
    app.add_api_route("/v1/chat/completions", routes.chat, methods=["POST"])
    app.add_api_route("/v1/completions", routes.completions, methods=["POST"])
    return app


class Routes:
    def __init__(self, config: GatewayConfig, prompts: PromptBuilder, dispatcher: Dispatcher,
                 pool: WorkerPool, metrics: GatewayMetrics, drain: Drain) -> None:
        self.config = config
        self.prompts = prompts
        self.dispatcher = dispatcher
        self.pool = pool
        self.metrics = metrics
        self.drain = drain
        self.started = int(time.time())
        self.model_names = {config.served_model_name, config.model}

    async def health(self) -> JSONResponse:
        counts = {role: {"healthy": self.pool.num_healthy(role),
                         "total": len(self.pool.workers[role])} for role in (DECODE, PREFILL)}
        ok = counts[DECODE]["healthy"] > 0 and not self.drain.draining
        status = "draining" if self.drain.draining else "ok" if ok else "unavailable"
        return JSONResponse({"status": status, "workers": counts},
                            status_code=200 if ok else 503)

    async def metrics_text(self) -> Response:
        for role in (DECODE, PREFILL):
            self.metrics.healthy_workers.labels(role).set(self.pool.num_healthy(role))
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")

    async def models(self) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{
            "id": self.config.served_model_name, "object": "model", "created": self.started,
            "owned_by": "baton", "root": self.config.model,
            "max_model_len": self.prompts.max_model_len}]})

    async def chat(self, body: ChatCompletionRequest, request: Request):
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        size = sum(len(m.get("content") or "") if isinstance(m.get("content"), str) else 1024
                   for m in messages)
        return await self._run(request, body, "chat", lambda: self.prompts.chat_token_ids(
            messages, tools, body.add_generation_prompt), size, body.parse_tool_calls)

    async def completions(self, body: CompletionRequest, request: Request):
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise GatewayError(400, "batched prompts are not supported; send one prompt "
                                   "per request", param="prompt", code="invalid_request")
            prompt = prompt[0]
        if isinstance(prompt, str):
            return await self._run(request, body, "completion",
                                   lambda: self.prompts.text_token_ids(prompt), len(prompt))
        return await self._run(request, body, "completion",
                               lambda: self.prompts.check_token_ids(list(prompt)), 0)

    async def _run(self, request: Request, body, kind: str, ids_fn, size: int,
                   parse_tools: bool = False):
        """Template/tokenize, check, dispatch; stream or collect the answer."""
        arrival = request.scope.get(ARRIVAL_KEY, time.monotonic())
        if body.model not in self.model_names:
            raise GatewayError(404, f"The model `{body.model}` does not exist.", param="model",
                               code="model_not_found")
        max_len = self.prompts.max_model_len
        try:
            ids = await asyncio.to_thread(ids_fn) if size > _THREAD_TOKENIZE_CHARS else ids_fn()
            params = to_sampling_params(body, body.num_logprobs, len(ids), max_len)
        except (PromptError, RequestError) as e:
            raise GatewayError(400, str(e), param=e.param, code="invalid_request") from e
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        headers = request.headers
        session = headers.get("x-session-id") or headers.get("x-correlation-id") or body.user
        spec = OutputSpec(kind, rid, body.model, int(time.time()), body.n, len(ids),
                          body.num_logprobs, parse_tools, body.include_usage)
        messages = self.dispatcher.stream(
            TokenizedRequest(rid, ids, params, session or "", arrival))
        if body.stream:
            return await _stream(request, spec, messages, self.prompts, self.metrics,
                                 self.drain.expired)
        try:
            result = await until_disconnect(request.receive,
                                            collect(spec, messages, self.prompts.token_text),
                                            self.drain.expired)
        except ClientGone:
            self.metrics.disconnects.inc()
            return Response(status_code=499)
        finally:
            await messages.aclose()
        return JSONResponse(result)


async def _stream(request: Request, spec: OutputSpec, messages: AsyncIterator,
                  prompts: PromptBuilder, metrics: GatewayMetrics, expired: asyncio.Event):
    """SSE of the request's messages. The first message is awaited before any byte is sent
    (routing errors become a plain HTTP error), watching the connection meanwhile: a client
    that leaves before its first token aborts the chain (decode, and prefill from there)
    at once, not after the whole prompt was prefilled and sent."""
    try:
        first = await until_disconnect(request.receive, anext(messages), expired)
    except ClientGone:
        await messages.aclose()
        metrics.disconnects.inc()
        return Response(status_code=499)
    except BaseException:
        await messages.aclose()
        raise

    async def with_first():
        yield first
        async for msg in messages:
            yield msg

    relayed = with_first()
    sse = sse_events(spec, relayed, prompts.token_text)
    events = _count_stream_errors(sse, metrics)
    return SSEResponse(events, closers=[events, sse, relayed, messages], expired=expired,
                       on_disconnect=metrics.disconnects.inc)


async def _count_stream_errors(events: AsyncIterator[bytes], metrics: GatewayMetrics):
    async for event in events:
        if event.startswith(b'data: {"error"'):
            status = json.loads(event[len(b"data: "):])["error"].get("code") or "error"
            metrics.errors.labels(status, "stream").inc()
        yield event


_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(GatewayError)
    async def gateway_error(request: Request, e: GatewayError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers())

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        errors = e.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            message, param = "Request body is not valid JSON.", None
        else:
            param = ".".join(loc) or None
            message = f"{first.get('msg', 'invalid request')}" + (f" ({param})" if param else "")
        return JSONResponse(error_body(400, message, param, "invalid_request"), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        message = e.detail if isinstance(e.detail, str) else status_phrase(e.status_code)
        return JSONResponse(error_body(e.status_code, message, code=_HTTP_CODES.get(
            e.status_code)), status_code=e.status_code, headers=e.headers)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        return JSONResponse(error_body(500, f"internal error: {type(e).__name__}"),
                            status_code=500)
