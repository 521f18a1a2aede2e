"""Issue 16's done-when with the real SmolLM2-135M: in-process gateway, decode and prefill
workers (gRPC transport). A json_schema answer validates on 20 prompts, json_object is
parseable, tool_choice "required" is a parsed call, remote prefill == colocated under a schema.
"""
from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import pytest
import pytest_asyncio

from baton.sampling_params import SamplingParams, StructuredOutput, StructuredOutputKind
from gateway.prompts import PromptBuilder
from gateway.server import Gateway
from protos import decode_pb2
from tests.gateway.conftest import gateway_config
from tests.services.helpers import Client, engine_config, start_decode, start_prefill

pytestmark = pytest.mark.slow

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "hobbies": {"type": "array", "maxItems": 3,
                                     "items": {"type": "string", "maxLength": 16}}},
          "required": ["name", "age", "hobbies"], "additionalProperties": False}
PEOPLE = ["a pirate", "a baker in Paris", "a retired astronaut", "a chess prodigy",
          "a beekeeper", "a jazz pianist", "a marathon runner", "a lighthouse keeper",
          "a medieval knight", "a software engineer", "a kindergarten teacher", "a botanist",
          "a deep-sea diver", "a mountain guide", "a street magician", "a violin maker",
          "a train conductor", "a tea farmer", "a museum curator", "a firefighter"]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Local time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 40}},
                   "required": ["zone"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def smollm2():
    from baton.models.registry import resolve_model
    return resolve_model("smollm2-135m")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(smollm2):
    """(gateway http url, decode server, prefill server)."""
    engine = engine_config(smollm2, block_size=16, num_blocks=512)
    prefill = await start_prefill(smollm2, "grpc", engine=engine)
    decode = await start_decode(smollm2, "grpc", prefill.address, engine=engine)
    gw = Gateway(gateway_config([decode.address], [prefill.address], model="smollm2",
                                rpc_timeout_s=5.0, first_token_timeout_s=120.0,
                                stream_idle_timeout_s=120.0),
                 PromptBuilder.from_folder(smollm2))
    await gw.start()
    yield gw.http_url, decode, prefill
    await gw.stop()
    await decode.stop(drain_s=0)
    await prefill.stop(drain_s=0)


async def _chat(url: str, content: str, **extra) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=300) as c:
        r = await c.post("/v1/chat/completions", json={
            "model": "smollm2", "messages": [{"role": "user", "content": content}],
            "temperature": 0, "max_tokens": 200, **extra})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


@pytest.mark.asyncio(loop_scope="module")
async def test_json_schema_answers_validate_on_20_prompts(stack):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                  "strict": True}}
    choices = await asyncio.gather(*[
        _chat(stack[0], f"Describe {who} as a JSON object.", response_format=fmt)
        for who in PEOPLE])
    for choice in choices:
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)


@pytest.mark.asyncio(loop_scope="module")
async def test_json_object_is_parseable(stack):
    # Greedy 135M loops on some prompts ('"fur-free-free-free": ...') until max_tokens, which
    # no grammar prevents; a mild repetition penalty lets all four close their object.
    for question in ("Give me a JSON object describing a cat.",
                     "Reply in JSON: what is the capital of France?",
                     "Return a JSON object with a city and its country.",
                     "Describe a book as JSON."):
        choice = await _chat(stack[0], question, response_format={"type": "json_object"},
                             max_tokens=300, repetition_penalty=1.1)
        assert choice["finish_reason"] == "stop", choice
        assert isinstance(json.loads(choice["message"]["content"]), dict)


@pytest.mark.asyncio(loop_scope="module")
async def test_forced_tool_calls_are_parsed(stack):
    for choice_field, names in (("required", {"get_weather", "get_time"}),
                                ({"type": "function", "function": {"name": "get_time"}},
                                 {"get_time"})):
        choice = await _chat(stack[0], "What is the weather in Paris right now?",
                             tools=[WEATHER, TIME], tool_choice=choice_field)
        assert choice["finish_reason"] == "tool_calls", choice
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] in names
        params = (WEATHER if call["function"]["name"] == "get_weather" else TIME)["function"]
        jsonschema.validate(json.loads(call["function"]["arguments"]), params["parameters"])


@pytest.mark.asyncio(loop_scope="module")
async def test_remote_prefill_equals_colocated_under_a_schema(stack, smollm2):
    _, decode, prefill = stack
    tok = PromptBuilder.from_folder(smollm2)
    client = Client(decode.address)
    spec = StructuredOutput(StructuredOutputKind.JSON_SCHEMA, json.dumps(PERSON))
    try:
        for who in PEOPLE[:3]:
            ids = tok.chat_token_ids([{"role": "user", "content": f"Describe {who} in JSON."}])
            outs = {}
            before = prefill.engine.counts().prompt_tokens
            for mode in (decode_pb2.PREFILL_MODE_REMOTE, decode_pb2.PREFILL_MODE_LOCAL):
                res = await client.generate(ids, SamplingParams(
                    temperature=0.0, max_tokens=200, structured_output=spec),
                    timeout=300, prefill_mode=mode)
                assert res.fin.finish_reason == 1, res.fin  # STOP
                outs[mode] = res.output
                jsonschema.validate(json.loads(res.text[0]), PERSON)
            assert prefill.engine.counts().prompt_tokens == before + len(ids)  # went remote
            assert outs[decode_pb2.PREFILL_MODE_LOCAL] == outs[decode_pb2.PREFILL_MODE_REMOTE]
    finally:
        await client.close()


@pytest.mark.asyncio(loop_scope="module")
async def test_a_schema_the_workers_cannot_compile_is_400(stack):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "pattern": "(?<=a)b"}}}  # valid JSON Schema; xgrammar: no lookbehind
    async with httpx.AsyncClient(base_url=stack[0], timeout=60) as c:
        r = await c.post("/v1/chat/completions", json={
            "model": "smollm2", "messages": [{"role": "user", "content": "hi"}],
            "response_format": fmt})
    assert r.status_code == 400 and "Lookbehind" in r.json()["error"]["message"], r.text
