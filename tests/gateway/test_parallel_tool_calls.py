"""`parallel_tool_calls: false` (chat, Responses) and Anthropic's `disable_parallel_tool_use`:
the model wrote two calls (TOOL_TOKENS: get_weather then get_time); only the first is
returned, streamed or not, and the answer still ends as a tool call. They were accepted and
both calls returned (the chat field was named ignored in X-Baton-Ignored-Fields)."""
from __future__ import annotations

import json

import pytest

from tests.gateway.conftest import MODEL, Behavior
from tests.gateway.test_http_api import CHAT, TOOL_TOKENS, TOOLS, post, sse_data

ANTHROPIC_TOOLS = [{"name": "get_weather", "input_schema": {"type": "object"}},
                   {"name": "get_time", "input_schema": {"type": "object"}}]
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "parameters": {}},
                   {"type": "function", "name": "get_time", "parameters": {}}]


def _events(text: str) -> list[dict]:
    """The JSON of every `data:` line of an Anthropic or Responses stream (no [DONE])."""
    return [json.loads(line[len("data: "):]) for line in text.splitlines()
            if line.startswith("data: ")]


@pytest.mark.parametrize("parallel,names", [(False, ["get_weather"]),
                                            (True, ["get_weather", "get_time"]),
                                            (None, ["get_weather", "get_time"])])
@pytest.mark.parametrize("stream", [False, True])
async def test_chat(gateway, fake, parallel, names, stream):
    fake.servicer.behavior = Behavior(tokens=TOOL_TOKENS)
    body = {**CHAT, "tools": TOOLS, "stream": stream}
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    r = await post(gateway, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    assert "parallel_tool_calls" not in r.headers.get("x-baton-ignored-fields", "")
    if stream:
        chunks = sse_data(r.text)
        calls = [t for c in chunks for t in c["choices"][0]["delta"].get("tool_calls", [])]
        assert [(t["index"], t["function"]["name"]) for t in calls] == list(enumerate(names))
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
        content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    else:
        choice = r.json()["choices"][0]
        assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == names
        assert choice["finish_reason"] == "tool_calls"
        content = choice["message"]["content"]
    assert content == "Let me check."  # content is kept, the dropped call's text is not


@pytest.mark.parametrize("disable,names", [(True, ["get_weather"]),
                                           (False, ["get_weather", "get_time"])])
@pytest.mark.parametrize("stream", [False, True])
async def test_anthropic_disable_parallel_tool_use(gateway, fake, disable, names, stream):
    fake.servicer.behavior = Behavior(tokens=TOOL_TOKENS)
    r = await post(gateway, "/v1/messages", {
        "model": MODEL, "max_tokens": 64, "stream": stream, "tools": ANTHROPIC_TOOLS,
        "tool_choice": {"type": "auto", "disable_parallel_tool_use": disable},
        "messages": [{"role": "user", "content": "Weather and time in Paris?"}]})
    assert r.status_code == 200, r.text
    if stream:
        events = _events(r.text)
        used = [e["content_block"]["name"] for e in events
                if e["type"] == "content_block_start" and e["content_block"]["type"] ==
                "tool_use"]
        stop = next(e["delta"]["stop_reason"] for e in events if e["type"] == "message_delta")
    else:
        used = [b["name"] for b in r.json()["content"] if b["type"] == "tool_use"]
        stop = r.json()["stop_reason"]
    assert used == names and stop == "tool_use"


@pytest.mark.parametrize("parallel,names", [(False, ["get_weather"]),
                                            (True, ["get_weather", "get_time"])])
@pytest.mark.parametrize("stream", [False, True])
async def test_responses(gateway, fake, parallel, names, stream):
    fake.servicer.behavior = Behavior(tokens=TOOL_TOKENS)
    r = await post(gateway, "/v1/responses", {
        "model": MODEL, "input": "Weather and time in Paris?", "tools": RESPONSES_TOOLS,
        "parallel_tool_calls": parallel, "stream": stream})
    assert r.status_code == 200, r.text
    if stream:
        events = _events(r.text)
        body = next(e["response"] for e in events if e["type"] == "response.completed")
    else:
        body = r.json()
    assert [i["name"] for i in body["output"] if i["type"] == "function_call"] == names
    assert body["parallel_tool_calls"] is parallel
