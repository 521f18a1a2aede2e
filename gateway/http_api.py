"""The OpenAI-compatible HTTP API (FastAPI).

A request's life here:
  1. `Guard` (gateway/asgi.py): API key, body size, arrival time.
  2. FastAPI + pydantic parse the body (bad JSON / types → 400 in OpenAI's error shape).
  3. model check (404); unknown fields logged and named in a header (gateway/ignored_fields.py);
     template + tokenize (gateway/prompts.py; tools the template drops → a warning, logged
     once and sent as X-Baton-Warning), context check (400), SamplingParams
     (gateway/protocol.py) → a `TokenizedRequest` per prompt (several prompts in
     /v1/completions run as separate requests merged into one answer: gateway/batch.py).
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
import functools
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.asgi import ARRIVAL_KEY, ClientGone, Guard, SSEResponse, until_disconnect
from gateway.batch import merge_streams, prompt_list
from gateway.chat_templates import TOOLS_IGNORED, WARNING_HEADER, warn_tools_ignored
from gateway.config import GatewayConfig
from gateway.dispatch import Dispatcher, TokenizedRequest
from gateway.drain import Drain
from gateway.errors import GatewayError, error_body, require_model, status_phrase
from gateway.ignored_fields import IgnoredFieldLog, ignored_fields, ignored_header
from gateway.metrics import GatewayMetrics
from gateway.prompts import PromptBuilder, PromptError, off_loop_if_large
from gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    to_sampling_params,
)
from gateway.responses import OutputSpec, collect, sse_events
from gateway.session_hints import SessionRoutes, parse_session_hints
from gateway.sessions import session_keys
from gateway.tokenize_api import TokenizeRoutes
from gateway.tool_parsers import TOOL_PARSERS
from gateway.worker_metrics import Target, metrics_url, scrape
from gateway.workers import DECODE, PREFILL, WorkerPool


def create_app(config: GatewayConfig, prompts: PromptBuilder, dispatcher: Dispatcher,
               pool: WorkerPool, metrics: GatewayMetrics, drain: Drain) -> FastAPI:
    """The gateway's FastAPI app: Guard in front, the OpenAI routes, vLLM's /tokenize family,
    health, metrics; errors in OpenAI's shape."""
    app = FastAPI(title="Baton gateway", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(Guard, api_key=config.api_key, max_body_bytes=config.max_body_bytes,
                       metrics=metrics, drain=drain)
    _add_error_handlers(app)
    ignored = IgnoredFieldLog()
    routes = Routes(config, prompts, dispatcher, pool, metrics, drain, ignored)
    app.add_api_route("/health", routes.health, methods=["GET"])
    app.add_api_route("/metrics", routes.metrics_text, methods=["GET"])
    app.add_api_route("/metrics/workers", routes.worker_metrics_text, methods=["GET"])
    app.add_api_route("/v1/models", routes.models, methods=["GET"])
    app.add_api_route("/v1/chat/completions", routes.chat, methods=["POST"])
    app.add_api_route("/v1/completions", routes.completions, methods=["POST"])
    TokenizeRoutes(prompts, routes.model_names, ignored, pool.kv_dtypes).add_to(app)
    SessionRoutes(dispatcher.router, pool, config.rpc_timeout_s).add_to(app)
    return app


class Routes:
    def __init__(self, config: GatewayConfig, prompts: PromptBuilder, dispatcher: Dispatcher,
                 pool: WorkerPool, metrics: GatewayMetrics, drain: Drain,
                 ignored: IgnoredFieldLog) -> None:
        self.config = config
        self.prompts = prompts
        self.dispatcher = dispatcher
        self.pool = pool
        self.metrics = metrics
        self.drain = drain
        self.ignored = ignored
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

    async def worker_metrics_text(self) -> Response:
        """Every worker's /metrics with `worker` and `role` labels (gateway/worker_metrics.py)."""
        targets = [Target(role, w.address, url) for role in (DECODE, PREFILL)
                   for w in self.pool.workers[role].values()
                   if w.stats is not None
                   and (url := metrics_url(w.address, w.stats.metrics_port))]
        body = await scrape(targets, self.config.rpc_timeout_s)
        return Response(body, media_type="text/plain; version=0.0.4")

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
        parser = self.config.tool_call_parser if body.parse_tool_calls else None
        if parser and TOOL_PARSERS[parser].special_markers:
            body.skip_special_tokens = False  # else the format's marker never reaches the parser
        warning = None
        if tools and self.prompts.tools_ignored:
            warn_tools_ignored()
            warning = TOOLS_IGNORED
        return await self._run(request, body, "chat", [lambda: self.prompts.chat_token_ids(
            messages, tools, body.add_generation_prompt)], size, parser, warning)

    async def completions(self, body: CompletionRequest, request: Request):
        try:
            prompts = prompt_list(body.prompt)
        except RequestError as e:
            raise GatewayError(400, str(e), param=e.param, code="invalid_request") from e
        size = sum(len(p) for p in prompts if isinstance(p, str))
        return await self._run(request, body, "completion",
                               [functools.partial(self._completion_ids, p) for p in prompts],
                               size)

    def _completion_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.prompts.text_token_ids(prompt)
        return self.prompts.check_token_ids(list(prompt))

    async def _run(self, request: Request, body, kind: str, ids_fns: list, size: int,
                   tool_parser: str | None = None, warning: str | None = None):
        """Template/tokenize each prompt, check, dispatch; stream or collect the answer."""
        require_model(body.model, self.model_names)
        ignored = sorted(ignored_fields(body, stream_options=body.stream_options)
                         + body.unenforced_fields)
        self.ignored.note(request.url.path, ignored)
        headers = ignored_header(ignored) | ({WARNING_HEADER: warning} if warning else {})
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        jobs = await off_loop_if_large(size, self._jobs, request, body, rid, ids_fns)
        spec = OutputSpec(kind, rid, body.model, int(time.time()), body.n,
                          sum(len(j.prompt_token_ids) for j in jobs), body.num_logprobs,
                          tool_parser, body.include_usage, num_prompts=len(jobs))
        messages = self.dispatcher.stream(jobs[0]) if len(jobs) == 1 else merge_streams(
            [self.dispatcher.stream(j) for j in jobs], body.n)
        if body.stream:
            return await _stream(request, spec, messages, self.prompts, self.metrics,
                                 self.drain.expired, headers)
        try:
            result = await until_disconnect(request.receive,
                                            collect(spec, messages, self.prompts.token_text),
                                            self.drain.expired)
        except ClientGone:
            self.metrics.disconnects.inc()
            return Response(status_code=499)
        finally:
            await messages.aclose()
        return JSONResponse(result, headers=headers)

    def _jobs(self, request: Request, body, rid: str, ids_fns: list) -> list[TokenizedRequest]:
        """One TokenizedRequest per prompt (GatewayError 400 naming the prompt and field)."""
        arrival = request.scope.get(ARRIVAL_KEY, time.monotonic())
        session = session_keys(request.headers.get, body.user)
        hints = parse_session_hints(request.headers.get, body.kv_retention, session.session_id)
        jobs = []
        for i, ids_fn in enumerate(ids_fns):
            try:
                ids = ids_fn()
                params = to_sampling_params(body, body.num_logprobs, len(ids),
                                            self.prompts.max_model_len, self.prompts.vocab_size)
            except (PromptError, RequestError) as e:
                where = f"prompt {i}: " if len(ids_fns) > 1 else ""
                raise GatewayError(400, where + str(e), param=e.param,
                                   code="invalid_request") from e
            jobs.append(TokenizedRequest(rid if len(ids_fns) == 1 else f"{rid}-{i}", ids,
                                         params, session.session_id, arrival,
                                         session.parent_session_id, hints))
        return jobs


async def _stream(request: Request, spec: OutputSpec, messages: AsyncIterator,
                  prompts: PromptBuilder, metrics: GatewayMetrics, expired: asyncio.Event,
                  headers: dict[str, str]):
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
                       on_disconnect=metrics.disconnects.inc, headers=headers)


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
