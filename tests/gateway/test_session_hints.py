"""Session hints at the gateway (gateway/session_hints.py): X-Session-TTL, kv_retention and
X-Session-End reach the decode worker; bad values are a 400 in OpenAI's shape and nothing is
sent; DELETE /v1/sessions/{id} tells the session's workers (or all of them) to end it."""
from __future__ import annotations

import grpc
import httpx
import pytest

from protos import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.gateway.conftest import MODEL, FakeWorker, running_gateway
from tests.gateway.fake_decode import start_fake_prefill

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi there"}]}
COMPLETION = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}


async def test_hints_reach_the_decode_worker(gateway, fake):
    async with httpx.AsyncClient(base_url=gateway.http_url, timeout=10) as c:
        sid = {"X-Session-ID": "s1"}
        assert (await c.post("/v1/chat/completions", json=CHAT,
                             headers=sid | {"X-Session-TTL": "30"})).status_code == 200
        assert (await c.post("/v1/completions", json=COMPLETION | {"kv_retention": 12.5},
                             headers=sid)).status_code == 200
        assert (await c.post("/v1/chat/completions", json=CHAT | {"kv_retention": {"ttl_s": 0}},
                             headers=sid | {"X-Session-End": "true"})).status_code == 200
        assert (await c.post("/v1/chat/completions", json=CHAT | {"user": "u"},
                             headers={"X-Session-TTL": "5"})).status_code == 200
        assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
    got = [(r.session_id, r.session_ttl_seconds if r.HasField("session_ttl_seconds") else None,
            r.session_end) for r in fake.servicer.requests]
    assert got == [("s1", 30.0, False), ("s1", 12.5, False), ("s1", 0.0, True), ("u", 5.0, False),
                   ("", None, False)]


BAD = [
    ({"X-Session-ID": "s", "X-Session-TTL": "soon"}, {}, "X-Session-TTL"),
    ({"X-Session-ID": "s", "X-Session-TTL": "-1"}, {}, "X-Session-TTL"),
    ({"X-Session-ID": "s", "X-Session-TTL": "3601"}, {}, "X-Session-TTL"),
    ({"X-Session-ID": "s", "X-Session-TTL": "inf"}, {}, "X-Session-TTL"),
    ({"X-Session-ID": "s", "X-Session-TTL": "nan"}, {}, "X-Session-TTL"),
    ({"X-Session-ID": "s"}, {"kv_retention": "30"}, "kv_retention"),
    ({"X-Session-ID": "s"}, {"kv_retention": -5}, "kv_retention"),
    ({"X-Session-ID": "s"}, {"kv_retention": True}, "kv_retention"),
    ({"X-Session-ID": "s"}, {"kv_retention": {"ttl": 5}}, "kv_retention"),
    ({"X-Session-ID": "s"}, {"kv_retention": 1e300}, "kv_retention"),
    ({"X-Session-ID": "s", "X-Session-End": "maybe"}, {}, "X-Session-End"),
    ({"X-Session-TTL": "30"}, {}, "X-Session-TTL"),  # no session to keep
    ({"X-Session-End": "1"}, {}, "X-Session-End"),
]


@pytest.mark.parametrize("headers,body,param", BAD)
async def test_bad_hints_are_400_nothing_sent_and_serving_goes_on(gateway, fake, headers, body,
                                                                  param):
    async with httpx.AsyncClient(base_url=gateway.http_url, timeout=10) as c:
        r = await c.post("/v1/chat/completions", json=CHAT | body, headers=headers)
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["param"] == param and err["code"] == "invalid_session_hint"
        assert err["type"] == "invalid_request_error" and err["message"]
        assert not fake.servicer.requests
        assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
    assert len(fake.servicer.requests) == 1


async def test_delete_ends_the_session_on_its_workers_only(prompts):
    workers = [await FakeWorker.start(worker_id=f"w{i}") for i in range(2)]
    prefill = await start_fake_prefill()
    try:
        async with running_gateway(prompts, workers, [prefill]) as gw, \
                httpx.AsyncClient(base_url=gw.http_url, timeout=10) as c:
            r = await c.post("/v1/chat/completions", json=CHAT,
                             headers={"X-Session-ID": "agent", "X-Session-TTL": "60"})
            assert r.status_code == 200
            home = next(i for i, w in enumerate(workers) if w.servicer.requests)
            r = await c.delete("/v1/sessions/agent")
            assert r.status_code == 200
            body = r.json()
            assert body["id"] == "agent" and body["deleted"]
            assert body["object"] == "session.deleted"
            assert workers[home].servicer.ended_sessions == ["agent"]
            assert not workers[1 - home].servicer.ended_sessions
            assert prefill.servicer.ended_sessions == ["agent"]  # the router's prefill pick
            assert body["workers"] == 2 and body["num_blocks"] == 3 + 2
            # The router forgot it: a second DELETE asks every worker (decode and prefill).
            r = await c.delete("/v1/sessions/agent")
            assert r.json()["workers"] == 3 and r.json()["num_blocks"] == 3 + 3 + 2
            assert [w.servicer.ended_sessions for w in workers][1 - home] == ["agent"]
            assert prefill.servicer.ended_sessions == ["agent"] * 2
            r = await c.delete("/v1/sessions/" + "x" * 300)
            assert r.status_code == 400 and r.json()["error"]["param"] == "session_id"
            assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 200
    finally:
        for w in workers + [prefill]:
            await w.stop(0)


async def test_grpc_front_takes_hint_fields_and_metadata(gateway, fake):
    async with grpc.aio.insecure_channel(gateway.grpc_address) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        sp = common_pb2.SamplingParams(max_tokens=1)
        req = gateway_pb2.GatewayGenerateRequest(model=MODEL, text="Hi", session_id="g",
                                                 session_ttl_seconds=9, sampling_params=sp)
        [m async for m in stub.Generate(req, timeout=5)]
        meta = (("x-session-id", "m"), ("x-session-ttl", "4"), ("x-session-end", "true"))
        plain = gateway_pb2.GatewayGenerateRequest(model=MODEL, text="Hi", sampling_params=sp)
        [m async for m in stub.Generate(plain, metadata=meta, timeout=5)]
        with pytest.raises(grpc.aio.AioRpcError) as err:
            bad = gateway_pb2.GatewayGenerateRequest(model=MODEL, text="Hi", session_id="g",
                                                     session_ttl_seconds=-3, sampling_params=sp)
            [m async for m in stub.Generate(bad, timeout=5)]
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    got = [(r.session_id, r.session_ttl_seconds, r.session_end) for r in fake.servicer.requests]
    assert got == [("g", 9.0, False), ("m", 4.0, True)]

