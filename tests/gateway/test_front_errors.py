"""Bad input on /v1/messages and /v1/responses: the chat path's bad-input set (test_errors.py),
translated into each API's wire shape, plus each API's own faults. Every request gets that
API's error shape (Anthropic's `{"type": "error", "error": {"type", "message"}}`, OpenAI's
`{"error": {"message", "type", "param", "code"}}`) naming the field, nothing reaches the
worker, and the server keeps serving."""
from __future__ import annotations

import httpx
import pytest

from tests.gateway.conftest import MODEL
from tests.gateway.test_errors import LONG

ASK = [{"role": "user", "content": "Hi"}]
MSG = {"model": MODEL, "max_tokens": 8, "messages": ASK}
RESP = {"model": MODEL, "input": "Hi"}
RAW = {"content-type": "application/json"}
TOOL = {"name": "f", "input_schema": {"type": "object", "properties": {}}}
FUNC = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}


def deep(levels: int) -> dict:
    schema: dict = {"type": "object"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


M, C, R = "/v1/messages", "/v1/messages/count_tokens", "/v1/responses"
BAD = [
    # (name, path, body or raw bytes, headers, status, param)
    ("malformed json", M, b'{"model": "tiny", "messages": [', RAW, 400, None),
    ("body not an object", M, b"[1, 2]", RAW, 400, None),
    ("missing messages", M, {"model": MODEL, "max_tokens": 8}, {}, 400, "messages"),
    ("missing max_tokens", M, {"model": MODEL, "messages": ASK}, {}, 400, "max_tokens"),
    ("wrong type", M, {**MSG, "max_tokens": "many"}, {}, 400, "max_tokens"),
    ("bad role", M, {**MSG, "messages": [{"role": "wizard", "content": "x"}]}, {}, 400,
     "messages"),
    ("empty messages", M, {**MSG, "messages": []}, {}, 400, "messages"),
    ("temperature above 1", M, {**MSG, "temperature": 1.5}, {}, 400, "temperature"),
    ("top_p 0", M, {**MSG, "top_p": 0}, {}, 400, "top_p"),
    ("negative top_k", M, {**MSG, "top_k": -3}, {}, 400, "top_k"),
    ("empty stop sequence", M, {**MSG, "stop_sequences": [""]}, {}, 400, "stop_sequences"),
    ("65 stop sequences", M, {**MSG, "stop_sequences": ["s"] * 65}, {}, 400,
     "stop_sequences"),
    ("image content", M, {**MSG, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "AA"}}]}]}, {}, 400, "messages[0].content[0]"),
    ("image in a tool result", M, {**MSG, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image"}]}]}]}, {},
     400, "messages[0].content[0].content[0]"),
    ("system block not text", M, {**MSG, "system": [{"type": "image"}]}, {}, 400, "system[0]"),
    ("unknown model", M, {**MSG, "model": "claude-9"}, {}, 404, "model"),
    ("model is a path", M, {**MSG, "model": "/etc/passwd"}, {}, 404, "model"),
    ("prompt over context", M, {**MSG, "messages": [{"role": "user", "content": LONG}]}, {},
     400, None),
    # past the context it is cut to the room left (Claude Code's 32,000): test_messages_api
    ("max_tokens 0", M, {**MSG, "max_tokens": 0}, {}, 400, "max_tokens"),
    ("server tool", M, {**MSG, "tools": [{"type": "web_search_20250305", "name": "w"}]}, {},
     400, "tools[0].type"),
    ("input_schema not an object schema", M, {**MSG, "tools": [
        {"name": "f", "input_schema": {"type": "string"}}]}, {}, 400, "tools[0].input_schema"),
    ("input_schema too deep", M, {**MSG, "tools": [{"name": "f", "input_schema": deep(40)}]},
     {}, 400, "tools[0].input_schema"),
    ("257 tools", M, {**MSG, "tools": [TOOL] * 257}, {}, 400, "tools"),
    ("tool_choice tool without a name", M, {**MSG, "tools": [TOOL],
                                            "tool_choice": {"type": "tool"}}, {}, 400,
     "tool_choice.name"),
    ("tool_choice names no tool", M, {**MSG, "tools": [TOOL], "tool_choice": {
        "type": "tool", "name": "g"}}, {}, 400, "tool_choice"),
    ("tool_choice any without tools", M, {**MSG, "tool_choice": {"type": "any"}}, {}, 400,
     "tool_choice"),
    ("invalid output schema", M, {**MSG, "output_config": {"format": {
        "type": "json_schema", "schema": {"type": "objekt"}}}}, {}, 400,
     "output_config.format.schema"),
    ("bad session TTL", M, MSG, {"X-Session-ID": "s", "X-Session-TTL": "soon"}, 400,
     "X-Session-TTL"),
    ("stream with a bad field", M, {**MSG, "stream": True, "top_p": 7}, {}, 400, "top_p"),
    ("count_tokens unknown model", C, {**MSG, "model": "claude-9"}, {}, 404, "model"),
    ("count_tokens empty messages", C, {"model": MODEL, "messages": []}, {}, 400, "messages"),
    ("unknown route under messages", "/v1/messages/batches", MSG, {}, 404, None),
    ("responses: malformed json", R, b'{"model": "tiny", "input": [', RAW, 400, None),
    ("responses: body not an object", R, b'"hi"', RAW, 400, None),
    ("responses: missing input", R, {"model": MODEL}, {}, 400, "input"),
    ("responses: wrong type", R, {**RESP, "max_output_tokens": "many"}, {}, 400,
     "max_output_tokens"),
    ("responses: max_output_tokens 0", R, {**RESP, "max_output_tokens": 0}, {}, 400,
     "max_output_tokens"),
    ("responses: empty input", R, {**RESP, "input": []}, {}, 400, "input"),
    ("responses: bad role", R, {**RESP, "input": [{"role": "wizard", "content": "x"}]}, {},
     400, "input[0].role"),
    ("responses: image", R, {**RESP, "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "http://x/y.png"}]}]}, {}, 400,
     "input[0].content[0]"),
    ("responses: unknown item", R, {**RESP, "input": [{"type": "computer_call"}]}, {}, 400,
     "input[0]"),
    ("responses: output without call_id", R, {**RESP, "input": [
        {"type": "function_call_output", "output": "x"}]}, {}, 400, "input[0]"),
    ("responses: item reference", R, {**RESP, "input": [
        {"type": "item_reference", "id": "msg_1"}]}, {}, 400, "input[0]"),
    ("responses: negative temperature", R, {**RESP, "temperature": -1}, {}, 400,
     "temperature"),
    ("responses: top_p 0", R, {**RESP, "top_p": 0}, {}, 400, "top_p"),
    ("responses: unknown model", R, {**RESP, "model": "gpt-9"}, {}, 404, "model"),
    ("responses: input over context", R, {**RESP, "input": LONG}, {}, 400, None),
    ("responses: max_output_tokens over context", R, {**RESP, "max_output_tokens": 5000}, {},
     400, "max_output_tokens"),
    ("responses: web search tool", R, {**RESP, "tools": [{"type": "web_search"}]}, {}, 400,
     "tools[0]"),
    ("responses: parameters not an object schema", R, {**RESP, "tools": [
        {**FUNC, "parameters": {"type": "array"}}]}, {}, 400, "tools[0].parameters"),
    ("responses: tool_choice names no tool", R, {**RESP, "tools": [FUNC], "tool_choice": {
        "type": "function", "name": "g"}}, {}, 400, "tool_choice"),
    ("responses: bad tool_choice", R, {**RESP, "tools": [FUNC], "tool_choice": {
        "type": "file_search"}}, {}, 400, "tool_choice"),
    ("responses: json_schema without schema", R, {**RESP, "text": {"format": {
        "type": "json_schema", "name": "x"}}}, {}, 400, "text.format.schema"),
    ("responses: invalid schema", R, {**RESP, "text": {"format": {
        "type": "json_schema", "name": "x", "schema": {"type": "objekt"}}}}, {}, 400,
     "text.format.schema"),
    ("responses: store true", R, {**RESP, "store": True}, {}, 400, "store"),
    ("responses: previous_response_id", R, {**RESP, "previous_response_id": "resp_1"}, {},
     400, "previous_response_id"),
    ("responses: stream with a bad field", R, {**RESP, "stream": True, "top_p": 7}, {}, 400,
     "top_p"),
]


def _check_shape(path: str, body: dict, param: str | None) -> None:
    if path.startswith("/v1/messages"):
        assert set(body) == {"type", "error"} and body["type"] == "error", body
        assert set(body["error"]) == {"type", "message"} and body["error"]["message"]
        if param is not None:
            assert param in body["error"]["message"], body
        return
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] is not None and error["param"].startswith(param), error


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
async def test_bad_input_gets_the_apis_error_shape_and_the_server_serves_on(gateway, fake,
                                                                           case):
    name, path, body, headers, status, param = case
    async with httpx.AsyncClient(base_url=gateway.http_url, timeout=10) as c:
        kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
        r = await c.post(path, headers=headers, **kwargs)
        assert r.status_code == status, r.text
        _check_shape(path, r.json(), param)
        for ok_path, ok_body in ((M, MSG), (R, RESP)):
            assert (await c.post(ok_path, json=ok_body)).status_code == 200
    assert len(fake.servicer.requests) == 2  # no bad request reached the worker


async def test_wrong_method_and_missing_key_in_each_shape(prompts, fake):
    from tests.gateway.conftest import running_gateway
    async with running_gateway(prompts, [fake], api_key="k") as gw, \
            httpx.AsyncClient(base_url=gw.http_url, timeout=10) as c:
        for path in (M, R):
            r = await c.post(path, json=MSG)
            assert r.status_code == 401
            _check_shape(path, r.json(), None)
            r = await c.get(path, headers={"x-api-key": "k"})
            assert r.status_code == 405
            _check_shape(path, r.json(), None)
        assert (await c.post(M, json=MSG, headers={"x-api-key": "k"})).status_code == 200
