"""vLLM's stream_options.continuous_usage_stats through the gateway and a fake decode worker:
with include_usage, every chunk carries its choice's usage so far (prompt tokens of the
choice's prompt, the tokens it has streamed); without include_usage it changes nothing."""
from __future__ import annotations

from tests.gateway.conftest import MODEL
from tests.gateway.test_http_api import CHAT, post, sse_data

CONTINUOUS = {"stream": True,
              "stream_options": {"include_usage": True, "continuous_usage_stats": True}}


async def test_chat_chunks_carry_the_usage_so_far(gateway, fake):
    r = await post(gateway, "/v1/chat/completions", {**CHAT, **CONTINUOUS})
    assert r.status_code == 200, r.text
    chunks = sse_data(r.text)
    prompt = len(fake.servicer.requests[-1].prompt_token_ids)
    running = [c["usage"] for c in chunks if c["choices"]]
    assert running[0] == {"prompt_tokens": prompt, "completion_tokens": 0,
                          "total_tokens": prompt}  # the role chunk
    counts = [u["completion_tokens"] for u in running]
    assert counts == sorted(counts) and counts[-1] == 3  # "Hello world!": three tokens
    assert all(u["prompt_tokens"] == prompt and u["total_tokens"] == prompt +
               u["completion_tokens"] for u in running)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3


async def test_completion_chunks_count_each_prompt_and_choice(gateway, fake):
    r = await post(gateway, "/v1/completions", {"model": MODEL, "prompt": [[5, 6], [5, 6, 7]],
                                                "n": 2, **CONTINUOUS})
    chunks = sse_data(r.text)
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        assert c["usage"]["prompt_tokens"] == (2 if choice["index"] < 2 else 3)
    last = {c["choices"][0]["index"]: c["usage"] for c in chunks[:-1]}
    assert [u["completion_tokens"] for u in last.values()] == [3, 3, 3, 3]
    assert chunks[-1]["usage"]["prompt_tokens"] == 2 + 3  # each prompt once, as vLLM sums


async def test_continuous_usage_needs_include_usage(gateway):
    for options in ({"continuous_usage_stats": True},
                    {"include_usage": False, "continuous_usage_stats": True}):
        r = await post(gateway, "/v1/completions", {"model": MODEL, "prompt": "Hi",
                                                    "stream": True, "stream_options": options})
        assert r.status_code == 200, r.text
        assert all("usage" not in c for c in sse_data(r.text))
