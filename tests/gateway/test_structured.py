"""Structured outputs at the gateway (fake decode worker): response_format and a forced
tool_choice reach the worker as a StructuredOutput; bad schemas are a 400."""
from __future__ import annotations

import json

import grpc
import jsonschema
import pytest

from baton.json_schema import STRUCTURED_OUTPUT_FIELD
from protos import common_pb2
from tests.gateway.conftest import MODEL, Behavior
from tests.gateway.test_http_api import CHAT, post

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "get_time"}}]


async def _structured(gateway, fake, path, body):
    r = await post(gateway, path, body)
    assert r.status_code == 200, r.text
    sp = fake.servicer.requests[-1].sampling_params
    return sp.structured_output if sp.HasField("structured_output") else None


async def test_response_format_reaches_the_worker(gateway, fake):
    chat = "/v1/chat/completions"
    assert await _structured(gateway, fake, chat, CHAT) is None
    assert await _structured(gateway, fake, chat, {**CHAT, "response_format": {
        "type": "text"}}) is None
    so = await _structured(gateway, fake, chat, {**CHAT, "response_format": {
        "type": "json_object"}})
    assert so.kind == common_pb2.STRUCTURED_OUTPUT_KIND_JSON_OBJECT and not so.json_schema
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA,
                                                  "strict": True}}
    for path, body in ((chat, CHAT), ("/v1/completions", {"model": MODEL, "prompt": "x"})):
        so = await _structured(gateway, fake, path, {**body, "response_format": fmt})
        assert so.kind == common_pb2.STRUCTURED_OUTPUT_KIND_JSON_SCHEMA
        assert json.loads(so.json_schema) == SCHEMA and not so.prefix


async def test_forced_tool_choice_is_a_hermes_call_of_the_tools(gateway, fake):
    chat = {**CHAT, "tools": TOOLS, "response_format": {"type": "json_object"}}
    so = await _structured(gateway, fake, "/v1/chat/completions",
                           {**chat, "tool_choice": "required"})
    assert (so.prefix, so.suffix) == ("<tool_call>\n", "\n</tool_call>")
    schema = json.loads(so.json_schema)
    call = {"name": "get_weather", "arguments": {"city": "Paris"}}
    jsonschema.validate(call, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "nope", "arguments": {}}, schema)
    so = await _structured(gateway, fake, "/v1/chat/completions", {**chat, "tool_choice": {
        "type": "function", "function": {"name": "get_time"}}})
    schema = json.loads(so.json_schema)
    jsonschema.validate({"name": "get_time", "arguments": {}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(call, schema)
    for choice in ("auto", "none"):  # not forced: response_format applies
        so = await _structured(gateway, fake, "/v1/chat/completions",
                               {**chat, "tool_choice": choice})
        assert so.kind == common_pb2.STRUCTURED_OUTPUT_KIND_JSON_OBJECT


def _fmt(schema) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                       "schema": schema}}}


SCHEMA_PARAM = "response_format.json_schema.schema"


@pytest.mark.parametrize("extra,param", [
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema"),
    (_fmt({"type": "objekt"}), SCHEMA_PARAM),
    (_fmt({"properties": {"a": {"minimum": "zero"}}}), SCHEMA_PARAM),
    # valid under the meta-schema, refused by the workers' grammar converter (issue 27)
    (_fmt({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}),
     SCHEMA_PARAM),
    (_fmt({"type": "integer", "minimum": 5, "maximum": 1}), SCHEMA_PARAM),
    (_fmt({"enum": []}), SCHEMA_PARAM),
    (_fmt({"type": "string", "pattern": "(?<=a)b"}), SCHEMA_PARAM),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": [TOOLS[1], {"type": "function", "function": {
        "name": "bad", "parameters": {"type": "object", "properties": {
            "n": {"type": "integer", "minimum": 3, "maximum": 2}}}}}],
      "tool_choice": "required"}, "tools[1].function.parameters"),
    # parameters must be an object schema, forced or not (else `arguments` is no object)
    ({"tools": [TOOLS[1], {"type": "function", "function": {
        "name": "s", "parameters": {"type": "string"}}}]}, "tools[1].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "s", "parameters": [1]}}]},
     "tools[0].function.parameters"),
])
async def test_bad_structured_requests_are_400(gateway, fake, extra, param):
    r = await post(gateway, "/v1/chat/completions", {**CHAT, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert not fake.servicer.requests


@pytest.mark.parametrize("extra,param", [
    (_fmt(SCHEMA), SCHEMA_PARAM),
    ({"tools": TOOLS, "tool_choice": "required"}, "tools"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
])
async def test_a_schema_a_worker_refuses_is_a_400_naming_the_field(gateway, fake, extra,
                                                                   param):
    """Whichever process finds the fault (issue 27): a worker that refuses the structured
    output names its own field (`baton-field` metadata) and the gateway names the request's."""
    fake.servicer.behavior = Behavior(reject=grpc.StatusCode.INVALID_ARGUMENT,
                                      reject_field=STRUCTURED_OUTPUT_FIELD)
    r = await post(gateway, "/v1/chat/completions", {**CHAT, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    fake.servicer.behavior = Behavior(reject=grpc.StatusCode.INVALID_ARGUMENT)
    r = await post(gateway, "/v1/chat/completions", {**CHAT, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] is None  # no field named


async def test_vllm_structured_outputs_json_kinds_reach_the_worker(gateway, fake):
    """vLLM's `structured_outputs` was accepted and dropped (named only in a header): a
    migrating user's constraint silently did nothing. Its JSON kinds are now enforced like
    response_format, on chat and completions; a schema may come as JSON text, as in vLLM."""
    for path, body in (("/v1/chat/completions", CHAT),
                       ("/v1/completions", {"model": MODEL, "prompt": "x"})):
        for schema in (SCHEMA, json.dumps(SCHEMA)):
            so = await _structured(gateway, fake, path,
                                   {**body, "structured_outputs": {"json": schema}})
            assert so.kind == common_pb2.STRUCTURED_OUTPUT_KIND_JSON_SCHEMA
            assert json.loads(so.json_schema) == SCHEMA
        so = await _structured(gateway, fake, path,
                               {**body, "structured_outputs": {"json_object": True}})
        assert so.kind == common_pb2.STRUCTURED_OUTPUT_KIND_JSON_OBJECT
        assert await _structured(gateway, fake, path, {**body, "structured_outputs": None,
                                                       "allowed_token_ids": None,
                                                       "bad_words": []}) is None


@pytest.mark.parametrize("extra,param", [
    ({"structured_outputs": {"choice": ["yes", "no"]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": "[0-9]{3}"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "root ::= \"a\""}}, "structured_outputs.grammar"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"json": SCHEMA, "json_object": True}}, "structured_outputs"),
    ({"structured_outputs": "json"}, "structured_outputs"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": SCHEMA}, "response_format": {"type": "json_object"}},
     "structured_outputs"),
    ({"structured_outputs": {"json": {"type": "nonsense"}}}, "structured_outputs.json"),
    ({"allowed_token_ids": [33, 34]}, "allowed_token_ids"),
    ({"bad_words": ["Yes"]}, "bad_words"),
    ({"guided_choice": ["a", "b"]}, "guided_choice"),
    ({"use_beam_search": True}, "use_beam_search"),
    ({"seed": 1 << 64}, "seed"),
])
async def test_vllm_constraints_baton_does_not_enforce_are_400(gateway, fake, extra, param):
    """Each of these was a 200 whose output ignored the constraint (or, for the seed, a
    silent wrap-around that vLLM refuses)."""
    for path, body in (("/v1/chat/completions", CHAT),
                       ("/v1/completions", {"model": MODEL, "prompt": "x"})):
        r = await post(gateway, path, {**body, **extra})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.text
        if param == "use_beam_search":  # not the structured outputs' explanation
            assert "no beam search" in r.json()["error"]["message"], r.text
    assert not fake.servicer.requests
