"""bench/vllm_pd.py, vLLM's own P/D for `bench compare`'s "vllm-pd": the proxy's two
requests (vLLM's toy_proxy_server rule), the relay through fake prefill and decode servers,
the cores each server gets, and the configuration's command line."""
from __future__ import annotations

import json

import httpx
import pytest

from baton.bench.configs import spec_for
from baton.bench.vllm_pd import cpu_halves, decode_body, make_app, prefill_body
from baton.bench.vllm_server import VllmSpec

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9,
        "max_completion_tokens": 9, "stream": True, "stream_options": {"include_usage": True}}


def test_prefill_asks_one_token_kept_for_a_remote_decode():
    p = prefill_body(BODY)
    assert p["max_tokens"] == 1 and p["max_completion_tokens"] == 1 and p["stream"] is False
    assert "stream_options" not in p and p["kv_transfer_params"]["do_remote_decode"] is True
    assert p["messages"] == BODY["messages"] and BODY["max_tokens"] == 9  # the body is kept
    params = {"remote_engine_id": "e", "remote_block_ids": [1, 2]}
    assert decode_body(BODY, {"kv_transfer_params": params}) == {**BODY,
                                                                 "kv_transfer_params": params}
    assert decode_body(BODY, {"kv_transfer_params": None}) == BODY


def test_cores_shared_or_split():
    assert cpu_halves("share", [1, 0]) == ("0,1", "0,1")
    assert cpu_halves("split", [0, 1, 2, 3]) == ("2,3", "0,1")
    with pytest.raises(ValueError):
        cpu_halves("split", [0])


async def events():
    for event in (b'data: {"x": 1}\n\n', b"data: [DONE]\n\n"):
        yield event


async def test_the_proxy_relays_prefill_then_decode():
    seen = []

    def upstream(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        seen.append((request.url.port, request.url.path, body))
        if request.url.path == "/health":
            return httpx.Response(200 if request.url.port == 1 else 503)
        if request.url.port == 1:  # prefill
            return httpx.Response(200, json={"kv_transfer_params": {"remote_engine_id": "p"}})
        if body.get("stream"):
            return httpx.Response(200, content=events())
        return httpx.Response(200, json={"choices": [{"text": "ok"}]})

    client = httpx.AsyncClient(transport=httpx.MockTransport(upstream))
    app = make_app("http://p:1", "http://d:2", client)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://proxy") as c:
        r = await c.post("/v1/chat/completions", json=BODY)
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
        (p_port, _, p_body), (d_port, d_path, d_body) = seen[-2:]
        assert (p_port, d_port, d_path) == (1, 2, "/v1/chat/completions")
        assert p_body == prefill_body(BODY)
        assert d_body == {**BODY, "kv_transfer_params": {"remote_engine_id": "p"}}
        r = await c.post("/v1/completions", json={"model": "m", "prompt": "x"})
        assert r.json() == {"choices": [{"text": "ok"}]}
        assert (await c.get("/health")).status_code == 503  # decode is not ready
    await client.aclose()


def test_the_configuration_runs_the_launcher_with_vllms_flags(tmp_path):
    spec = spec_for("vllm-pd", vllm=VllmSpec("/v/bin/python", "bfloat16", 1 << 30))
    argv = spec.vllm.pd_argv(tmp_path, "m", 8123, *spec.extra_args)
    assert argv[0] == "/v/bin/python" and argv[1].endswith("baton/bench/vllm_pd.py")
    assert argv[2:7] == ["--port", "8123", "--pin", "share", "--"]
    assert argv[7:] == spec.vllm.server_args(tmp_path, "m")
    assert spec.vllm.argv(tmp_path, "m", 8123)[3:] == [*argv[7:], "--port", "8123"]
