"""The gateway's gRPC front (protos/gateway.proto): `Generate` with the HTTP API's semantics.

The serialized request goes to the preparation pool (gateway/grpc_request.py translates it,
the front door gateway/front_door.py prepares it: session, hints, limits, tokenization,
checked SamplingParams, a forced tool call's grammar) → the same `Dispatcher` as HTTP → the
decode worker's messages relayed; for a chat prompt that offers tools (tool_choice not
"none") each completion's text goes through the configured tool-call parser, as over HTTP:
the call's text leaves the TokenChunks' text_delta (their token ids stay) and each parsed
call arrives as a ToolCall message before its completion's Finished. Errors before the
first message abort the call with the status matching the HTTP one (400 →
INVALID_ARGUMENT, 404 → NOT_FOUND, 429 → RESOURCE_EXHAUSTED, 503 → UNAVAILABLE, 504 →
DEADLINE_EXCEEDED), the field at fault (the HTTP error's `param`) in the trailing metadata
`baton-field`. A stream that ends in an error (a Finished ERROR or ABORT, e.g. the decode
worker died mid-stream) relays it and then ends the call with the matching status
(INTERNAL, UNAVAILABLE), as HTTP ends it with an error event and [DONE].
A client that cancels the call cancels the decode call behind it. With an API key, every
method but the standard health service needs `authorization: Bearer KEY` metadata (as HTTP
needs the header on every path but /health): `ApiKeyInterceptor`.
The session is the request's `session_id`, else the HTTP session headers sent as metadata
(`x-session-id`, `x-dynamo-session-id`, ...; gateway/sessions.py), as is the parent session;
session hints likewise (fields, else `x-session-ttl` / `x-session-end`; session_hints.py).
"""
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable

import grpc

from baton.json_schema import FIELD_METADATA
from gateway.api_key import bearer_matches
from gateway.config import GatewayConfig
from gateway.dispatch import Dispatcher, tokenized_requests
from gateway.errors import GatewayError
from gateway.front_door import Routing
from gateway.grpc_request import prepare_grpc
from gateway.prep_pool import PrepPool
from gateway.responses import finished_error
from gateway.sessions import affinity_key
from gateway.tool_parsers import ToolParsing
from protos import decode_pb2, gateway_pb2, gateway_pb2_grpc


class GatewayServicer(gateway_pb2_grpc.GatewayServiceServicer):
    def __init__(self, config: GatewayConfig, prep: PrepPool, dispatcher: Dispatcher,
                 on_disconnect: Callable[[], None] = lambda: None) -> None:
        self._prep = prep
        self._dispatcher = dispatcher
        self._on_disconnect = on_disconnect  # a client cancelled its call (HTTP's counter)

    async def Generate(self, request: gateway_pb2.GatewayGenerateRequest, context):
        try:
            async for out in self._generate(request, context):
                yield out
        except asyncio.CancelledError:  # the client cancelled (or its deadline passed)
            self._on_disconnect()
            raise

    async def _generate(self, request: gateway_pb2.GatewayGenerateRequest, context):
        arrival = time.monotonic()
        meta = {k: v for k, v in (context.invocation_metadata() or ())
                if isinstance(v, str)}
        try:
            prepared = await self._prep.run(
                prepare_grpc, request.SerializeToString(),
                Routing(meta, self._dispatcher.hash_block_size()),
                affinity=request.session_id or affinity_key(meta.get))
        except GatewayError as e:
            await _abort(context, e)
        rid = request.request_id or f"grpc-{uuid.uuid4().hex}"
        messages = self._dispatcher.stream(tokenized_requests(prepared, rid, arrival)[0])
        parsers = _ToolCalls(prepared.tool_parser)
        failed: GatewayError | None = None
        try:
            async for msg in messages:
                for out in parsers.relay(msg):
                    yield out
                if failed is None and msg.WhichOneof("kind") == "finished":
                    failed = finished_error(msg.finished)
        except GatewayError as e:
            await _abort(context, e)
        finally:
            await messages.aclose()
        if failed is not None:  # relayed; the call ends with its status, as HTTP's [DONE]
            await context.abort(failed.grpc_code, failed.message)


class _ToolCalls:
    """The decode worker's messages → GatewayGenerateResponses, each completion's text
    through its own tool-call parser when `parser` is given (else relayed as they are)."""

    def __init__(self, parser: ToolParsing | None) -> None:
        self._parsing = parser
        self._parsers: dict = {}

    def relay(self, msg) -> list[gateway_pb2.GatewayGenerateResponse]:
        """The messages to send for one decode-worker message."""
        kind = msg.WhichOneof("kind")
        if self._parsing is None:
            return [gateway_pb2.GatewayGenerateResponse(**{kind: getattr(msg, kind)})]
        if kind == "tokens":
            chunk = msg.tokens
            parser = self._parsers.get(chunk.index)
            if parser is None:
                parser = self._parsers[chunk.index] = self._parsing.new()
            text, calls = parser.feed(chunk.text_delta)
            chunk.text_delta = text
            return [gateway_pb2.GatewayGenerateResponse(tokens=chunk),
                    *self._calls(chunk.index, calls)]
        index = msg.finished.index
        parser = self._parsers.pop(index, None)
        text, calls = parser.finish() if parser is not None else ("", [])
        out = []
        if text:
            out.append(gateway_pb2.GatewayGenerateResponse(
                tokens=decode_pb2.TokenChunk(index=index, text_delta=text)))
        return out + self._calls(index, calls) + [
            gateway_pb2.GatewayGenerateResponse(finished=msg.finished)]

    @staticmethod
    def _calls(index: int, calls) -> list[gateway_pb2.GatewayGenerateResponse]:
        return [gateway_pb2.GatewayGenerateResponse(tool_call=gateway_pb2.ToolCall(
            index=index, id=c.id, name=c.name, arguments=c.arguments)) for c in calls]


async def _abort(context, error: GatewayError) -> None:
    """End the call with the error's status; its field, if any, in the trailing metadata
    (`baton-field`, as the workers name theirs)."""
    field = ((FIELD_METADATA, error.param),) if error.param else ()
    await context.abort(error.grpc_code, error.message, trailing_metadata=field)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for any call without `authorization: Bearer KEY` metadata (the scheme
    in any case: gateway/api_key.py), except the grpc.health.v1 service (probes carry no
    key, like GET /health)."""

    _OPEN = "/grpc.health.v1.Health/"

    def __init__(self, api_key: str) -> None:
        self._key = api_key.encode()

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(self._OPEN):
            return handler
        given = dict(details.invocation_metadata or ()).get("authorization", "")
        given = given.encode() if isinstance(given, str) else given
        if bearer_matches(given, self._key):
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
