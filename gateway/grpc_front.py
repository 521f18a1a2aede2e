"""The gateway's gRPC front (protos/gateway.proto): `Generate` with the HTTP API's semantics.

Prompt (text, token ids or chat) → token ids → checked SamplingParams (in the preparation
pool, gateway/prep_pool.py: `prepare_grpc`) → the same `Dispatcher` as HTTP → the decode
worker's messages relayed unchanged. Errors before the first message abort the call with the
status matching the HTTP one (400 → INVALID_ARGUMENT, 404 → NOT_FOUND, 429 →
RESOURCE_EXHAUSTED, 503 → UNAVAILABLE, 504 → DEADLINE_EXCEEDED), the field at fault (the
HTTP error's `param`) in the trailing metadata `baton-field`. A stream that ends in an
error (a Finished ERROR or ABORT, e.g. the decode worker died mid-stream) relays it and then
ends the call with the matching status (INTERNAL, UNAVAILABLE), as HTTP ends it with an
error event and [DONE].
A client that cancels the call cancels the decode call behind it. With an API key, every
method but the standard health service needs `authorization: Bearer KEY` metadata (as HTTP
needs the header on every path but /health): `ApiKeyInterceptor`.
The session is the request's `session_id`, else the HTTP session headers sent as metadata
(`x-session-id`, `x-dynamo-session-id`, ...; gateway/sessions.py), as is the parent session;
session hints likewise (fields, else `x-session-ttl` / `x-session-end`; session_hints.py).
"""
from __future__ import annotations

import hmac
import json
import time
import uuid

import grpc

from baton.json_schema import FIELD_METADATA
from baton.worker.wire import sampling_params_from_proto
from gateway.config import GatewayConfig
from gateway.dispatch import Dispatcher, TokenizedRequest
from gateway.errors import GatewayError, RequestError
from gateway.limits import RequestLimits
from gateway.prep_pool import PrepContext, PrepPool
from gateway.prompts import PromptError
from gateway.responses import finished_error
from gateway.session_hints import SessionHints, parse_session_hints
from gateway.sessions import session_keys
from gateway.structured import SchemaChecker, check_proto, object_schema
from protos import common_pb2, gateway_pb2, gateway_pb2_grpc


class GatewayServicer(gateway_pb2_grpc.GatewayServiceServicer):
    def __init__(self, config: GatewayConfig, prep: PrepPool, dispatcher: Dispatcher) -> None:
        self._models = {config.served_model_name, config.model}
        self._prep = prep
        self._dispatcher = dispatcher

    async def Generate(self, request: gateway_pb2.GatewayGenerateRequest, context):
        arrival = time.monotonic()
        if request.model and request.model not in self._models:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"The model `{request.model}` does not exist.")
        meta = {k: v for k, v in (context.invocation_metadata() or ())
                if isinstance(v, str)}
        keys = session_keys(meta.get)
        session_id = request.session_id or keys.session_id
        try:
            hints = _hints(request, meta.get, session_id)
            ids, params, hashes = await self._prep.run(
                prepare_grpc, request.SerializeToString(), self._dispatcher.hash_block_size(),
                session_id, affinity=session_id or None)
        except GatewayError as e:
            await _abort(context, e)
        job = TokenizedRequest(request.request_id or f"grpc-{uuid.uuid4().hex}", ids, params,
                               hashes, session_id, arrival, keys.parent_session_id, hints,
                               "sampling_params.structured_output")
        messages = self._dispatcher.stream(job)
        failed: GatewayError | None = None
        try:
            async for msg in messages:
                yield msg
                if failed is None and msg.WhichOneof("kind") == "finished":
                    failed = finished_error(msg.finished)
        except GatewayError as e:
            await _abort(context, e)
        finally:
            await messages.aclose()
        if failed is not None:  # relayed; the call ends with its status, as HTTP's [DONE]
            await context.abort(failed.grpc_code, failed.message)


def prepare_grpc(ctx: PrepContext, data: bytes, block_size: int | None, session_id: str
                 ) -> tuple[list[int], common_pb2.SamplingParams, list[int]]:
    """A serialized GatewayGenerateRequest → (prompt token ids, checked SamplingParams, block
    hashes by `block_size` or []), in the preparation pool; GatewayError 400 naming the
    field."""
    request = gateway_pb2.GatewayGenerateRequest.FromString(data)
    try:
        ids = _prompt_ids(ctx, request)
        params = checked_params(request.sampling_params, len(ids), ctx.prompts.max_model_len,
                                ctx.prompts.vocab_size, SchemaChecker(ctx.settings.limits,
                                                                      ctx.note))
    except (PromptError, RequestError) as e:
        raise GatewayError(400, str(e), param=e.param, code="invalid_request") from e
    except ValueError as e:
        raise GatewayError(400, str(e), code="invalid_request") from e
    hashes = ctx.hashes.hashes(ids, block_size, session_id) if block_size else []
    return ids, params, hashes


def _prompt_ids(ctx: PrepContext, request: gateway_pb2.GatewayGenerateRequest) -> list[int]:
    kind = request.WhichOneof("prompt")
    ctx.note(kind or "prompt")
    if kind == "text":
        return ctx.prompts.text_token_ids(request.text)
    if kind == "token_ids":
        return ctx.prompts.check_token_ids(list(request.token_ids.ids))
    if kind == "chat":
        ctx.settings.limits.check_tools(len(request.chat.tools))
        return ctx.prompts.chat_token_ids(
            [_message(m) for m in request.chat.messages],
            [_tool(t, i, ctx.settings.limits) for i, t in enumerate(request.chat.tools)]
            or None)
    raise PromptError("a prompt is required (text, token_ids or chat)")


async def _abort(context, error: GatewayError) -> None:
    """End the call with the error's status; its field, if any, in the trailing metadata
    (`baton-field`, as the workers name theirs)."""
    field = ((FIELD_METADATA, error.param),) if error.param else ()
    await context.abort(error.grpc_code, error.message, trailing_metadata=field)


def _hints(request: gateway_pb2.GatewayGenerateRequest, get, session_id: str) -> SessionHints:
    """Session hints from the request's fields, else its metadata. GatewayError 400."""
    ttl = request.session_ttl_seconds if request.HasField("session_ttl_seconds") else None
    hints = parse_session_hints(get, ttl, session_id)
    if request.session_end and not session_id:
        raise GatewayError(400, "session_end needs a session id", param="session_end")
    return hints._replace(end=True) if request.session_end else hints


def checked_params(p: common_pb2.SamplingParams, prompt_len: int, max_model_len: int,
                   vocab_size: int, checker: SchemaChecker) -> common_pb2.SamplingParams:
    """Validate as the workers will (baton/worker/wire.py; ValueError), check logit_bias ids
    against the vocabulary and a structured output's schema (gateway/structured.py), and
    fill max_tokens from the room left."""
    room = max_model_len - prompt_len
    if room < 1 or (p.HasField("max_tokens") and p.max_tokens > room):
        raise ValueError(f"This model's maximum context length is {max_model_len} tokens; "
                         f"the prompt has {prompt_len}"
                         + (f" and max_tokens is {p.max_tokens}" if p.HasField("max_tokens")
                            else ""))
    sampling_params_from_proto(p, max_tokens=p.max_tokens if p.HasField("max_tokens") else room)
    bad = next((b.token_id for b in p.logit_bias if not 0 <= b.token_id < vocab_size), None)
    if bad is not None:
        raise ValueError(f"logit_bias token id {bad} is outside the vocabulary [0, {vocab_size})")
    if p.HasField("structured_output"):
        check_proto(p.structured_output, checker)
    out = common_pb2.SamplingParams()
    out.CopyFrom(p)
    if not out.HasField("max_tokens"):
        out.max_tokens = room
    return out


def _message(m: gateway_pb2.ChatMessage) -> dict:
    out: dict = {"role": m.role, "content": m.content if m.HasField("content") else None}
    if m.name:
        out["name"] = m.name
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.name, "arguments": c.arguments}}
                             for c in m.tool_calls]
    return out


def _tool(t: gateway_pb2.ToolDefinition, index: int, limits: RequestLimits) -> dict:
    param = f"chat.tools[{index}].parameters_json"
    try:
        parameters = json.loads(t.parameters_json) if t.parameters_json else {}
    except json.JSONDecodeError as e:
        raise PromptError(f"tool {t.name!r}: parameters_json is not JSON: {e}", param) from e
    limits.schema_text(object_schema(parameters, param), param)
    return {"type": "function", "function": {"name": t.name, "description": t.description,
                                             "parameters": parameters}}


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for any call without `authorization: Bearer KEY` metadata, except the
    grpc.health.v1 service (probes carry no key, like GET /health)."""

    _OPEN = "/grpc.health.v1.Health/"

    def __init__(self, api_key: str) -> None:
        self._expected = f"Bearer {api_key}".encode()

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(self._OPEN):
            return handler
        given = dict(details.invocation_metadata or ()).get("authorization", "")
        given = given.encode() if isinstance(given, str) else given
        if hmac.compare_digest(given, self._expected):
            return handler
        return _refusing(handler)


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that only refuses the call."""

    async def refuse(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                            "Incorrect or missing API key (send 'authorization: Bearer KEY' "
                            "metadata).")

    make = _HANDLERS[bool(handler.request_streaming), bool(handler.response_streaming)]
    return make(refuse, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


_HANDLERS = {(False, False): grpc.unary_unary_rpc_method_handler,
             (False, True): grpc.unary_stream_rpc_method_handler,
             (True, False): grpc.stream_unary_rpc_method_handler,
             (True, True): grpc.stream_stream_rpc_method_handler}
