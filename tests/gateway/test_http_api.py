"""The OpenAI HTTP API against a fake decode worker: bodies, streams, parameters, metrics."""
from __future__ import annotations

import json

import httpx
import pytest

from protos import common_pb2
from tests.gateway.conftest import MODEL, Behavior, FakeWorker, running_gateway

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi there"}]}


def sse_data(text: str) -> list:
    events = [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


async def post(gw, path: str, body: dict, **kw) -> httpx.Response:
    async with httpx.AsyncClient(base_url=gw.http_url, timeout=10) as c:
        return await c.post(path, json=body, **kw)


async def test_chat_non_stream(gateway, fake):
    r = await post(gateway, "/v1/chat/completions", {**CHAT, "max_tokens": 8, "seed": 7,
                                                      "temperature": 0.3, "top_p": 0.9,
                                                      "top_k": 5, "min_p": 0.1})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hello world!"}
    assert body["choices"][0]["finish_reason"] == "stop"
    usage = body["usage"]
    assert usage["completion_tokens"] == 3 and usage["prompt_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + 3
    assert usage["prompt_tokens_details"] == {
        "cached_tokens": 0, "baton_recomputed_held_tokens": 0,
        "baton_cached_by": {"decode_pool": 0, "prefill_pool": 0, "host_tier": 0, "disk_tier": 0,
                            "store": 0}}
    req = fake.servicer.requests[-1]
    sp = req.sampling_params
    assert (sp.max_tokens, sp.seed, sp.top_k) == (8, 7, 5)
    assert sp.temperature == pytest.approx(0.3) and sp.top_p == pytest.approx(0.9)
    assert sp.min_p == pytest.approx(0.1)
    assert req.request_id == body["id"]
    assert req.prefill_mode == 2  # LOCAL: no prefill worker configured


async def test_chat_stream_with_usage(gateway, fake):
    fake.servicer.behavior = Behavior(cached_tokens=4)
    r = await post(gateway, "/v1/chat/completions",
                   {**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    chunks = sse_data(r.text)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "Hello world!"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 4
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert all("usage" in c for c in chunks)


async def test_stream_without_usage_has_no_usage_field(gateway):
    r = await post(gateway, "/v1/completions", {"model": MODEL, "prompt": "Hi", "stream": True})
    chunks = sse_data(r.text)
    assert all("usage" not in c for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Hello world!"


async def test_completions_non_stream_and_token_prompt(gateway, fake):
    r = await post(gateway, "/v1/completions", {"model": MODEL, "prompt": "The quick"})
    body = r.json()
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == "Hello world!"
    assert fake.servicer.requests[-1].sampling_params.max_tokens == 16  # OpenAI's default
    r = await post(gateway, "/v1/completions", {"model": MODEL, "prompt": [5, 6, 7],
                                                "max_tokens": 2})
    assert r.status_code == 200
    assert list(fake.servicer.requests[-1].prompt_token_ids) == [5, 6, 7]
    assert r.json()["choices"][0]["finish_reason"] == "length"


async def test_n2_non_stream_and_stream(gateway, fake):
    r = await post(gateway, "/v1/chat/completions", {**CHAT, "n": 2})
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    assert all(c["message"]["content"] == "Hello world!" for c in choices)
    assert fake.servicer.requests[-1].sampling_params.n == 2
    assert r.json()["usage"]["completion_tokens"] == 6
    r = await post(gateway, "/v1/chat/completions", {**CHAT, "n": 2, "stream": True})
    chunks = sse_data(r.text)
    # one choice per chunk, each choice's first with its role (OpenAI's and vLLM's framing:
    # a client reading choices[0] of each chunk sees every choice's role)
    assert all(len(c["choices"]) == 1 for c in chunks)
    for i in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["delta"].get("content", "") for c in mine) == "Hello world!"
        assert mine[-1]["finish_reason"] == "stop"


async def test_stop_is_passed_through_and_reported(gateway, fake):
    r = await post(gateway, "/v1/chat/completions", {**CHAT, "stop": " wor"})
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == "Hello"
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", " wor")
    assert list(fake.servicer.requests[-1].sampling_params.stop) == [" wor"]
    await post(gateway, "/v1/completions", {"model": MODEL, "prompt": "x", "stop": ["a", "b"],
                                            "ignore_eos": True, "min_tokens": 1,
                                            "stop_token_ids": [2]})
    sp = fake.servicer.requests[-1].sampling_params
    assert (list(sp.stop), sp.ignore_eos, sp.min_tokens, list(sp.stop_token_ids)) == \
        (["a", "b"], True, 1, [2])


async def test_chat_logprobs_shape(gateway, fake):
    r = await post(gateway, "/v1/chat/completions", {**CHAT, "logprobs": True,
                                                      "top_logprobs": 2})
    assert fake.servicer.requests[-1].sampling_params.logprobs == 2
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    first = content[0]
    assert set(first) == {"token", "logprob", "bytes", "top_logprobs"}
    assert first["logprob"] == -0.5 and len(first["top_logprobs"]) == 2
    assert first["bytes"] == list(first["token"].encode())
    r = await post(gateway, "/v1/chat/completions", {**CHAT, "logprobs": True, "stream": True})
    chunks = sse_data(r.text)
    assert any(c["choices"][0]["logprobs"] for c in chunks)


async def test_completion_logprobs_shape(gateway):
    r = await post(gateway, "/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 1})
    lp = r.json()["choices"][0]["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(lp["tokens"]) == 3 and lp["token_logprobs"] == [-0.5] * 3
    assert all(len(t) == 1 for t in lp["top_logprobs"])


TOOL_TOKENS = tuple(enumerate([
    "Let me check.", "<tool", "_call>", '\n{"name": "get_weather", ', '"arguments": {"city": ',
    '"Paris"}}\n</tool_call>', "<tool_call>", '{"name": "get_time", "arguments": {}}',
    "</tool_call>"], start=20))
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}}}}}]


async def test_tool_calls_parsed_non_stream(gateway, fake):
    fake.servicer.behavior = Behavior(tokens=TOOL_TOKENS)
    r = await post(gateway, "/v1/chat/completions", {**CHAT, "tools": TOOLS})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me check."
    calls = choice["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    # without tools offered, the text is left alone
    r = await post(gateway, "/v1/chat/completions", CHAT)
    assert "<tool_call>" in r.json()["choices"][0]["message"]["content"]


async def test_tool_calls_parsed_stream(gateway, fake):
    fake.servicer.behavior = Behavior(tokens=TOOL_TOKENS)
    r = await post(gateway, "/v1/chat/completions", {**CHAT, "tools": TOOLS, "stream": True})
    chunks = sse_data(r.text)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    content = "".join(d.get("content") or "" for d in deltas)
    assert content == "Let me check."
    calls = [t for d in deltas for t in d.get("tool_calls", [])]
    assert [(t["index"], t["function"]["name"]) for t in calls] == \
        [(0, "get_weather"), (1, "get_time")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


async def test_a_call_quoting_its_closing_tag_streams_as_it_collects(gateway, fake):
    """Issue 27: a JSON argument holding the literal `</tool_call>` is still one call, with
    finish_reason tool_calls, streamed (one character per token) or not."""
    note = {"text": "a call ends with </tool_call>, quoted: \"</tool_call>\""}
    output = "On it.<tool_call>\n" + json.dumps({"name": "get_weather", "arguments": note}) \
        + "\n</tool_call>"
    fake.servicer.behavior = Behavior(tokens=tuple((100 + i % 50, ch)
                                                   for i, ch in enumerate(output)))
    body = {**CHAT, "tools": TOOLS, "max_tokens": len(output)}
    choice = (await post(gateway, "/v1/chat/completions", body)).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "On it."
    (call,) = choice["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == note
    chunks = sse_data((await post(gateway, "/v1/chat/completions",
                                  {**body, "stream": True})).text)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content") or "" for d in deltas) == "On it."
    (streamed,) = [t for d in deltas for t in d.get("tool_calls", [])]
    assert json.loads(streamed["function"]["arguments"]) == note
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


async def test_session_header_and_user_reach_the_worker(gateway, fake):
    await post(gateway, "/v1/chat/completions", CHAT, headers={"X-Session-ID": "agent-1"})
    assert fake.servicer.requests[-1].session_id == "agent-1"
    await post(gateway, "/v1/chat/completions", CHAT, headers={"X-Correlation-ID": "corr"})
    assert fake.servicer.requests[-1].session_id == "corr"
    await post(gateway, "/v1/chat/completions", {**CHAT, "user": "u-9"})
    assert fake.servicer.requests[-1].session_id == "u-9"
    r = await post(gateway, "/v1/chat/completions", {**CHAT, "user": "u-9",
                                                     "prompt_cache_key": "pck"})
    assert fake.servicer.requests[-1].session_id == "pck"  # before `user`, after the headers
    assert "x-baton-ignored-fields" not in r.headers


async def test_models_health_metrics(gateway):
    async with httpx.AsyncClient(base_url=gateway.http_url) as c:
        models = (await c.get("/v1/models")).json()
        assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == 1024
        assert (await c.get(f"/v1/models/{MODEL}")).json() == models["data"][0]
        missing = await c.get("/v1/models/gpt-9")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == \
            "model_not_found"
        await c.post("/v1/chat/completions", json={**CHAT, "stream": True})
        await c.post("/v1/chat/completions", json={**CHAT, "model": "nope"})
        health = await c.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "ok"
        for path in ("/health", "/v1/models", "/metrics"):  # uptime checks probe with HEAD
            head = await c.head(path)
            assert head.status_code == 200 and head.content == b"", path
        text = (await c.get("/metrics")).text
    for name in ("baton_gateway_ttft_seconds_bucket", "baton_gateway_itl_seconds_bucket",
                 "baton_gateway_e2e_seconds_count", "baton_gateway_routing_decisions_total",
                 'baton_gateway_requests_total{endpoint="/v1/chat/completions",status="200"}',
                 'baton_gateway_requests_total{endpoint="/v1/models/{id}",status="404"}',
                 'baton_gateway_requests_total{endpoint="/v1/models/{id}",status="200"}',
                 'baton_gateway_errors_total{status="404",where="response"}',
                 'baton_gateway_healthy_workers{role="decode"} 1.0'):
        assert name in text, name


async def test_health_is_503_without_a_healthy_decode_worker(prompts):
    worker = await FakeWorker.start()
    async with running_gateway(prompts, [worker]) as gw:
        await worker.set_serving(False)
        async with httpx.AsyncClient(base_url=gw.http_url) as c:
            for _ in range(100):
                r = await c.get("/health")
                if r.status_code == 503:
                    break
                import asyncio
                await asyncio.sleep(0.02)
            assert r.status_code == 503 and r.json()["status"] == "unavailable"
    await worker.stop(0)


async def test_api_key_guards_everything_but_the_operators_paths(prompts, fake):
    """With a key, every path wants it but /health, /metrics, /metrics/workers and /version
    (vLLM leaves them open too: a Prometheus scrape, such as the Kubernetes manifests'
    `prometheus.io/scrape` annotation asks for, sends no key); `Bearer` matches in any case."""
    async with running_gateway(prompts, [fake], api_key="sekret") as gw:
        async with httpx.AsyncClient(base_url=gw.http_url) as c:
            for path in ("/health", "/metrics", "/metrics/workers", "/version", "/ping"):
                assert (await c.get(path)).status_code == 200, path
            ping = await c.post("/ping")  # vLLM's SageMaker health check: GET or POST
            assert ping.status_code == 200 and ping.json()["status"] == "ok"
            for method, path in [("GET", "/v1/models"), ("POST", "/v1/chat/completions"),
                                 ("POST", "/v1/completions"), ("POST", "/tokenize"),
                                 ("GET", "/nowhere")]:
                r = await c.request(method, path, json=CHAT)
                assert r.status_code == 401, path
                assert r.json()["error"]["code"] == "invalid_api_key"
            for auth in ("Bearer wrong", "sekret", "Basic sekret", "Bearer  sekretx", "Bearer"):
                r = await c.post("/v1/chat/completions", json=CHAT,
                                 headers={"Authorization": auth})
                assert r.status_code == 401, auth
            for auth in ("Bearer sekret", "bearer sekret", "BEARER  sekret"):
                r = await c.post("/v1/chat/completions", json=CHAT,
                                 headers={"Authorization": auth})
                assert r.status_code == 200, auth


async def test_max_completion_tokens_and_finish_reason_length(prompts):
    worker = await FakeWorker.start()
    async with running_gateway(prompts, [worker]) as gw:
        r = await post(gw, "/v1/chat/completions", {**CHAT, "max_completion_tokens": 1})
        assert r.json()["choices"][0]["finish_reason"] == "length"
        assert worker.servicer.requests[-1].sampling_params.max_tokens == 1
    await worker.stop(0)


async def test_cached_tokens_come_from_the_worker(gateway, fake):
    fake.servicer.behavior = Behavior(cached_tokens=16)
    r = await post(gateway, "/v1/chat/completions", CHAT)
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 16


def test_finish_reason_enum_is_mapped():
    from gateway.responses import finished_error
    from protos import decode_pb2
    ok = decode_pb2.Finished(finish_reason=common_pb2.FINISH_REASON_STOP)
    assert finished_error(ok) is None
    err = finished_error(decode_pb2.Finished(finish_reason=common_pb2.FINISH_REASON_ERROR,
                                             error="boom"))
    assert err.status == 500 and err.message == "boom"


async def test_a_forced_call_cut_by_max_tokens_shows_no_markup(gateway, fake):
    """tool_choice "required" (or named; Anthropic's "any") forces the output to be one call;
    cut by max_tokens, the unfinished call (`<tool_call>\\n{"name": "get_wea`) reached the
    client as the assistant's text on every API. Now the choice ends with no content and no
    call, finish_reason "length"; under tool_choice "auto" the text is still given back."""
    fake.servicer.behavior = Behavior(tokens=tuple(enumerate(
        ["<tool_call>", '\n{"name": "', "get_wea", 'ther"'], start=30)))
    body = {**CHAT, "tools": TOOLS, "tool_choice": "required", "max_tokens": 3}
    choice = (await post(gateway, "/v1/chat/completions", body)).json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert not choice["message"]["content"] and not choice["message"].get("tool_calls")
    chunks = sse_data((await post(gateway, "/v1/chat/completions",
                                  {**body, "stream": True})).text)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert not "".join(d.get("content") or "" for d in deltas)
    assert not [t for d in deltas for t in d.get("tool_calls", [])]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    msg = (await post(gateway, "/v1/messages", {
        "model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}],
        "tool_choice": {"type": "any"}})).json()
    assert msg["stop_reason"] == "max_tokens"
    assert not [b for b in msg["content"] if b["type"] == "text" and b["text"]]
    auto = (await post(gateway, "/v1/chat/completions", {**body, "tool_choice": "auto"})).json()
    assert auto["choices"][0]["message"]["content"].startswith("<tool_call>")


async def test_answers_name_the_served_model_whichever_name_was_asked(prompts, fake):
    """With --served-model-name, a request may still name the model's own name (as /v1/models
    lists it under `root`), but the answer's `model` was that name: usage keyed on `model`
    split one model in two. vLLM answers with the served name; so does Baton now."""
    async with running_gateway(prompts, [fake], served_model_name="team/served") as gw:
        async with httpx.AsyncClient(base_url=gw.http_url) as c:
            for model in (MODEL, "team/served", None):
                body = {**CHAT, "model": model}
                chat = (await c.post("/v1/chat/completions", json=body)).json()
                assert chat["model"] == "team/served", model
                cmpl = (await c.post("/v1/completions",
                                     json={"model": model, "prompt": "x"})).json()
                assert cmpl["model"] == "team/served", model
                streamed = sse_data((await c.post("/v1/chat/completions",
                                                  json={**body, "stream": True})).text)
                assert {ch["model"] for ch in streamed} == {"team/served"}
