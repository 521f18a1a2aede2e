"""The API key from the environment: $BATON_API_KEY when --api-key is not given (what
docker-compose.yml and the Kubernetes Secret set). The parsed key guards the HTTP API like
--api-key does, and it never shows in the config's repr (what a log line would print)."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from gateway.config import API_KEY_ENV, parse_args
from tests.gateway.conftest import running_gateway

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
FLAGS = ["--model", "tiny", "--decode", "127.0.0.1:1"]


@pytest.mark.parametrize("argv, env, key", [
    ([], {}, None),
    ([], {API_KEY_ENV: "from-env"}, "from-env"),
    ([], {API_KEY_ENV: "from-secret-file\n"}, "from-secret-file"),  # kubectl --from-file
    ([], {API_KEY_ENV: ""}, None),  # an optional Secret that is absent leaves it unset
    (["--api-key", "flag"], {API_KEY_ENV: "from-env"}, "flag"),  # the flag wins
    (["--api-key", ""], {API_KEY_ENV: "from-env"}, None),  # and can turn it off
])
def test_key_from_flag_or_environment(argv, env, key):
    cfg = parse_args(FLAGS + argv, environ=env)
    assert cfg.api_key == key
    if key:
        assert key not in repr(cfg)


def test_parse_args_reads_the_process_environment(monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "sekret")
    assert parse_args(FLAGS).api_key == "sekret"
    monkeypatch.delenv(API_KEY_ENV)
    assert parse_args(FLAGS).api_key is None


async def test_gateway_refuses_requests_without_the_env_key(prompts, fake):
    parsed = parse_args(["--model", "tiny", "--decode", fake.address],
                        environ={API_KEY_ENV: "env-sekret"})
    async with running_gateway(prompts, [fake], api_key=parsed.api_key) as gw:
        async with httpx.AsyncClient(base_url=gw.http_url) as c:
            # /health needs no key; wait for it so the last request finds the worker healthy
            for _ in range(250):
                if (await c.get("/health")).status_code == 200:
                    break
                await asyncio.sleep(0.02)
            else:
                pytest.fail("the gateway never saw its worker healthy")
            for auth, status in ((None, 401), ("Bearer wrong", 401), ("Bearer env-sekret", 200)):
                r = await c.post("/v1/chat/completions", json=CHAT,
                                 headers={"Authorization": auth} if auth else {})
                assert r.status_code == status, auth
