"""The gateway's gRPC front: same semantics as HTTP for gRPC clients."""
from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.gateway.conftest import MODEL, Behavior, running_gateway


@pytest.fixture
async def stub(gateway):
    async with grpc.aio.insecure_channel(gateway.grpc_address) as channel:
        yield gateway_pb2_grpc.GatewayServiceStub(channel)


async def collect(stub, request):
    return [m async for m in stub.Generate(request, timeout=5)]


async def test_text_prompt_streams_tokens_then_finished(stub, fake):
    msgs = await collect(stub, gateway_pb2.GatewayGenerateRequest(
        model=MODEL, text="Hello", session_id="s1",
        sampling_params=common_pb2.SamplingParams(n=2, temperature=0, max_tokens=3)))
    kinds = [m.WhichOneof("kind") for m in msgs]
    assert kinds.count("tokens") == 6 and kinds.count("finished") == 2
    text = "".join(m.tokens.text_delta for m in msgs if m.WhichOneof("kind") == "tokens"
                   and m.tokens.index == 0)
    assert text == "Hello world!"
    req = fake.servicer.requests[-1]
    assert req.session_id == "s1" and req.sampling_params.max_tokens == 3


async def test_chat_and_token_prompts(stub, prompts, fake):
    chat = gateway_pb2.ChatPrompt(messages=[
        gateway_pb2.ChatMessage(role="user", content="Weather?"),
        gateway_pb2.ChatMessage(role="assistant", tool_calls=[gateway_pb2.ChatToolCall(
            id="c1", name="get_weather", arguments='{"city": "Paris"}')]),
        gateway_pb2.ChatMessage(role="tool", tool_call_id="c1", content="sunny")],
        tools=[gateway_pb2.ToolDefinition(name="get_weather", parameters_json="{}")])
    await collect(stub, gateway_pb2.GatewayGenerateRequest(chat=chat))
    ids = list(fake.servicer.requests[-1].prompt_token_ids)
    assert prompts.tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
    # max_tokens unset: filled with the room left in the context
    assert fake.servicer.requests[-1].sampling_params.max_tokens == 1024 - len(ids)
    await collect(stub, gateway_pb2.GatewayGenerateRequest(
        token_ids=gateway_pb2.TokenIds(ids=[4, 5, 6])))
    assert list(fake.servicer.requests[-1].prompt_token_ids) == [4, 5, 6]


@pytest.mark.parametrize("request_kwargs,code", [
    (dict(model="other", text="x"), grpc.StatusCode.NOT_FOUND),
    (dict(text=""), grpc.StatusCode.INVALID_ARGUMENT),
    (dict(), grpc.StatusCode.INVALID_ARGUMENT),
    (dict(text="x", sampling_params=common_pb2.SamplingParams(max_tokens=10_000)),
     grpc.StatusCode.INVALID_ARGUMENT),
    (dict(text="x", sampling_params=common_pb2.SamplingParams(temperature=-1)),
     grpc.StatusCode.INVALID_ARGUMENT),
    (dict(chat=gateway_pb2.ChatPrompt()), grpc.StatusCode.INVALID_ARGUMENT),
    (dict(text="x", sampling_params=common_pb2.SamplingParams(presence_penalty=2.5)),
     grpc.StatusCode.INVALID_ARGUMENT),
    (dict(text="x", sampling_params=common_pb2.SamplingParams(
        logit_bias=[common_pb2.TokenBias(token_id=10 ** 6, bias=1.0)])),
     grpc.StatusCode.INVALID_ARGUMENT),
    (dict(text="x", sampling_params=common_pb2.SamplingParams(
        logit_bias=[common_pb2.TokenBias(token_id=5, bias=-101.0)])),
     grpc.StatusCode.INVALID_ARGUMENT),
    (dict(text="x", sampling_params=common_pb2.SamplingParams(
        structured_output=common_pb2.StructuredOutput(
            kind=common_pb2.STRUCTURED_OUTPUT_KIND_JSON_SCHEMA,
            json_schema='{"type": "objekt"}'))),
     grpc.StatusCode.INVALID_ARGUMENT),
    (dict(text="x", sampling_params=common_pb2.SamplingParams(
        structured_output=common_pb2.StructuredOutput())),
     grpc.StatusCode.INVALID_ARGUMENT),
    (dict(text="x", sampling_params=common_pb2.SamplingParams(  # the workers would refuse it
        structured_output=common_pb2.StructuredOutput(
            kind=common_pb2.STRUCTURED_OUTPUT_KIND_JSON_SCHEMA,
            json_schema='{"type": "integer", "minimum": 5, "maximum": 1}'))),
     grpc.StatusCode.INVALID_ARGUMENT),
    # what HTTP refuses: a role outside gateway.proto's, no role, a nameless tool, inf
    (dict(chat=gateway_pb2.ChatPrompt(messages=[gateway_pb2.ChatMessage(role="wizard",
                                                                        content="hi")])),
     grpc.StatusCode.INVALID_ARGUMENT),
    (dict(chat=gateway_pb2.ChatPrompt(messages=[gateway_pb2.ChatMessage(content="hi")])),
     grpc.StatusCode.INVALID_ARGUMENT),
    (dict(chat=gateway_pb2.ChatPrompt(
        messages=[gateway_pb2.ChatMessage(role="user", content="hi")],
        tools=[gateway_pb2.ToolDefinition(parameters_json='{"type": "object"}')])),
     grpc.StatusCode.INVALID_ARGUMENT),
    (dict(text="x", sampling_params=common_pb2.SamplingParams(temperature=float("inf"))),
     grpc.StatusCode.INVALID_ARGUMENT),
    (dict(chat=gateway_pb2.ChatPrompt(  # a tool's parameters must be an object schema
        messages=[gateway_pb2.ChatMessage(role="user", content="hi")],
        tools=[gateway_pb2.ToolDefinition(name="f", parameters_json='{"type": "string"}')])),
     grpc.StatusCode.INVALID_ARGUMENT),
])
async def test_bad_requests(stub, request_kwargs, code):
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await collect(stub, gateway_pb2.GatewayGenerateRequest(**request_kwargs))
    assert e.value.code() == code
    field = dict(e.value.trailing_metadata() or ()).get("baton-field")
    so = request_kwargs.get("sampling_params", common_pb2.SamplingParams()).structured_output
    if so.kind == common_pb2.STRUCTURED_OUTPUT_KIND_JSON_SCHEMA:  # a bad schema: its field
        assert field == "sampling_params.structured_output.json_schema"
    assert len(await collect(stub, gateway_pb2.GatewayGenerateRequest(text="ok"))) == 4


async def test_penalties_and_logit_bias_reach_the_worker(stub, fake):
    bias = [common_pb2.TokenBias(token_id=7, bias=-100.0), common_pb2.TokenBias(token_id=3,
                                                                             bias=2.5)]
    await collect(stub, gateway_pb2.GatewayGenerateRequest(
        text="x", sampling_params=common_pb2.SamplingParams(
            presence_penalty=0.5, frequency_penalty=-1.0, repetition_penalty=1.25,
            logit_bias=bias)))
    sp = fake.servicer.requests[-1].sampling_params
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == \
        (0.5, -1.0, 1.25)
    assert [(b.token_id, b.bias) for b in sp.logit_bias] == [(7, -100.0), (3, 2.5)]


async def test_cancel_reaches_the_decode_worker(stub, fake, gateway):
    """... and is counted as HTTP's disconnects are (baton_gateway_client_disconnects_total
    missed every gRPC cancel)."""
    fake.servicer.behavior = Behavior(tokens=tuple((i, "x") for i in range(500)),
                                      token_delay_s=0.01)
    before = gateway.metrics.disconnects._value.get()
    call = stub.Generate(gateway_pb2.GatewayGenerateRequest(text="x"), timeout=5)
    await call.read()
    call.cancel()
    for _ in range(100):
        if fake.servicer.cancelled and gateway.metrics.disconnects._value.get() > before:
            break
        await asyncio.sleep(0.01)
    assert fake.servicer.cancelled
    assert gateway.metrics.disconnects._value.get() == before + 1


async def test_mid_stream_failure_is_finished_error_then_a_status(stub, fake):
    """Every stream ends the same way (issue 27): the decode worker dies mid-stream → the
    Finished{ERROR} is relayed, then the call ends with a status (HTTP: an error event, then
    [DONE])."""
    fake.servicer.behavior = Behavior(fail_after=1)
    msgs = []
    with pytest.raises(grpc.aio.AioRpcError) as e:
        async for m in stub.Generate(gateway_pb2.GatewayGenerateRequest(text="x"), timeout=5):
            msgs.append(m)
    assert e.value.code() == grpc.StatusCode.INTERNAL and "mid-stream" in e.value.details()
    last = msgs[-1].finished
    assert last.finish_reason == common_pb2.FINISH_REASON_ERROR and "mid-stream" in last.error
    assert msgs[0].WhichOneof("kind") == "tokens"  # what came before the failure arrived


async def test_overload_maps_to_resource_exhausted(stub, fake):
    fake.servicer.behavior = Behavior(reject=grpc.StatusCode.RESOURCE_EXHAUSTED)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await collect(stub, gateway_pb2.GatewayGenerateRequest(text="x"))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_api_key_guards_the_grpc_front_but_not_its_health(prompts, fake):
    """Security: with --api-key the gRPC front wants `authorization: Bearer KEY` metadata on
    Generate (as HTTP wants the header); the standard health service stays open."""
    async with running_gateway(prompts, [fake], api_key="sekret") as gw:
        async with grpc.aio.insecure_channel(gw.grpc_address) as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            request = gateway_pb2.GatewayGenerateRequest(text="x")
            for metadata in (None, [("authorization", "Bearer wrong")],
                             [("authorization", "sekret")]):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    [m async for m in stub.Generate(request, metadata=metadata, timeout=5)]
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, metadata
            assert not fake.servicer.requests  # refused before reaching a worker
            for auth in ("Bearer sekret", "bearer sekret"):  # the scheme in any case
                msgs = [m async for m in stub.Generate(
                    request, metadata=[("authorization", auth)], timeout=5)]
                assert msgs[-1].WhichOneof("kind") == "finished"
            health = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING


async def test_oversized_message_is_refused_and_the_front_serves_on(stub, fake):
    """Security: request messages are bounded (gRPC's 4 MiB receive limit), like HTTP bodies."""
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await collect(stub, gateway_pb2.GatewayGenerateRequest(text="x" * (5 << 20)))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert not fake.servicer.requests
    assert len(await collect(stub, gateway_pb2.GatewayGenerateRequest(text="ok"))) == 4


WEATHER = gateway_pb2.ToolDefinition(
    name="get_weather", parameters_json='{"type": "object", "properties": {"city": '
                                        '{"type": "string"}}}')
TIME = gateway_pb2.ToolDefinition(name="get_time", parameters_json="{}")


def _chat(**choice) -> gateway_pb2.GatewayGenerateRequest:
    return gateway_pb2.GatewayGenerateRequest(chat=gateway_pb2.ChatPrompt(
        messages=[gateway_pb2.ChatMessage(role="user", content="Weather in Paris?")],
        tools=[WEATHER, TIME], tool_choice=gateway_pb2.ToolChoice(**choice)))


async def test_tool_calls_are_parsed_as_over_http(stub, fake):
    from tests.gateway.test_http_api import TOOL_TOKENS
    fake.servicer.behavior = Behavior(tokens=TOOL_TOKENS)
    msgs = await collect(stub, _chat())
    kinds = [m.WhichOneof("kind") for m in msgs]
    assert kinds[-1] == "finished" and kinds.count("tool_call") == 2
    text = "".join(m.tokens.text_delta for m in msgs if m.WhichOneof("kind") == "tokens")
    assert text == "Let me check."  # the calls' text is not content
    calls = [m.tool_call for m in msgs if m.WhichOneof("kind") == "tool_call"]
    assert [(c.index, c.name, c.arguments) for c in calls] == [
        (0, "get_weather", '{"city": "Paris"}'), (0, "get_time", "{}")]
    token_ids = [t for m in msgs if m.WhichOneof("kind") == "tokens" for t in m.tokens.token_ids]
    assert token_ids == [t for t, _ in TOOL_TOKENS]  # every token id still arrives
    msgs = await collect(stub, _chat(mode="none"))  # tool_choice none: the raw text
    assert "<tool_call>" in "".join(m.tokens.text_delta for m in msgs
                                    if m.WhichOneof("kind") == "tokens")
    assert not any(m.WhichOneof("kind") == "tool_call" for m in msgs)


async def test_parallel_tool_calls_false_keeps_the_first_call_over_grpc(stub, fake):
    from tests.gateway.test_http_api import TOOL_TOKENS
    fake.servicer.behavior = Behavior(tokens=TOOL_TOKENS)
    request = _chat()
    request.chat.parallel_tool_calls = False
    msgs = await collect(stub, request)
    calls = [m.tool_call.name for m in msgs if m.WhichOneof("kind") == "tool_call"]
    assert calls == ["get_weather"] and msgs[-1].WhichOneof("kind") == "finished"


async def test_forced_tool_choice_over_grpc_and_its_errors(stub, fake):
    await collect(stub, _chat(function_name="get_time"))
    so = fake.servicer.requests[-1].sampling_params.structured_output
    assert so.prefix == "<tool_call>\n" and '"const": "get_time"' in so.json_schema
    for bad in (dict(function_name="nope"), dict(mode="sometimes")):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await collect(stub, _chat(**bad))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert dict(e.value.trailing_metadata())["baton-field"] == "chat.tool_choice"


@pytest.mark.parametrize("parser,prefix,suffix,key,as_list", [
    ("hermes", "<tool_call>\n", "\n</tool_call>", "arguments", False),
    ("llama3_json", "", "", "parameters", False),
    ("mistral", "[TOOL_CALLS]", "", "arguments", True)])
async def test_a_forced_call_is_rendered_in_the_active_parsers_format(prompts, fake, parser,
                                                                      prefix, suffix, key,
                                                                      as_list):
    """The grammar of a forced call is the configured parser's format, and what it allows
    parses back into the call, on every front."""
    import json

    from gateway.tool_parsers import make_tool_parser
    async with running_gateway(prompts, [fake], tool_call_parser=parser) as gw:
        async with grpc.aio.insecure_channel(gw.grpc_address) as channel:
            await collect(gateway_pb2_grpc.GatewayServiceStub(channel),
                          _chat(function_name="get_weather"))
    so = fake.servicer.requests[-1].sampling_params.structured_output
    schema = json.loads(so.json_schema)
    call = schema["items"] if as_list else schema
    assert (so.prefix, so.suffix, as_list) == (prefix, suffix, "items" in schema)
    assert set(call["properties"]) == {"name", key}
    obj = {"name": "get_weather", key: {"city": "Paris"}}
    text = so.prefix + json.dumps([obj] if as_list else obj) + so.suffix
    p = make_tool_parser(parser)
    content, calls = p.feed(text)
    tail, more = p.finish()
    assert (content + tail).strip() == "" and [c.name for c in calls + more] == ["get_weather"]
