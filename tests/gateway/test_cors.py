"""CORS for browser clients, as vLLM serves it (Starlette's CORSMiddleware, vLLM's flags and
defaults): a preflight is answered without the API key, the real request still needs it."""
from __future__ import annotations

import httpx

from baton.cluster.flags import parse_up_args, role_argv
from gateway.config import CorsConfig, parse_args
from tests.gateway.conftest import running_gateway
from tests.gateway.test_http_api import CHAT

ORIGIN = "https://app.example"
PREFLIGHT = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization,content-type"}


async def test_preflight_passes_the_key_check_and_real_requests_still_need_the_key(
        prompts, fake):
    """OPTIONS was a 405 (401 with a key set), so no browser could call the API."""
    async with running_gateway(prompts, [fake], api_key="sekret") as gw:
        async with httpx.AsyncClient(base_url=gw.http_url, timeout=10) as c:
            for path in ("/v1/chat/completions", "/v1/completions", "/v1/messages"):
                r = await c.options(path, headers=PREFLIGHT)
                assert r.status_code == 200, (path, r.status_code, r.text)
                assert r.headers["access-control-allow-origin"] == "*"
                assert "POST" in r.headers["access-control-allow-methods"]
                assert r.headers["access-control-allow-headers"] == "authorization,content-type"
            r = await c.post("/v1/chat/completions", json=CHAT, headers={"Origin": ORIGIN})
            assert r.status_code == 401  # the page can read why: CORS headers on it too
            assert r.headers["access-control-allow-origin"] == "*"
            r = await c.post("/v1/chat/completions", json=CHAT,
                             headers={"Origin": ORIGIN, "Authorization": "Bearer sekret"})
            assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
            assert (await c.options("/v1/chat/completions")).status_code == 401  # no preflight


async def test_only_the_allowed_origins_and_credentials(prompts, fake):
    cors = CorsConfig(allowed_origins=(ORIGIN,), allow_credentials=True)
    async with running_gateway(prompts, [fake], cors=cors) as gw:
        async with httpx.AsyncClient(base_url=gw.http_url, timeout=10) as c:
            r = await c.options("/v1/chat/completions", headers=PREFLIGHT)
            assert r.status_code == 200
            assert r.headers["access-control-allow-origin"] == ORIGIN
            assert r.headers["access-control-allow-credentials"] == "true"
            r = await c.options("/v1/chat/completions",
                                headers={**PREFLIGHT, "Origin": "https://evil.example"})
            assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
            r = await c.post("/v1/chat/completions", json=CHAT,
                             headers={"Origin": "https://evil.example"})
            assert "access-control-allow-origin" not in r.headers


def test_cors_flags_vllms_names_and_forms():
    """Declared once on CorsConfig: the gateway's parser and `baton up` take them; a JSON list
    (vLLM's form) or comma-separated values."""
    base = ["--decode", "127.0.0.1:1"]
    assert parse_args(base, environ={}).cors == CorsConfig()
    assert CorsConfig() == CorsConfig(("*",), ("*",), ("*",), False)
    config = parse_args([*base, "--allowed-origins", f'["{ORIGIN}", "https://b.example"]',
                         "--allowed-methods", "GET,POST", "--allow-credentials"], environ={})
    assert config.cors == CorsConfig((ORIGIN, "https://b.example"), ("GET", "POST"), ("*",),
                                     True)
    up = parse_up_args(["--allowed-origins", f'["{ORIGIN}", "https://b.example"]',
                        "--allow-credentials"])
    argv = role_argv(up, "gateway")
    assert argv == ["--allowed-origins", f"{ORIGIN},https://b.example", "--allow-credentials"]
    assert parse_args([*base, *argv], environ={}).cors == CorsConfig(
        (ORIGIN, "https://b.example"), ("*",), ("*",), True)
    assert role_argv(up, "decode") == []
