"""The gateway's HTTP API (FastAPI): OpenAI's chat and completions (here), Anthropic's
Messages API (gateway/messages_api.py), OpenAI's Responses API (gateway/responses_api.py),
vLLM's /tokenize family, models, health, metrics, session deletion.

A request's life here:
  0. CORS (Starlette's CORSMiddleware, --allowed-origins and its siblings, outermost): a
     browser's preflight (OPTIONS, no API key) is answered here; every other answer, a 401
     included, gets the CORS headers, so a page can read it.
  1. `Guard` (gateway/asgi.py): API key, body size, arrival time.
  2. The raw body goes to the preparation pool (gateway/prep_pool.py: other processes, so
     nothing proportional to the request's size runs on this event loop): parse (bad JSON /
     types → 400 naming the field, in the shape of the path's API), the front's translation
     into one FrontRequest, then the front door (gateway/front_door.py): model check (404),
     session and hints, limits, template + tokenize, context check, SamplingParams and schema
     checks; past --prep-timeout-s a 400 naming the field it was on.
  3. Here: unknown fields logged and named in a header (gateway/ignored_fields.py); tools the
     template drops → a warning, logged once and sent as X-Baton-Warning.
  4. gateway/relay.py: a `TokenizedRequest` per prompt, `Dispatcher.stream` routes and relays
     the decode worker's messages. For a stream the first message is awaited before
     answering, so routing failures still get a real status (429/503/504 with Retry-After);
     after that, failures are the API's own error events.
  5. Client gone → the Generate call is cancelled (abort on the workers).
While the gateway drains (gateway/drain.py) new requests get 503 + Retry-After and /health
says "draining" with 503; at the shutdown deadline a running stream ends with its API's
error ending (chat and completions: an error event and [DONE]), a request not yet answered
with the same 503.
"""
from __future__ import annotations

import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from gateway.asgi import Guard
from gateway.config import GatewayConfig
from gateway.dispatch import Dispatcher
from gateway.drain import Drain, shutting_down
from gateway.errors import GatewayError, error_body_for, status_phrase
from gateway.ignored_fields import IgnoredFieldLog
from gateway.logprobs_output import token_id_text
from gateway.messages_api import MessagesRoutes
from gateway.metrics import GatewayMetrics
from gateway.prep_pool import PrepPool
from gateway.prepare import Prepared, prepare_chat, prepare_completion, validation_error
from gateway.prompts import PromptBuilder
from gateway.relay import Relay
from gateway.responses import OpenAIPresenter, OutputSpec
from gateway.responses_api import ResponsesRoutes
from gateway.session_hints import SessionRoutes
from gateway.tokenize_api import TokenizeRoutes
from gateway.worker_metrics import Target, metrics_url, scrape
from gateway.workers import DECODE, PREFILL, WorkerPool


def create_app(config: GatewayConfig, prompts: PromptBuilder, prep: PrepPool,
               dispatcher: Dispatcher, pool: WorkerPool, metrics: GatewayMetrics,
               drain: Drain) -> FastAPI:
    """The gateway's FastAPI app: CORS, then Guard, in front, the OpenAI routes, Anthropic's
    Messages API, OpenAI's Responses API, vLLM's /tokenize family, health, metrics; errors in
    the shape of each path's API."""
    app = FastAPI(title="Baton gateway", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(Guard, api_key=config.api_key, max_body_bytes=config.max_body_bytes,
                       metrics=metrics, drain=drain)
    cors = config.cors  # added last, so outermost: a preflight never meets the key check
    app.add_middleware(CORSMiddleware, allow_origins=cors.allowed_origins,
                       allow_methods=cors.allowed_methods, allow_headers=cors.allowed_headers,
                       allow_credentials=cors.allow_credentials)
    _add_error_handlers(app)
    ignored = IgnoredFieldLog()
    relay = Relay(prep, dispatcher, metrics, drain, ignored)
    routes = Routes(config, prompts, relay, pool, metrics)
    # HEAD beside GET (as Starlette's plain routes do): uptime checks and `curl -I` probe with it
    app.add_api_route("/health", routes.health, methods=["GET", "HEAD"])
    # vLLM's /ping (SageMaker's health check, GET and POST): the same answer as /health
    app.add_api_route("/ping", routes.health, methods=["GET", "HEAD", "POST"])
    app.add_api_route("/metrics", routes.metrics_text, methods=["GET", "HEAD"])
    app.add_api_route("/metrics/workers", routes.worker_metrics_text, methods=["GET", "HEAD"])
    app.add_api_route("/v1/models", routes.models, methods=["GET", "HEAD"])
    app.add_api_route("/v1/models/{model_id:path}", routes.model, methods=["GET", "HEAD"])
    app.add_api_route("/v1/chat/completions", routes.chat, methods=["POST"])
    app.add_api_route("/v1/completions", routes.completions, methods=["POST"])
    MessagesRoutes(relay, prompts).add_to(app)
    ResponsesRoutes(relay, prompts).add_to(app)
    TokenizeRoutes(prompts.max_model_len, prep, ignored, pool.kv_dtypes).add_to(app)
    SessionRoutes(dispatcher.router, pool, config.rpc_timeout_s).add_to(app)
    return app


class Routes:
    def __init__(self, config: GatewayConfig, prompts: PromptBuilder, relay: Relay,
                 pool: WorkerPool, metrics: GatewayMetrics) -> None:
        self.config = config
        self.prompts = prompts
        self.relay = relay
        self.pool = pool
        self.metrics = metrics
        self.started = int(time.time())

    async def health(self) -> JSONResponse:
        drain = self.relay.drain
        counts = {role: {"healthy": self.pool.num_healthy(role),
                         "total": len(self.pool.workers[role])} for role in (DECODE, PREFILL)}
        ok = counts[DECODE]["healthy"] > 0 and not drain.draining
        status = "draining" if drain.draining else "ok" if ok else "unavailable"
        # draining: Retry-After, as the refused requests get it (the README's promise)
        return JSONResponse({"status": status, "workers": counts},
                            status_code=200 if ok else 503,
                            headers=shutting_down().headers() if drain.draining else None)

    async def metrics_text(self) -> Response:
        """The gateway's own series, then the workers' `vllm:*` series (a `worker` and a
        `role` label on each sample: gateway/worker_metrics.py), which harnesses such as
        AgentX read from the one URL they were given."""
        for role in (DECODE, PREFILL):
            self.metrics.healthy_workers.labels(role).set(self.pool.num_healthy(role))
        workers = await scrape(self._targets(), min(self.config.rpc_timeout_s, 1.0),
                               prefix="vllm:", with_up=False)
        return Response(self.metrics.render() + workers,
                        media_type="text/plain; version=0.0.4")

    async def worker_metrics_text(self) -> Response:
        """Every worker's /metrics with `worker` and `role` labels (gateway/worker_metrics.py)."""
        body = await scrape(self._targets(), self.config.rpc_timeout_s)
        return Response(body, media_type="text/plain; version=0.0.4")

    def _targets(self) -> list[Target]:
        return [Target(role, w.address, url) for role in (DECODE, PREFILL)
                for w in self.pool.workers[role].values()
                if w.stats is not None and (url := metrics_url(w.address, w.stats.metrics_port))]

    def _model_card(self) -> dict:
        return {"id": self.config.served_model_name, "object": "model",
                "created": self.started, "owned_by": "baton", "root": self.config.model,
                "max_model_len": self.prompts.max_model_len}

    async def models(self) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, model_id: str) -> JSONResponse:
        """One model's card; 404 (OpenAI's model_not_found) for any other id."""
        if model_id not in (self.config.served_model_name, self.config.model):
            raise GatewayError(404, f"The model `{model_id}` does not exist.", param="model",
                               code="model_not_found")
        return JSONResponse(self._model_card())

    async def chat(self, request: Request):
        prepared = await self.relay.prepare(request, prepare_chat)
        return await self._run(request, prepared, "chat")

    async def completions(self, request: Request):
        prepared = await self.relay.prepare(request, prepare_completion)
        return await self._run(request, prepared, "completion")

    async def _run(self, request: Request, prepared: Prepared, kind: str):
        """Dispatch the prepared prompts; stream or collect the answer."""
        view = prepared.view
        headers = self.relay.headers(prepared, self.prompts.tools_ignored)
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        # the served name, as vLLM answers, also when the request named the model's own name
        spec = OutputSpec(kind, rid, self.config.served_model_name,
                          int(time.time()), view.n,
                          tuple(len(p.prompt_token_ids) for p in prepared.prompts),
                          view.num_logprobs, prepared.tool_parser, view.include_usage,
                          num_prompts=len(prepared.prompts), echo=view.echo,
                          echo_only=view.echo_only, prompt_logprobs=view.prompt_logprobs,
                          prompt_heads=tuple(p.prompt_token_ids[0] for p in prepared.prompts),
                          continuous_usage=view.continuous_usage, role=view.role)
        as_ids = self.config.return_tokens_as_token_ids if view.tokens_as_ids is None \
            else view.tokens_as_ids
        token_text = token_id_text(self.prompts.token_text) if as_ids else self.prompts.token_text
        presenter = OpenAIPresenter(spec, token_text)
        return await self.relay.respond(request, prepared, rid, presenter, headers)


_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


def _add_error_handlers(app: FastAPI) -> None:
    """Errors in the shape of the path's API (gateway/errors.py)."""
    @app.exception_handler(GatewayError)
    async def gateway_error(request: Request, e: GatewayError) -> JSONResponse:
        return JSONResponse(error_body_for(request.url.path, e.status, e.message, e.param,
                                           e.code), status_code=e.status, headers=e.headers())

    @app.exception_handler(RequestValidationError)
    async def validation_error_handler(request: Request, e: RequestValidationError
                                       ) -> JSONResponse:
        error = validation_error(e.errors())
        return JSONResponse(error_body_for(request.url.path, error.status, error.message,
                                           error.param, error.code), status_code=error.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        message = e.detail if isinstance(e.detail, str) else status_phrase(e.status_code)
        return JSONResponse(error_body_for(request.url.path, e.status_code, message,
                                           code=_HTTP_CODES.get(e.status_code)),
                            status_code=e.status_code, headers=e.headers)

