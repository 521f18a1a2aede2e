"""Gateway shutdown (SIGTERM → Gateway.stop) with a stream in flight, in-process against the
fake decode worker paused mid-stream: while draining, /health and new requests get 503 (with
Retry-After and an OpenAI error body) and the running stream goes on; a stream released
within the grace ends normally; one still running at the deadline ends with an SSE error
event and `data: [DONE]`, and its Generate call is cancelled (an abort on decode)."""
from __future__ import annotations

import asyncio
import json
import logging

import httpx

from gateway.config import GatewayConfig
from gateway.config import parse_args as gateway_parse
from gateway.server import Gateway
from tests.gateway.conftest import MODEL, Behavior, FakeWorker, gateway_config

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi there"}], "stream": True}


async def _first_token_then_stop(client: httpx.AsyncClient, gw: Gateway, lines: list[str]):
    """Open a stream, read it up to its first token, start gw.stop(); returns (the stream
    context, its line iterator, the stop task) once the gateway is draining."""
    stream = client.stream("POST", "/v1/chat/completions", json=CHAT)
    response = await stream.__aenter__()
    assert response.status_code == 200
    rest = response.aiter_lines()
    async for line in rest:
        lines.append(line)
        if '"content": "Hello"' in line or '"content":"Hello"' in line:
            break
    stopping = asyncio.create_task(gw.stop())
    for _ in range(200):  # bounded: the drain flag is set at stop()'s first step
        if gw.drain.draining:
            break
        await asyncio.sleep(0.01)
    assert gw.drain.draining
    return stream, rest, stopping


def _data(lines: list[str]) -> list[str]:
    return [line[len("data: "):] for line in lines if line.startswith("data: ")]


async def _assert_refuses_new_work(client: httpx.AsyncClient) -> None:
    health = await client.get("/health")
    assert health.status_code == 503 and health.json()["status"] == "draining"
    assert health.headers["Retry-After"] == "1"  # as the README says (it had none)
    r = await client.post("/v1/chat/completions", json={**CHAT, "stream": False})
    assert r.status_code == 503 and r.headers["Retry-After"] == "1"
    assert r.json()["error"]["code"] == "shutting_down"
    assert r.json()["error"]["type"] == "server_error"


async def test_stream_finishes_within_the_grace(prompts):
    resume = asyncio.Event()
    fake = await FakeWorker.start(Behavior(pause_after=1, resume=resume))
    gw = Gateway(gateway_config([fake.address], shutdown_grace_s=30.0), prompts)
    await gw.start()
    lines: list[str] = []
    try:
        async with httpx.AsyncClient(base_url=gw.http_url, timeout=10) as client:
            stream, rest, stopping = await _first_token_then_stop(client, gw, lines)
            await _assert_refuses_new_work(client)
            assert not stopping.done()  # still waiting for the stream
            resume.set()
            lines += [line async for line in rest]
            await stream.__aexit__(None, None, None)
        await asyncio.wait_for(stopping, 10)
    finally:
        await fake.stop(0)
    events = _data(lines)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "Hello world!" and not any("error" in c for c in chunks)
    assert fake.servicer.completed and not fake.servicer.cancelled


async def test_stream_running_at_the_deadline_ends_with_an_error_event(prompts, caplog):
    fake = await FakeWorker.start(Behavior(pause_after=1, resume=asyncio.Event()))  # never
    gw = Gateway(gateway_config([fake.address], shutdown_grace_s=0.5), prompts)
    await gw.start()
    lines: list[str] = []
    caplog.set_level(logging.INFO)
    try:
        async with httpx.AsyncClient(base_url=gw.http_url, timeout=10) as client:
            stream, rest, stopping = await _first_token_then_stop(client, gw, lines)
            await _assert_refuses_new_work(client)
            lines += [line async for line in rest]  # ends, no reset
            await stream.__aexit__(None, None, None)
        await asyncio.wait_for(stopping, 10)
        for _ in range(200):  # the cancel reaches the fake's server a moment later
            if fake.servicer.cancelled:
                break
            await asyncio.sleep(0.01)
    finally:
        await fake.stop(0)
    events = _data(lines)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "shutting_down" and error["type"] == "server_error"
    assert fake.servicer.cancelled and not fake.servicer.completed
    assert "timeout graceful shutdown exceeded" not in caplog.text


def test_shutdown_grace_flag():
    assert GatewayConfig(decode=("127.0.0.1:1",)).shutdown_grace_s == 30.0
    cfg = gateway_parse(["--decode", "127.0.0.1:1", "--shutdown-grace-s", "12.5"])
    assert cfg.shutdown_grace_s == 12.5
