"""The official `openai` Python client against the gateway and a fake decode worker."""
from __future__ import annotations

import json

import openai
import pytest

from tests.gateway.conftest import MODEL, Behavior, running_gateway
from tests.gateway.test_http_api import TOOL_TOKENS, TOOLS


@pytest.fixture
async def client(prompts, fake):
    async with running_gateway(prompts, [fake], api_key="k") as gw:
        async with openai.AsyncOpenAI(base_url=gw.http_url + "/v1", api_key="k",
                                      max_retries=0, timeout=10) as c:
            yield c


async def test_chat_and_completions(client, fake):
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    r = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, seed=1,
        temperature=0, stop=["zzz"], extra_body={"top_k": 3})
    assert r.choices[0].message.content == "Hello world!"
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    assert fake.servicer.requests[-1].sampling_params.top_k == 3
    c = await client.completions.create(model=MODEL, prompt="hi", max_tokens=5)
    assert c.choices[0].text == "Hello world!" and c.usage.completion_tokens == 3


async def test_stream_with_usage_and_n2(client, fake):
    fake.servicer.behavior = Behavior(cached_tokens=8)
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True, n=2,
        stream_options={"include_usage": True})
    texts, usage = {0: "", 1: ""}, None
    async for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
        usage = chunk.usage or usage
    assert texts == {0: "Hello world!", 1: "Hello world!"}
    assert usage.completion_tokens == 6 and usage.prompt_tokens_details.cached_tokens == 8


async def test_multi_turn_with_tool_messages(client, fake):
    fake.servicer.behavior = Behavior(tokens=TOOL_TOKENS)
    first = await client.chat.completions.create(
        model=MODEL, tools=TOOLS, messages=[{"role": "user", "content": "Weather in Paris?"}])
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls"
    call = message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    fake.servicer.behavior = Behavior()
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        message.model_dump(exclude_none=True),  # content None + tool_calls as JSON strings
        {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"},
    ]
    second = await client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS)
    assert second.choices[0].message.content == "Hello world!"
    assert len(fake.servicer.requests[-1].prompt_token_ids) > \
        len(fake.servicer.requests[-2].prompt_token_ids)


async def test_errors_surface_as_openai_exceptions(client, fake):
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model="nope",
                                             messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(model=MODEL, messages=[])
    fake.servicer.behavior = Behavior(fail_after=1)
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], stream=True)
    with pytest.raises(openai.APIError):
        async for _ in stream:
            pass


async def test_wrong_key_is_authentication_error(prompts, fake):
    async with running_gateway(prompts, [fake], api_key="k") as gw:
        async with openai.AsyncOpenAI(base_url=gw.http_url + "/v1", api_key="bad",
                                      max_retries=0) as c:
            with pytest.raises(openai.AuthenticationError):
                await c.models.list()


async def test_prompt_list_penalties_and_ignored_fields_header(client, fake):
    raw = await client.completions.with_raw_response.create(
        model=MODEL, prompt=["hi", "there"], n=2, max_tokens=5, presence_penalty=0.5,
        frequency_penalty=0.25, logit_bias={"5": -100}, best_of=3,
        extra_body={"repetition_penalty": 1.1})
    c = raw.parse()
    assert [ch.index for ch in c.choices] == [0, 1, 2, 3]
    assert c.usage.completion_tokens == 12
    assert raw.headers["x-baton-ignored-fields"] == "best_of"
    sp = fake.servicer.requests[-1].sampling_params
    assert (sp.presence_penalty, sp.frequency_penalty) == (0.5, 0.25)
    assert sp.repetition_penalty == pytest.approx(1.1)
    assert [(b.token_id, b.bias) for b in sp.logit_bias] == [(5, -100.0)]
