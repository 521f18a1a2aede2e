"""Bad requests, failing workers and disconnects: every request gets an answer, the server lives.

Covers issue 7's cases 11 (empty prompt / messages), 12 (disconnect aborts), 13 (n=0,
worker killed mid-stream), 15 (worker not ready → answer within a timeout).
"""
from __future__ import annotations

import asyncio
import json
import time

import grpc
import httpx
import pytest

from tests.gateway.conftest import MODEL, Behavior, FakeWorker, running_gateway

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
LONG = "word " * 2000  # > 1024 tokens of the tiny model's context

BAD_REQUESTS = [
    # (name, path, body or raw bytes, headers, status, param)
    ("malformed json", "/v1/chat/completions", b'{"model": "tiny", "messages": [',
     {"content-type": "application/json"}, 400, None),
    ("body not an object", "/v1/chat/completions", b"[1, 2]",
     {"content-type": "application/json"}, 400, None),
    ("missing messages", "/v1/chat/completions", {"model": MODEL}, {}, 400, "messages"),
    ("wrong type", "/v1/chat/completions", {**CHAT, "max_tokens": "many"}, {}, 400,
     "max_tokens"),
    ("bad role", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, {}, 400, None),
    ("empty messages", "/v1/chat/completions", {"model": MODEL, "messages": []}, {}, 400,
     "messages"),
    ("empty prompt", "/v1/completions", {"model": MODEL, "prompt": ""}, {}, 400, "prompt"),
    ("empty token prompt", "/v1/completions", {"model": MODEL, "prompt": []}, {}, 400,
     "prompt"),
    ("token out of vocab", "/v1/completions", {"model": MODEL, "prompt": [10 ** 6]}, {}, 400,
     "prompt"),
    ("too many prompts", "/v1/completions", {"model": MODEL, "prompt": ["a"] * 65}, {}, 400,
     "prompt"),
    ("one bad prompt of two", "/v1/completions", {"model": MODEL, "prompt": ["a", ""]}, {},
     400, "prompt"),
    ("one bad token prompt of two", "/v1/completions",
     {"model": MODEL, "prompt": [[1, 2], [10 ** 6]]}, {}, 400, "prompt"),
    ("presence_penalty 3", "/v1/chat/completions", {**CHAT, "presence_penalty": 3}, {}, 400,
     "presence_penalty"),
    ("frequency_penalty -2.5", "/v1/completions",
     {"model": MODEL, "prompt": "x", "frequency_penalty": -2.5}, {}, 400, "frequency_penalty"),
    ("repetition_penalty 0", "/v1/chat/completions", {**CHAT, "repetition_penalty": 0}, {},
     400, "repetition_penalty"),
    ("logit_bias value 101", "/v1/chat/completions", {**CHAT, "logit_bias": {"5": 101}}, {},
     400, "logit_bias"),
    ("logit_bias value not a number", "/v1/completions",
     {"model": MODEL, "prompt": "x", "logit_bias": {"5": "lots"}}, {}, 400, "logit_bias"),
    ("logit_bias key not an id", "/v1/chat/completions", {**CHAT, "logit_bias": {"a": 1}}, {},
     400, "logit_bias"),
    ("logit_bias negative id", "/v1/chat/completions", {**CHAT, "logit_bias": {"-1": 1}}, {},
     400, "logit_bias"),
    ("logit_bias id out of vocab", "/v1/completions",
     {"model": MODEL, "prompt": "x", "logit_bias": {"1000000": 1}}, {}, 400, "logit_bias"),
    ("logit_bias not an object", "/v1/chat/completions", {**CHAT, "logit_bias": [1, 2]}, {},
     400, "logit_bias"),
    ("tokenize unknown model", "/tokenize", {"model": "gpt-9", "prompt": "x"}, {}, 404,
     "model"),
    ("tokenize prompt and messages", "/tokenize", {"prompt": "x", **CHAT}, {}, 400, None),
    ("tokenize nothing", "/tokenize", {"model": MODEL}, {}, 400, None),
    ("detokenize id out of vocab", "/detokenize", {"model": MODEL, "tokens": [1, 10 ** 6]}, {},
     400, "tokens"),
    ("detokenize unknown model", "/detokenize", {"model": "gpt-9", "tokens": [1]}, {}, 404,
     "model"),
    ("detokenize ids not ints", "/detokenize", {"tokens": ["a"]}, {}, 400, "tokens"),
    ("n=0", "/v1/chat/completions", {**CHAT, "n": 0}, {}, 400, "n"),
    ("n=0 stream", "/v1/chat/completions", {**CHAT, "n": 0, "stream": True}, {}, 400, "n"),
    ("negative temperature", "/v1/chat/completions", {**CHAT, "temperature": -1}, {}, 400,
     "temperature"),
    ("top_p 0", "/v1/chat/completions", {**CHAT, "top_p": 0}, {}, 400, "top_p"),
    ("too many logprobs", "/v1/chat/completions", {**CHAT, "logprobs": True,
                                                   "top_logprobs": 99}, {}, 400,
     "top_logprobs"),
    ("empty stop string", "/v1/chat/completions", {**CHAT, "stop": [""]}, {}, 400, "stop"),
    ("image content", "/v1/chat/completions", {"model": MODEL, "messages": [{
        "role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, {},
     400, "messages"),
    ("unknown model", "/v1/chat/completions", {**CHAT, "model": "gpt-9"}, {}, 404, "model"),
    ("model is a path", "/v1/completions", {"model": "/etc/passwd", "prompt": "x"}, {}, 404,
     "model"),
    ("prompt over context", "/v1/completions", {"model": MODEL, "prompt": LONG}, {}, 400,
     None),
    ("max_tokens over context", "/v1/chat/completions", {**CHAT, "max_tokens": 5000}, {}, 400,
     "max_tokens"),
    ("unknown route", "/v1/embeddings", {"model": MODEL}, {}, 404, None),
    ("wrong method", "/v1/models", {}, {}, 405, None),
]


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
async def test_bad_request_gets_openai_error_and_server_stays_up(gateway, fake, case):
    name, path, body, headers, status, param = case
    async with httpx.AsyncClient(base_url=gateway.http_url, timeout=10) as c:
        kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
        r = await c.post(path, headers=headers, **kwargs)
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert isinstance(error["message"], str) and error["message"]
        if param is not None:
            assert error["param"] is not None and error["param"].startswith(param), error
        ok = await c.post("/v1/chat/completions", json=CHAT)
        assert ok.status_code == 200
    assert len(fake.servicer.requests) == 1  # no bad request reached the worker


async def test_body_too_large_413(prompts, fake):
    async with running_gateway(prompts, [fake], max_body_bytes=4096) as gw:
        async with httpx.AsyncClient(base_url=gw.http_url) as c:
            big = {**CHAT, "messages": [{"role": "user", "content": "x" * 10_000}]}
            r = await c.post("/v1/chat/completions", json=big)
            assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

            async def chunks():  # no Content-Length: counted while it streams in
                yield json.dumps(big).encode()
            r = await c.post("/v1/chat/completions", content=chunks(),
                             headers={"content-type": "application/json"})
            assert r.status_code == 413
            assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200


async def wait_for(predicate, timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def test_stream_disconnect_cancels_the_decode_call(gateway, fake):
    fake.servicer.behavior = Behavior(tokens=tuple((i, "x") for i in range(500)),
                                      token_delay_s=0.01)
    async with httpx.AsyncClient(base_url=gateway.http_url) as c:
        async with c.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
            async for line in r.aiter_lines():
                if '"content":"x"' in line:
                    break  # leave after the first token
    await wait_for(lambda: fake.servicer.cancelled, timeout=1.0)
    assert fake.servicer.cancelled == [fake.servicer.requests[-1].request_id]
    await wait_for(lambda: gateway.dispatcher.inflight == 0)


async def test_stream_disconnect_before_the_first_token_cancels_the_decode_call(gateway,
                                                                               fake):
    """The client leaves while its prompt is still being prefilled (no message yet)."""
    fake.servicer.behavior = Behavior(first_delay_s=30)
    async with httpx.AsyncClient(base_url=gateway.http_url) as c:
        with pytest.raises(httpx.ReadTimeout):
            await c.post("/v1/chat/completions", json={**CHAT, "stream": True}, timeout=0.3)
    await wait_for(lambda: fake.servicer.cancelled, timeout=1.0)
    assert fake.servicer.cancelled == [fake.servicer.requests[-1].request_id]
    await wait_for(lambda: gateway.dispatcher.inflight == 0)


async def test_non_stream_disconnect_cancels_the_decode_call(gateway, fake):
    fake.servicer.behavior = Behavior(first_delay_s=30)
    async with httpx.AsyncClient(base_url=gateway.http_url) as c:
        with pytest.raises(httpx.ReadTimeout):
            await c.post("/v1/chat/completions", json=CHAT, timeout=0.3)
    await wait_for(lambda: fake.servicer.cancelled, timeout=1.0)
    await wait_for(lambda: gateway.dispatcher.inflight == 0)


async def test_burst_of_disconnects_leaves_nothing_in_flight(gateway, fake):
    fake.servicer.behavior = Behavior(tokens=tuple((i, "x") for i in range(500)),
                                      token_delay_s=0.01)

    async def one(c):
        async with c.stream("POST", "/v1/completions",
                            json={"model": MODEL, "prompt": "hi", "stream": True,
                                  "max_tokens": 500}) as r:
            async for _ in r.aiter_lines():
                break
    async with httpx.AsyncClient(base_url=gateway.http_url,
                                 limits=httpx.Limits(max_connections=100)) as c:
        await asyncio.gather(*(one(c) for _ in range(30)))
    await wait_for(lambda: len(fake.servicer.cancelled) == 30, timeout=3.0)
    await wait_for(lambda: gateway.dispatcher.inflight == 0)


async def test_worker_dies_mid_stream_gives_error_event(gateway, fake):
    fake.servicer.behavior = Behavior(fail_after=2)
    async with httpx.AsyncClient(base_url=gateway.http_url, timeout=5) as c:
        r = await c.post("/v1/chat/completions", json={**CHAT, "stream": True})
    events = [line[6:] for line in r.text.split("\n\n") if line.startswith("data: ")]
    errors = [json.loads(e) for e in events if e.startswith('{"error"')]
    assert len(errors) == 1 and "mid-stream" in errors[0]["error"]["message"]
    assert sum('"content":"' in e for e in events) >= 2  # tokens before the failure arrived
    # every stream ends the same way (issue 27): the error event, then [DONE]
    assert events[-2:] == [events[-2], "[DONE]"] and events[-2].startswith('{"error"')
    # non-streaming: a 5xx with an OpenAI body
    async with httpx.AsyncClient(base_url=gateway.http_url, timeout=5) as c:
        r = await c.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 500 and "error" in r.json()


async def test_worker_killed_mid_stream_closes_the_stream(prompts):
    worker = await FakeWorker.start(Behavior(tokens=tuple((i, "x") for i in range(1000)),
                                             token_delay_s=0.01))
    async with running_gateway(prompts, [worker]) as gw:
        async with httpx.AsyncClient(base_url=gw.http_url, timeout=5) as c:
            async with c.stream("POST", "/v1/chat/completions",
                                json={**CHAT, "stream": True}) as r:
                lines = []
                async for line in r.aiter_lines():
                    lines.append(line)
                    if len(lines) == 6:
                        await worker.stop(0)
        events = [line for line in lines if line.startswith("data: ")]
        assert events[-2].startswith('data: {"error"') and events[-1] == "data: [DONE]"


async def test_finished_error_from_worker_is_an_error_event(gateway, fake):
    fake.servicer.behavior = Behavior(finish_error="engine step failed")
    async with httpx.AsyncClient(base_url=gateway.http_url, timeout=5) as c:
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True})
        assert 'data: {"error"' in r.text and "engine step failed" in r.text
        assert r.text.endswith("data: [DONE]\n\n")
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert r.status_code == 500 and r.json()["error"]["message"] == "engine step failed"


async def test_hanging_worker_answers_504_within_the_timeout(prompts):
    worker = await FakeWorker.start(Behavior(hang=True))
    async with running_gateway(prompts, [worker], first_token_timeout_s=0.5) as gw:
        async with httpx.AsyncClient(base_url=gw.http_url, timeout=5) as c:
            start = time.monotonic()
            r = await c.post("/v1/chat/completions", json={**CHAT, "stream": True})
            assert r.status_code == 504 and time.monotonic() - start < 3
    await worker.stop(0)


@pytest.mark.parametrize("code,status", [(grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
                                         (grpc.StatusCode.UNAVAILABLE, 503),
                                         (grpc.StatusCode.INVALID_ARGUMENT, 400)])
async def test_worker_rejection_maps_to_status(prompts, code, status):
    worker = await FakeWorker.start(Behavior(reject=code))
    async with running_gateway(prompts, [worker]) as gw:
        async with httpx.AsyncClient(base_url=gw.http_url, timeout=5) as c:
            r = await c.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == status and r.json()["error"]["message"]
            if status in (429, 503):
                assert r.headers["retry-after"] == "1"
    await worker.stop(0)


async def test_retry_on_another_worker_before_the_first_token(prompts):
    bad = await FakeWorker.start(Behavior(reject=grpc.StatusCode.UNAVAILABLE))
    good = await FakeWorker.start()
    async with running_gateway(prompts, [bad, good]) as gw:
        async with httpx.AsyncClient(base_url=gw.http_url, timeout=5) as c:
            for i in range(4):
                r = await c.post("/v1/chat/completions", json=CHAT,
                                 headers={"X-Session-ID": f"s{i}"})
                assert r.status_code == 200, r.text
    assert len(good.servicer.completed) == 4
    for w in (bad, good):
        await w.stop(0)


async def test_dead_worker_address_is_answered_fast(prompts):
    good = await FakeWorker.start()
    dead = await FakeWorker.start()
    await dead.stop(0)  # nothing listens there any more
    async with running_gateway(prompts, [dead, good]) as gw:
        async with httpx.AsyncClient(base_url=gw.http_url, timeout=5) as c:
            start = time.monotonic()
            for _ in range(3):
                assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
            assert time.monotonic() - start < 3
    await good.stop(0)


async def test_no_worker_reachable_is_503_with_retry_after(prompts):
    dead = await FakeWorker.start()
    await dead.stop(0)
    async with running_gateway(prompts, [dead]) as gw:
        async with httpx.AsyncClient(base_url=gw.http_url, timeout=5) as c:
            for stream in (False, True):
                r = await c.post("/v1/chat/completions", json={**CHAT, "stream": stream})
                assert r.status_code == 503 and "retry-after" in r.headers
                assert r.json()["error"]["type"] == "server_error"


async def test_too_many_in_flight_is_429(prompts):
    worker = await FakeWorker.start(Behavior(first_delay_s=0.5))
    async with running_gateway(prompts, [worker], max_inflight=2) as gw:
        async with httpx.AsyncClient(base_url=gw.http_url, timeout=5) as c:
            rs = await asyncio.gather(*(c.post("/v1/chat/completions", json=CHAT)
                                        for _ in range(4)))
        statuses = sorted(r.status_code for r in rs)
        assert statuses == [200, 200, 429, 429]
        assert all(r.headers.get("retry-after") for r in rs if r.status_code == 429)
    await worker.stop(0)
