"""Issue 16's done-when, with the real SmolLM2-135M-Instruct in-process: the gateway (shipped
tool template, hermes parser) and one colocated decode worker, driven by the official `openai`
client. The model is tiny; with two earlier weather calls in its history (rendered by the
template as `<tool_call>` blocks) it answers a third weather question greedily with a call:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The call and a tool result sent back as the next turn reuse the cached prefix."""
from __future__ import annotations

import json

import anthropic
import openai
import pytest

from baton.models.registry import resolve_model
from gateway.config import GatewayConfig, RouterConfig
from gateway.prompts import PromptBuilder
from gateway.server import Gateway
from tests.services.helpers import BLOCK, engine_config, start_decode

pytestmark = pytest.mark.slow

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a given city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city name"}}, "required": ["city"]}}}]


def weather_call(city: str, call_id: str) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [{
        "id": call_id, "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}]}


HISTORY = [
    {"role": "user", "content": "What is the weather in Berlin?"},
    weather_call("Berlin", "call_1"),
    {"role": "tool", "tool_call_id": "call_1", "content": "12 C, cloudy"},
    {"role": "assistant", "content": "It is 12 C and cloudy in Berlin."},
    {"role": "user", "content": "And in Rome?"},
    weather_call("Rome", "call_2"),
    {"role": "tool", "tool_call_id": "call_2", "content": "25 C, sunny"},
    {"role": "assistant", "content": "It is 25 C and sunny in Rome."},
    {"role": "user", "content": "What is the weather in Paris?"},
]


@pytest.fixture(scope="module")
def smollm2():
    return resolve_model("smollm2-135m")


async def test_openai_client_gets_parsed_tool_calls_and_the_prefix_is_reused(smollm2):
    decode = await start_decode(smollm2, "grpc", None,
                                engine=engine_config(smollm2, num_blocks=512))
    prompts = PromptBuilder.from_folder(smollm2)
    assert "<tools>" in prompts.chat_template  # the shipped template, chosen by default
    gateway = Gateway(GatewayConfig(model=str(smollm2), decode=(decode.address,), port=0,
                                    poll_interval_s=0.1, router=RouterConfig()), prompts)
    await gateway.start()
    try:
        async with openai.AsyncOpenAI(base_url=gateway.http_url + "/v1", api_key="x",
                                      max_retries=0, timeout=120) as client:
            first = await client.chat.completions.create(
                model=str(smollm2), messages=HISTORY, tools=TOOLS, temperature=0,
                max_tokens=48)
            choice = first.choices[0]
            assert choice.finish_reason == "tool_calls", choice.message.content
            call = choice.message.tool_calls[0]
            assert call.function.name == "get_weather"
            assert json.loads(call.function.arguments) == {"city": "Paris"}
            nxt = [*HISTORY, choice.message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}]
            second = await client.chat.completions.with_raw_response.create(
                model=str(smollm2), messages=nxt, tools=TOOLS, temperature=0, max_tokens=16)
        assert second.status_code == 200 and "x-baton-warning" not in second.headers
        usage = second.parse().usage
        # Turn 1's prompt is a prefix of turn 2's: every full block of it is a cache hit.
        assert usage.prompt_tokens_details.cached_tokens >= \
            first.usage.prompt_tokens // BLOCK * BLOCK > 0
    finally:
        await gateway.stop()
        await decode.stop(drain_s=0)


async def test_anthropic_and_responses_clients_round_trip_a_tool_on_smollm2(smollm2):
    """Issue 25: the official `anthropic` client (tool_use → tool_result → answer) and the
    `openai` client's Responses API (function_call → function_call_output → answer) on the
    default model; the call is forced (tool_choice), so the tiny model's call is constrained
    to the hermes format and the tool's schema."""
    decode = await start_decode(smollm2, "grpc", None,
                                engine=engine_config(smollm2, num_blocks=512))
    gateway = Gateway(GatewayConfig(model=str(smollm2), decode=(decode.address,), port=0,
                                    poll_interval_s=0.1, router=RouterConfig()),
                      PromptBuilder.from_folder(smollm2))
    await gateway.start()
    fn = TOOLS[0]["function"]
    ask = "What is the weather in Paris?"
    try:
        async with anthropic.AsyncAnthropic(base_url=gateway.http_url, api_key="x",
                                            max_retries=0, timeout=120) as client:
            tools = [{"name": fn["name"], "description": fn["description"],
                      "input_schema": fn["parameters"]}]
            first = await client.messages.create(
                model=str(smollm2), max_tokens=48, tools=tools, extra_body={"temperature": 0},
                tool_choice={"type": "tool", "name": "get_weather"},
                messages=[{"role": "user", "content": ask}])
            assert first.stop_reason == "tool_use"
            use = next(b for b in first.content if b.type == "tool_use")
            assert use.name == "get_weather" and isinstance(use.input.get("city"), str)
            answer = await client.messages.create(
                model=str(smollm2), max_tokens=16, tools=tools, extra_body={"temperature": 0},
                messages=[{"role": "user", "content": ask},
                          {"role": "assistant",
                           "content": [b.model_dump(exclude_none=True) for b in first.content]},
                          {"role": "user", "content": [{"type": "tool_result",
                                                        "tool_use_id": use.id,
                                                        "content": "18 C, sunny"}]}])
            assert answer.content and answer.usage.cache_read_input_tokens > 0
        async with openai.AsyncOpenAI(base_url=gateway.http_url + "/v1", api_key="x",
                                      max_retries=0, timeout=120) as client:
            tools = [{"type": "function", **fn}]
            first = await client.responses.create(
                model=str(smollm2), input=ask, tools=tools, temperature=0, store=False,
                tool_choice={"type": "function", "name": "get_weather"},
                max_output_tokens=48)
            call = next(o for o in first.output if o.type == "function_call")
            assert call.name == "get_weather" and "city" in json.loads(call.arguments)
            answer = await client.responses.create(
                model=str(smollm2), tools=tools, temperature=0, store=False,
                max_output_tokens=16,
                input=[{"role": "user", "content": ask}, call.model_dump(exclude_none=True),
                       {"type": "function_call_output", "call_id": call.call_id,
                        "output": "18 C, sunny"}])
            assert answer.status in ("completed", "incomplete")
            assert answer.usage.input_tokens_details.cached_tokens > 0
    finally:
        await gateway.stop()
        await decode.stop(drain_s=0)
