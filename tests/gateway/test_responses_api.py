"""OpenAI's Responses API (stateless): the official `openai` client's `responses.create` and
`responses.stream` against the gateway and a fake decode worker."""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.gateway.conftest import MODEL, Behavior, running_gateway
from tests.gateway.test_http_api import TOOL_TOKENS

TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                         "required": ["city"], "additionalProperties": False}},
         {"type": "function", "name": "get_time", "parameters": {"type": "object",
                                                                  "properties": {}}}]
PERSON = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture
async def gw(prompts, fake):
    async with running_gateway(prompts, [fake], api_key="k") as gw:
        yield gw


@pytest.fixture
async def client(gw):
    async with openai.AsyncOpenAI(base_url=gw.http_url + "/v1", api_key="k", max_retries=0,
                                  timeout=10) as c:
        yield c


async def test_text_create_and_stream(client, fake):
    fake.servicer.behavior = Behavior(cached_tokens=4)
    r = await client.responses.create(model=MODEL, input="Hi", instructions="Be brief.",
                                      max_output_tokens=8, temperature=0.5, top_p=0.9,
                                      store=False)
    assert r.object == "response" and r.status == "completed" and r.id.startswith("resp_")
    assert r.output_text == "Hello world!"
    req = fake.servicer.requests[-1]
    assert r.usage.input_tokens == len(req.prompt_token_ids)
    assert r.usage.input_tokens_details.cached_tokens == 4 and r.usage.output_tokens == 3
    assert req.sampling_params.max_tokens == 8
    assert req.sampling_params.temperature == pytest.approx(0.5)
    async with client.responses.stream(model=MODEL, input=[
            {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}]) as stream:
        deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
        final = await stream.get_final_response()
    assert "".join(deltas) == "Hello world!" == final.output_text
    assert final.usage.input_tokens_details.cached_tokens == 4


async def test_max_output_tokens_reached_is_incomplete(client):
    """The response and the message item it cut are both "incomplete" (OpenAI's item
    status; the item said "completed"), streamed too."""
    r = await client.responses.create(model=MODEL, input="Hi", max_output_tokens=1)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [item.status for item in r.output] == ["incomplete"]
    events = [e async for e in await client.responses.create(
        model=MODEL, input="Hi", max_output_tokens=1, stream=True)]
    done = [e.item.status for e in events if e.type == "response.output_item.done"]
    assert done == ["incomplete"] and events[-1].type == "response.incomplete"
    assert [item.status for item in events[-1].response.output] == ["incomplete"]


@pytest.mark.parametrize("stream", [False, True])
async def test_function_call_round_trip(client, fake, stream):
    fake.servicer.behavior = Behavior(tokens=TOOL_TOKENS)
    kwargs = dict(model=MODEL, input=[{"role": "user", "content": "Weather in Paris?"}],
                  tools=TOOLS)
    if stream:
        async with client.responses.stream(**kwargs) as s:
            names = [e.type async for e in s]
            first = await s.get_final_response()
        assert names.count("response.function_call_arguments.delta") == 2
    else:
        first = await client.responses.create(**kwargs)
    kinds = [item.type for item in first.output]
    assert kinds == ["message", "function_call", "function_call"]
    assert first.output_text == "Let me check."
    call = first.output[1]
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    fake.servicer.behavior = Behavior()
    history = [*kwargs["input"], *[item.model_dump(exclude_none=True) for item in first.output],
               {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"},
               {"type": "function_call_output", "call_id": first.output[2].call_id,
                "output": "12:00"}]
    second = await client.responses.create(model=MODEL, input=history, tools=TOOLS)
    assert second.output_text == "Hello world!"
    text = fake.servicer.requests[-1]
    assert len(text.prompt_token_ids) > len(fake.servicer.requests[-2].prompt_token_ids)


async def test_forced_tool_choice_and_json_schema_reach_the_worker(client, fake):
    await client.responses.create(model=MODEL, input="Weather?", tools=TOOLS,
                                  tool_choice={"type": "function", "name": "get_time"})
    so = fake.servicer.requests[-1].sampling_params.structured_output
    assert so.prefix == "<tool_call>\n"
    assert json.loads(so.json_schema)["properties"]["name"] == {"const": "get_time"}
    answer = '{"name": "Ada", "age": 36}'
    fake.servicer.behavior = Behavior(tokens=((40, answer),))
    r = await client.responses.create(model=MODEL, input="A person?", text={"format": {
        "type": "json_schema", "name": "person", "schema": PERSON, "strict": True}})
    so = fake.servicer.requests[-1].sampling_params.structured_output
    assert json.loads(so.json_schema) == PERSON
    jsonschema.validate(json.loads(r.output_text), PERSON)


async def test_stateless_fields_and_errors_are_openai_errors(client, fake):
    for extra in ({"store": True}, {"previous_response_id": "resp_1"},
                  {"conversation": "conv_1"}):
        with pytest.raises(openai.BadRequestError) as e:
            await client.responses.create(model=MODEL, input="Hi", **extra)
        assert "stateless" in e.value.body["message"]
        assert e.value.body["param"] == next(iter(extra))
    with pytest.raises(openai.NotFoundError):
        await client.responses.create(model="gpt-9", input="Hi")
    with pytest.raises(openai.BadRequestError) as e:
        await client.responses.create(model=MODEL, input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "http://x/y.png"}]}])
    assert e.value.body["param"] == "input[0].content[0]"
    assert len(fake.servicer.requests) == 0
    fake.servicer.behavior = Behavior(fail_after=1)
    async with client.responses.stream(model=MODEL, input="Hi") as s:
        kinds = [e.type async for e in s]
    assert kinds[-1] == "response.failed"


async def test_codex_session_headers_and_prompt_cache_key(gw, client, fake):
    await client.responses.create(model=MODEL, input="Hi", prompt_cache_key="conv-9")
    assert fake.servicer.requests[-1].session_id == "conv-9"
    await client.responses.create(model=MODEL, input="Hi", prompt_cache_key="conv-9",
                                  extra_headers={"session-id": "s1", "thread-id": "t1"})
    assert fake.servicer.requests[-1].session_id == "t1"
    async with httpx.AsyncClient(base_url=gw.http_url, headers={"authorization": "Bearer k"}) as c:
        r = await c.post("/v1/responses", json={"model": MODEL, "input": "Hi",
                                                 "reasoning": {"effort": "low"}})
    assert r.headers["x-baton-ignored-fields"] == "reasoning"


@pytest.mark.parametrize("stream", [False, True])
async def test_the_response_repeats_the_requests_tools_and_settings(client, stream):
    """As OpenAI (and vLLM) do, a Response repeats the request's tools, instructions,
    metadata, parallel_tool_calls and text format (clients read them back from it)."""
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    kwargs = dict(model=MODEL, input="Hi", tools=TOOLS, instructions="Be brief.",
                  metadata={"run": "7"}, parallel_tool_calls=False, text={"format": fmt})
    if stream:
        async with client.responses.stream(**kwargs) as s:
            created = [e.response async for e in s if e.type == "response.created"][0]
            r = await s.get_final_response()
        assert created.tools == r.tools and created.instructions == "Be brief."
    else:
        r = await client.responses.create(**kwargs)
    assert [t.model_dump(exclude_none=True) for t in r.tools] == TOOLS
    assert r.instructions == "Be brief." and r.metadata == {"run": "7"}
    assert r.parallel_tool_calls is False
    assert r.text.format.model_dump(exclude_none=True, by_alias=True) == fmt
    plain = await client.responses.create(model=MODEL, input="Hi")
    assert plain.tools == [] and plain.instructions is None and plain.metadata == {}
    assert plain.parallel_tool_calls is True and plain.text.format.type == "text"
