"""One request's trip through the workers; both fronts (HTTP and gRPC) use it.

    stream(request):
      1. the prompt's block hashes (for KV-aware routing) came with it (gateway/prepare.py)
      2. route → decode (+ prefill) worker; with --slo-ttft-ms, predict the TTFT from their
         queues and answer 429 slo_unattainable before any work when it cannot be met
         (gateway/admission.py: Mooncake's early rejection); Generate(prompt, params,
         prefill_address)
      3. wait for the first message (a deadline for all attempts together); if the call fails
         or times out before it, try the next worker (nothing was streamed yet, so a retry is
         invisible), up to max_attempts; INVALID_ARGUMENT is the request's fault: no retry
         (a 400 naming the request's field when the worker named its own: FieldError)
      4. relay every message; a call that breaks or goes quiet after that ends each open
         completion with Finished{ERROR} (never a silent hang)
      5. closing the iterator early (the client left) cancels the Generate call, which aborts
         the request on the decode worker (and from there on prefill)
Failures before the first message raise GatewayError (HTTP status + Retry-After).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from baton.json_schema import FIELD_METADATA, STRUCTURED_OUTPUT_FIELD
from gateway.admission import SLOAdmission, Ticket
from gateway.config import GatewayConfig, PrefillModeChoice, RoutingPolicy
from gateway.errors import GatewayError
from gateway.metrics import GatewayMetrics
from gateway.router import RouteDecision, Router
from gateway.session_hints import SessionHints, request_fields
from gateway.workers import DECODE, PREFILL, Worker, WorkerPool
from protos import common_pb2, decode_pb2

_PREFILL_MODES = {PrefillModeChoice.AUTO: decode_pb2.PREFILL_MODE_AUTO,
                  PrefillModeChoice.LOCAL: decode_pb2.PREFILL_MODE_LOCAL,
                  PrefillModeChoice.REMOTE: decode_pb2.PREFILL_MODE_REMOTE}
_C = grpc.StatusCode
_CLIENT_FAULT = {_C.INVALID_ARGUMENT, _C.OUT_OF_RANGE, _C.FAILED_PRECONDITION, _C.NOT_FOUND}


@dataclass
class TokenizedRequest:
    """A templated, tokenized request ready to route."""

    request_id: str
    prompt_token_ids: list[int]
    params: common_pb2.SamplingParams
    block_hashes: list[int]  # of the prompt's full blocks, for KV-aware routing ([]: none)
    session_id: str = ""
    arrival: float = field(default_factory=time.monotonic)
    parent_session_id: str = ""  # the session that spawned this one (gateway/sessions.py)
    session_hints: SessionHints = SessionHints()  # TTL, last turn (gateway/session_hints.py)
    # The field the structured output came from (response_format.json_schema.schema, tools),
    # named when a worker refuses it (a FieldError's trailing metadata).
    structured_param: str | None = None

    @property
    def n(self) -> int:
        return max(1, self.params.n)


def tokenized_requests(prepared, request_id: str, arrival: float) -> list[TokenizedRequest]:
    """One TokenizedRequest per prompt of a front door's Prepared (gateway/front_door.py);
    several prompts get ids `<request_id>-<i>`."""
    session, many = prepared.session, len(prepared.prompts) > 1
    return [TokenizedRequest(f"{request_id}-{i}" if many else request_id, p.prompt_token_ids,
                             p.params, p.block_hashes, session.session_id, arrival,
                             session.parent_session_id, prepared.hints,
                             prepared.structured_param)
            for i, p in enumerate(prepared.prompts)]


class Dispatcher:
    def __init__(self, config: GatewayConfig, pool: WorkerPool, router: Router,
                 metrics: GatewayMetrics) -> None:
        self.config = config
        self.pool = pool
        self.router = router
        self.metrics = metrics
        self.inflight = 0
        self.admission = SLOAdmission(config.slo_ttft_ms / 1e3) \
            if config.slo_ttft_ms is not None else None

    async def stream(self, request: TokenizedRequest
                     ) -> AsyncIterator[decode_pb2.GenerateResponse]:
        """The decode worker's messages for `request` (see the module docstring)."""
        if self.inflight >= self.config.max_inflight:
            raise GatewayError(429, "too many requests in flight; retry shortly",
                               code="rate_limit_exceeded", retry_after=1)
        self.inflight += 1
        self.metrics.inflight.inc()
        call = worker = None
        admitted: list[Ticket] = []  # the admission ticket, once _start takes one
        try:
            call, worker, first, ticket = await self._start(request, admitted)
            async for msg in self._relay(request, call, worker, first, ticket):
                yield msg
        finally:
            for ticket in admitted:  # no stream, or the stream ended: nothing left queued
                self.admission.release(ticket)
            if call is not None and not call.done():
                call.cancel()
            if worker is not None:
                worker.inflight -= 1
            self.inflight -= 1
            self.metrics.inflight.dec()

    def hash_block_size(self) -> int | None:
        """The block size prompts are hashed by for routing (None: they are not; round-robin
        routing, or no worker has told its block size yet)."""
        if self.config.router.policy is RoutingPolicy.ROUND_ROBIN:
            return None
        return self.config.block_size or self.pool.block_size() or None

    # ---- before the first message --------------------------------------------------------
    async def _start(self, request: TokenizedRequest, admitted: list[Ticket]):
        hashes = request.block_hashes
        deadline = request.arrival + self.config.first_token_timeout_s
        tried: list[str] = []
        last_error: GatewayError | None = None
        ticket: Ticket | None = None
        for _ in range(self.config.max_attempts):
            decision = self.router.route(request.session_id, hashes, self.pool.views(DECODE),
                                         self.pool.views(PREFILL), time.monotonic(), tried,
                                         request.parent_session_id)
            worker = decision and self.pool.get(DECODE, decision.decode)
            if worker is None:
                break
            if not tried and self.admission is not None:
                ticket = self._admit(request, decision)  # GatewayError 429: nothing started
                admitted.append(ticket)  # released by stream() however this ends
            tried.append(decision.decode)
            self.metrics.routing.labels(self.config.router.policy.value, decision.reason).inc()
            worker.inflight += 1
            worker.started_since_stats += 1
            call = worker.stub.Generate(self._generate_request(request, decision),
                                        wait_for_ready=False)
            try:
                async with asyncio.timeout_at(_loop_deadline(deadline)):
                    first = await call.read()
                if first is not grpc.aio.EOF:
                    self.router.record(request.session_id, decision, hashes, time.monotonic())
                    return call, worker, first, ticket
                last_error = GatewayError(502, f"decode worker {worker.address} ended the "
                                          "stream without output", code="upstream_error")
            except TimeoutError:
                last_error = GatewayError(504, "no output from the decode worker within "
                                          f"{self.config.first_token_timeout_s:g} s",
                                          code="timeout")
            except grpc.aio.AioRpcError as e:
                last_error = self._rpc_error(worker, e, request)
            except BaseException:
                call.cancel()
                worker.inflight -= 1
                raise
            call.cancel()
            worker.inflight -= 1
            self.metrics.retries.labels(last_error.code or str(last_error.status)).inc()
            if last_error.status == 400 or time.monotonic() >= deadline:
                break
        if last_error is None:
            raise GatewayError(503, "no healthy decode worker", code="service_unavailable",
                               retry_after=1)
        raise last_error

    def _admit(self, request: TokenizedRequest, decision: RouteDecision) -> Ticket:
        """SLO-aware early rejection over the paths the request may prefill on."""
        block = self.config.block_size or self.pool.block_size() or 0
        uncached = max(1, len(request.prompt_token_ids) - decision.overlap_blocks * block)
        decode = self.pool.path_queue(DECODE, decision.decode)
        mode = self.config.prefill_mode
        if decision.prefill is None or mode is PrefillModeChoice.LOCAL:
            allowed = [decode]
        else:
            prefill = self.pool.path_queue(PREFILL, decision.prefill)
            allowed = [prefill] if mode is PrefillModeChoice.REMOTE else [decode, prefill]
        try:
            return self.admission.admit(uncached, allowed)
        except GatewayError:
            self.metrics.slo_rejections.inc()
            raise

    def _generate_request(self, request: TokenizedRequest,
                          decision: RouteDecision) -> decode_pb2.GenerateRequest:
        mode = self.config.prefill_mode
        req = decode_pb2.GenerateRequest(
            request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.params, session_id=request.session_id,
            **request_fields(request.session_id, request.session_hints))
        if decision.prefill is None or mode is PrefillModeChoice.LOCAL:
            req.prefill_mode = decode_pb2.PREFILL_MODE_LOCAL
        else:
            req.prefill_mode = _PREFILL_MODES[mode]
            req.prefill_address = decision.prefill
        return req

    def _rpc_error(self, worker: Worker, e: grpc.aio.AioRpcError,
                   request: TokenizedRequest) -> GatewayError:
        code, details = e.code(), e.details() or e.code().name
        if code in _CLIENT_FAULT:
            field = dict(e.trailing_metadata() or ()).get(FIELD_METADATA)
            param = request.structured_param if field == STRUCTURED_OUTPUT_FIELD else None
            return GatewayError(400, details, param=param, code="invalid_request")
        if code == _C.RESOURCE_EXHAUSTED:
            return GatewayError(429, f"decode worker overloaded: {details}",
                                code="rate_limit_exceeded", retry_after=1)
        if code == _C.DEADLINE_EXCEEDED:
            return GatewayError(504, f"decode worker timed out: {details}", code="timeout")
        if code in (_C.UNAVAILABLE, _C.CANCELLED, _C.UNIMPLEMENTED):
            self.pool.mark_failed(DECODE, worker.address, f"{code.name} {details}")
            return GatewayError(503, f"decode worker {worker.address} unavailable: {details}",
                                code="service_unavailable", retry_after=1)
        return GatewayError(502, f"decode worker failed: {code.name} {details}",
                            code="upstream_error")

    # ---- after the first message ---------------------------------------------------------
    async def _relay(self, request: TokenizedRequest, call, worker: Worker, first,
                     ticket: Ticket | None):
        open_indexes = set(range(request.n))
        last_token_at: dict[int, float] = {}
        msg = first
        try:
            while True:
                self._observe(request, msg, open_indexes, last_token_at, ticket)
                yield msg
                if not open_indexes:
                    return
                async with asyncio.timeout(self.config.stream_idle_timeout_s):
                    msg = await call.read()
                if msg is grpc.aio.EOF:
                    error = "decode worker ended the stream early"
                    break
        except TimeoutError:
            error = f"decode worker sent nothing for {self.config.stream_idle_timeout_s:g} s"
        except grpc.aio.AioRpcError as e:
            # Not marked failed here: one broken stream is not a dead worker (the poller and
            # the next call's fast UNAVAILABLE tell).
            error = f"decode worker failed mid-stream: {e.code().name} {e.details() or ''}"
        for index in sorted(open_indexes):
            yield decode_pb2.GenerateResponse(finished=decode_pb2.Finished(
                index=index, finish_reason=common_pb2.FINISH_REASON_ERROR, error=error.strip()))
        self.metrics.e2e.observe(time.monotonic() - request.arrival)

    def _observe(self, request: TokenizedRequest, msg, open_indexes: set[int],
                 last: dict[int, float], ticket: Ticket | None) -> None:
        now = time.monotonic()
        if msg.WhichOneof("kind") == "tokens":
            i = msg.tokens.index
            if not last:
                self.metrics.ttft.observe(now - request.arrival)
                if ticket is not None:
                    self.admission.release(ticket)  # prefilled: no longer queued
            elif i in last:
                self.metrics.itl.observe(now - last[i])
            last[i] = now
            return
        open_indexes.discard(msg.finished.index)
        if not open_indexes:
            self.metrics.e2e.observe(now - request.arrival)
            usage = msg.finished.usage
            self.metrics.prompt_tokens.inc(usage.prompt_tokens)
            self.metrics.cached_tokens.inc(usage.cached_tokens)
            self.metrics.count_cached_by(usage)
            self.metrics.completion_tokens.inc(usage.completion_tokens)


def _loop_deadline(deadline_monotonic: float) -> float:
    """time.monotonic() deadline → the running loop's clock (they may differ, e.g. uvloop)."""
    loop = asyncio.get_running_loop()
    return loop.time() + (deadline_monotonic - time.monotonic())
