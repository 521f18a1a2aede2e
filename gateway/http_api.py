"""The OpenAI-compatible HTTP API (FastAPI).

A request's life here:
  1. `Guard` (gateway/asgi.py): API key, body size, arrival time.
  2. The raw body goes to the preparation pool (gateway/prep_pool.py: other processes, so
     nothing proportional to the request's size runs on this event loop): parse (bad JSON /
     types → 400 in OpenAI's error shape, naming the field), model check (404), limits,
     template + tokenize, context check, SamplingParams and schema checks
     (gateway/prepare.py); past --prep-timeout-s a 400 naming the field it was on.
  3. Here: unknown fields logged and named in a header (gateway/ignored_fields.py); tools the
     template drops → a warning, logged once and sent as X-Baton-Warning; a
     `TokenizedRequest` per prompt (several prompts in /v1/completions run as separate
     requests merged into one answer: gateway/batch.py).
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
from gateway.batch import merge_streams
from gateway.chat_templates import TOOLS_IGNORED, WARNING_HEADER, warn_tools_ignored
from gateway.config import GatewayConfig
from gateway.dispatch import Dispatcher, TokenizedRequest
from gateway.drain import Drain
from gateway.errors import GatewayError, error_body, status_phrase
from gateway.ignored_fields import IgnoredFieldLog, ignored_header
from gateway.metrics import GatewayMetrics
from gateway.prep_pool import PrepPool
from gateway.prepare import Prepared, Routing, prepare_chat, prepare_completion, validation_error
from gateway.prompts import PromptBuilder
from gateway.responses import OutputSpec, collect, sse_events
from gateway.session_hints import SessionRoutes
from gateway.sessions import session_keys
from gateway.tokenize_api import TokenizeRoutes
from gateway.worker_metrics import Target, metrics_url, scrape
from gateway.workers import DECODE, PREFILL, WorkerPool


def create_app(config: GatewayConfig, prompts: PromptBuilder, prep: PrepPool,
               dispatcher: Dispatcher, pool: WorkerPool, metrics: GatewayMetrics,
               drain: Drain) -> FastAPI:
    """The gateway's FastAPI app: Guard in front, the OpenAI routes, vLLM's /tokenize family,
    health, metrics; errors in OpenAI's shape."""
    app = FastAPI(title="Baton gateway", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(Guard, api_key=config.api_key, max_body_bytes=config.max_body_bytes,
                       metrics=metrics, drain=drain)
    _add_error_handlers(app)
    ignored = IgnoredFieldLog()
    routes = Routes(config, prompts, prep, dispatcher, pool, metrics, drain, ignored)
    app.add_api_route("/health", routes.health, methods=["GET"])
    app.add_api_route("/metrics", routes.metrics_text, methods=["GET"])
    app.add_api_route("/metrics/workers", routes.worker_metrics_text, methods=["GET"])
    app.add_api_route("/v1/models", routes.models, methods=["GET"])
    app.add_api_route("/v1/chat/completions", routes.chat, methods=["POST"])
    app.add_api_route("/v1/completions", routes.completions, methods=["POST"])
    TokenizeRoutes(prompts.max_model_len, prep, ignored, pool.kv_dtypes).add_to(app)
    SessionRoutes(dispatcher.router, pool, config.rpc_timeout_s).add_to(app)
    return app


class Routes:
    def __init__(self, config: GatewayConfig, prompts: PromptBuilder, prep: PrepPool,
                 dispatcher: Dispatcher, pool: WorkerPool, metrics: GatewayMetrics,
                 drain: Drain, ignored: IgnoredFieldLog) -> None:
        self.config = config
        self.prompts = prompts
        self.prep = prep
        self.dispatcher = dispatcher
        self.pool = pool
        self.metrics = metrics
        self.drain = drain
        self.ignored = ignored
        self.started = int(time.time())

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

    async def chat(self, request: Request):
        prepared = await self._prepare(request, prepare_chat)
        warning = None
        if prepared.offered_tools and self.prompts.tools_ignored:
            warn_tools_ignored()
            warning = TOOLS_IGNORED
        return await self._run(request, prepared, "chat", warning)

    async def completions(self, request: Request):
        prepared = await self._prepare(request, prepare_completion)
        return await self._run(request, prepared, "completion")

    async def _prepare(self, request: Request, job) -> Prepared:
        """`job` (gateway/prepare.py) on the body in the preparation pool, by the child of
        the session its headers name."""
        headers = dict(request.headers)
        raw = await request.body()
        return await self.prep.run(job, raw, Routing(headers, self.dispatcher.hash_block_size()),
                                   affinity=session_keys(headers.get).session_id or None)

    async def _run(self, request: Request, prepared: Prepared, kind: str,
                   warning: str | None = None):
        """Dispatch the prepared prompts; stream or collect the answer."""
        view = prepared.view
        self.ignored.note(request.url.path, list(prepared.ignored))
        headers = ignored_header(list(prepared.ignored)) | (
            {WARNING_HEADER: warning} if warning else {})
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        jobs = _jobs(request, rid, prepared)
        spec = OutputSpec(kind, rid, view.model, int(time.time()), view.n,
                          sum(len(j.prompt_token_ids) for j in jobs), view.num_logprobs,
                          prepared.tool_parser, view.include_usage, num_prompts=len(jobs))
        messages = self.dispatcher.stream(jobs[0]) if len(jobs) == 1 else merge_streams(
            [self.dispatcher.stream(j) for j in jobs], view.n)
        if view.stream:
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



def _jobs(request: Request, rid: str, prepared: Prepared) -> list[TokenizedRequest]:
    """One TokenizedRequest per prepared prompt."""
    arrival = request.scope.get(ARRIVAL_KEY, time.monotonic())
    session, many = prepared.session, len(prepared.prompts) > 1
    return [TokenizedRequest(f"{rid}-{i}" if many else rid, p.prompt_token_ids, p.params,
                             p.block_hashes, session.session_id, arrival,
                             session.parent_session_id, prepared.hints,
                             prepared.structured_param)
            for i, p in enumerate(prepared.prompts)]


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
    async def validation_error_handler(request: Request, e: RequestValidationError
                                       ) -> JSONResponse:
        error = validation_error(e.errors())
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        message = e.detail if isinstance(e.detail, str) else status_phrase(e.status_code)
        return JSONResponse(error_body(e.status_code, message, code=_HTTP_CODES.get(
            e.status_code)), status_code=e.status_code, headers=e.headers)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        return JSONResponse(error_body(500, f"internal error: {type(e).__name__}"),
                            status_code=500)
