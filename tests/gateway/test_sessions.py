"""Session keys from the headers agent harnesses send, and where they route (two fake decode
workers behind a live gateway, session policy)."""
from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest

from gateway.sessions import SessionKeys, session_keys
from protos import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.gateway.conftest import MODEL, FakeWorker, running_gateway

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi there"}]}
HEADERS = ["X-Session-ID", "X-Dynamo-Session-ID", "X-SMG-Routing-Key", "X-Correlation-ID"]


def test_session_header_precedence():
    def keys(headers: dict, user=None) -> SessionKeys:
        return session_keys({k.lower(): v for k, v in headers.items()}.get, user)

    every = {h: h.lower() for h in HEADERS}
    assert keys(every, "u") == ("x-session-id", "")
    for i, h in enumerate(HEADERS):  # each wins over the ones after it and over `user`
        assert keys(dict(list(every.items())[i:]), "u").session_id == h.lower()
    assert keys({}, "u") == ("u", "") and keys({}) == ("", "")
    assert keys({"X-Dynamo-Parent-Session-ID": "p", "X-SMG-Routing-Key": "c"}) == ("c", "p")


def test_agent_harness_headers_and_body_keys():
    """Claude Code (with subagents), Codex, OpenCode, then the body's keys, in the order of
    gateway/sessions.py."""
    def keys(headers: dict, *body: str | None, explicit: str = "") -> SessionKeys:
        return session_keys({k.lower(): v for k, v in headers.items()}.get, body=body,
                            explicit=explicit)

    cc = {"X-Claude-Code-Session-Id": "S"}
    assert keys(cc) == ("S", "")
    assert keys({**cc, "X-Claude-Code-Agent-Id": "a1"}) == ("S:a1", "S")
    assert keys({**cc, "X-Claude-Code-Agent-Id": "a2",
                 "X-Claude-Code-Parent-Agent-Id": "a1"}) == ("S:a2", "S:a1")
    assert keys({"X-Claude-Code-Agent-Id": "a1"}, "body") == ("body", "")  # no session id
    assert keys({"Thread-Id": "t", "Session-Id": "s", "X-Codex-Parent-Thread-Id": "p"}) == \
        ("t", "p")
    assert keys({"Session-Id": "s"}) == ("s", "") == keys({"session_id": "s"})
    assert keys({"X-Session-ID": "o", "X-Parent-Session-ID": "op"}) == ("o", "op")  # OpenCode
    # the families in order: Baton's/OpenCode's, Dynamo's, Claude Code's, Codex's, ...
    every = {"X-Session-ID": "1", "X-Dynamo-Session-ID": "2", **cc, "Thread-Id": "4",
             "X-SMG-Routing-Key": "5", "X-Correlation-ID": "6"}
    order = list(every)
    for i, h in enumerate(order):
        assert keys({k: every[k] for k in order[i:]}, "pck", "u").session_id == every[h]
    assert keys({}, "pck", "u") == ("pck", "") and keys({}, None, "u") == ("u", "")
    assert keys(every, "pck", explicit="grpc") == ("grpc", "")


@pytest.fixture
async def two_workers():
    workers = [await FakeWorker.start(worker_id=f"w{i}") for i in range(2)]
    yield workers
    for w in workers:
        await w.stop(0)


def _served_by(workers: list[FakeWorker], session: str) -> list[int]:
    return [i for i, w in enumerate(workers) for r in w.servicer.requests
            if r.session_id == session]


async def _make_busy(worker: FakeWorker) -> None:
    """Report a load (below overload_load 1.5) that outweighs a full prompt overlap (kv_weight
    1): a new session goes to the other worker."""
    worker.servicer.load = 1.2
    await asyncio.sleep(0.3)  # > poll_interval_s (0.05): the gateway has seen it


async def test_each_session_header_routes_sticky(prompts, two_workers):
    async with running_gateway(prompts, two_workers) as gw, \
            httpx.AsyncClient(base_url=gw.http_url, timeout=10) as c:
        for h in HEADERS:
            for turn in range(3):
                r = await c.post("/v1/chat/completions", json=CHAT, headers={h: f"s-{h}"})
                assert r.status_code == 200
                if turn == 0:  # turn the first worker chosen into the worse choice
                    await _make_busy(two_workers[_served_by(two_workers, f"s-{h}")[0]])
            served = _served_by(two_workers, f"s-{h}")
            assert len(served) == 3 and len(set(served)) == 1, (h, served)
            for w in two_workers:
                w.servicer.load = 0.0
            await asyncio.sleep(0.3)


async def test_a_subagent_lands_with_its_parent_then_sticks_on_its_own(prompts, two_workers):
    async with running_gateway(prompts, two_workers) as gw, \
            httpx.AsyncClient(base_url=gw.http_url, timeout=10) as c:
        post = lambda headers: c.post("/v1/chat/completions", json=CHAT,  # noqa: E731
                                      headers=headers)
        assert (await post({"X-Dynamo-Session-ID": "parent"})).status_code == 200
        home = _served_by(two_workers, "parent")[0]
        await _make_busy(two_workers[home])
        assert (await post({"X-Dynamo-Session-ID": "loner"})).status_code == 200
        assert _served_by(two_workers, "loner") == [1 - home]  # a new session avoids home
        for _ in range(2):
            r = await post({"X-Dynamo-Session-ID": "sub",
                            "X-Dynamo-Parent-Session-ID": "parent"})
            assert r.status_code == 200
        assert (await post({"X-Dynamo-Session-ID": "sub"})).status_code == 200
        assert _served_by(two_workers, "sub") == [home] * 3


async def test_grpc_metadata_carries_session_and_parent(prompts, two_workers):
    async with running_gateway(prompts, two_workers) as gw, \
            grpc.aio.insecure_channel(gw.grpc_address) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        req = lambda sid="": gateway_pb2.GatewayGenerateRequest(  # noqa: E731
            model=MODEL, text="Hello", session_id=sid,
            sampling_params=common_pb2.SamplingParams(max_tokens=1))
        [m async for m in stub.Generate(req("parent"), timeout=5)]
        home = _served_by(two_workers, "parent")[0]
        await _make_busy(two_workers[home])
        meta = (("x-smg-routing-key", "sub"), ("x-dynamo-parent-session-id", "parent"))
        [m async for m in stub.Generate(req(), metadata=meta, timeout=5)]
        assert _served_by(two_workers, "sub") == [home]
