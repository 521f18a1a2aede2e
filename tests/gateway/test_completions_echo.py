"""/v1/completions `echo: true`, as vLLM answers it: the prompt's text before each choice's
text (a stream: in each choice's first chunk), a token-id prompt echoed as its decoded text,
`max_tokens: 0` returning the prompt alone; echo with logprobs puts the prompt's logprobs
first (its first token's null), and vLLM's `prompt_logprobs` field on both endpoints."""
from __future__ import annotations

import openai
import pytest

from gateway.ignored_fields import HEADER
from tests.gateway.conftest import MODEL
from tests.gateway.test_http_api import post, sse_data

GENERATED = "Hello world!"  # what the fake decode worker answers


async def test_echo_puts_the_prompt_before_every_choice(gateway, fake):
    r = await post(gateway, "/v1/completions", {"model": MODEL, "prompt": "The cat",
                                                "echo": True, "n": 2})
    assert r.status_code == 200, r.text
    assert [c["text"] for c in r.json()["choices"]] == ["The cat" + GENERATED] * 2
    assert HEADER not in r.headers  # it was named as an ignored field
    r = await post(gateway, "/v1/completions", {"model": MODEL, "prompt": "The cat"})
    assert r.json()["choices"][0]["text"] == GENERATED


async def test_token_and_listed_prompts_echo_their_own_text(gateway, fake):
    ids = gateway.prompts.text_token_ids("A dog")
    text = gateway.prompts.detokenize(ids)  # BOS included, as vLLM decodes a token prompt
    r = await post(gateway, "/v1/completions", {"model": MODEL, "prompt": ids, "echo": True})
    assert r.json()["choices"][0]["text"] == text + GENERATED
    assert list(fake.servicer.requests[-1].prompt_token_ids) == ids
    for prompts, texts in ((["One", "Two"], ["One", "Two"]),
                           ([[5, 6], [7]], [gateway.prompts.detokenize(p) for p in ([5, 6], [7])])):
        r = await post(gateway, "/v1/completions", {"model": MODEL, "prompt": prompts,
                                                    "echo": True, "n": 2})
        assert [c["text"] for c in r.json()["choices"]] == \
            [t + GENERATED for t in texts for _ in range(2)]  # choice index prompt_i * n + j


async def test_streamed_echo_comes_in_each_choices_first_chunk(gateway, fake):
    r = await post(gateway, "/v1/completions", {"model": MODEL, "prompt": "The cat",
                                                "echo": True, "n": 2, "stream": True})
    chunks = [c["choices"][0] for c in sse_data(r.text)]
    for i in (0, 1):
        mine = [c for c in chunks if c["index"] == i]
        assert mine[0]["text"] == "The cat" + "Hello"
        assert "".join(c["text"] for c in mine) == "The cat" + GENERATED


async def test_max_tokens_0_with_echo_returns_the_prompt_alone(gateway, fake):
    """vLLM allows it with echo: one token is generated (max_tokens 1) and dropped."""
    body = {"model": MODEL, "prompt": "The cat", "echo": True, "max_tokens": 0}
    r = await post(gateway, "/v1/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "The cat"
    assert fake.servicer.requests[-1].sampling_params.max_tokens == 1
    r = await post(gateway, "/v1/completions", {**body, "stream": True})
    assert "".join(c["choices"][0]["text"] for c in sse_data(r.text)) == "The cat"
    r = await post(gateway, "/v1/completions", {**body, "echo": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


async def test_echo_with_logprobs_leads_with_the_prompts(gateway, fake):
    """As vLLM: the workers compute the prompt's logprobs (prompt_logprobs = logprobs); the
    choice's logprobs start with the prompt's tokens, the first with nulls, then the output's;
    each top_logprobs entry holds the chosen token and the top k."""
    ids = gateway.prompts.text_token_ids("The cat sat")
    text = gateway.prompts.token_text
    r = await post(gateway, "/v1/completions", {"model": MODEL, "prompt": ids, "echo": True,
                                                "logprobs": 2, "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert fake.servicer.requests[-1].sampling_params.prompt_logprobs == 2
    lp = r.json()["choices"][0]["logprobs"]
    P = len(ids)
    assert lp["tokens"][:P] == [text(t) for t in ids] and len(lp["tokens"]) == P + 3
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:P] == pytest.approx([-p / 10 for p in range(1, P)])
    assert lp["top_logprobs"][1] == pytest.approx({text(ids[1]): -0.1, text(100): 0.0,
                                                   text(101): -0.1})
    assert lp["token_logprobs"][P:] == [-0.5] * 3  # the output's (fake_decode.py)
    assert lp["text_offset"][:2] == [0, len(text(ids[0]))]
    assert "prompt_logprobs" not in r.json()["choices"][0]
    # max_tokens 0: the prompt's alone
    r = await post(gateway, "/v1/completions", {"model": MODEL, "prompt": ids, "echo": True,
                                                "logprobs": 0, "max_tokens": 0})
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == [text(t) for t in ids]
    assert lp["top_logprobs"][1] == pytest.approx({text(ids[1]): -0.1})


async def test_streamed_echo_with_logprobs_sends_the_prompts_first(gateway, fake):
    r = await post(gateway, "/v1/completions", {"model": MODEL, "prompt": "The cat sat",
                                                "echo": True, "logprobs": 1, "n": 2,
                                                "stream": True, "max_tokens": 2})
    P = len(gateway.prompts.text_token_ids("The cat sat"))
    chunks = [c["choices"][0] for c in sse_data(r.text)]
    for i in (0, 1):
        mine = [c for c in chunks if c["index"] == i and c["logprobs"]]
        first = mine[0]["logprobs"]
        assert len(first["tokens"]) == P + 1 and first["token_logprobs"][0] is None
        assert first["text_offset"][0] == 0
        assert sum(len(c["logprobs"]["tokens"]) for c in mine) == P + 2


async def test_prompt_logprobs_field_as_vllm(gateway, fake):
    ids = gateway.prompts.text_token_ids("One two")
    text = gateway.prompts.token_text
    r = await post(gateway, "/v1/completions", {"model": MODEL, "prompt": ids,
                                                "prompt_logprobs": 1, "max_tokens": 2})
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ids)
    assert list(got[1]) == [str(ids[1]), "100"]
    assert got[1][str(ids[1])]["logprob"] == pytest.approx(-0.1)
    assert got[1][str(ids[1])]["decoded_token"] == text(ids[1])
    assert got[1]["100"] == {"logprob": 0.0, "rank": 1, "decoded_token": text(100)}
    assert r.json()["choices"][0]["logprobs"] is None  # no output logprobs asked
    r = await post(gateway, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}],
        "prompt_logprobs": 0, "max_tokens": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["prompt_logprobs"][0] is None
    assert len(body["prompt_logprobs"]) == len(fake.servicer.requests[-1].prompt_token_ids)
    for path, extra in (("/v1/completions", {"prompt": "x"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user",
                                                                "content": "x"}]})):
        sent = len(fake.servicer.requests)
        for bad in ({"prompt_logprobs": 1, "stream": True}, {"prompt_logprobs": -1},
                    {"prompt_logprobs": 21}):
            r = await post(gateway, path, {"model": MODEL, **extra, **bad})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "prompt_logprobs"
        assert len(fake.servicer.requests) == sent


async def test_the_openai_client_streams_an_echo(gateway, fake):
    async with openai.AsyncOpenAI(base_url=gateway.http_url + "/v1", api_key="k",
                                  max_retries=0, timeout=10) as client:
        c = await client.completions.create(model=MODEL, prompt="Hi", echo=True, max_tokens=5)
        assert c.choices[0].text == "Hi" + GENERATED
        stream = await client.completions.create(model=MODEL, prompt="Hi", echo=True,
                                                 stream=True)
        assert "".join([x.choices[0].text async for x in stream]) == "Hi" + GENERATED
        # lm-evaluation-harness's loglikelihood request: echo, logprobs, max_tokens 0 or 1
        c = await client.completions.create(model=MODEL, prompt="Hi there", echo=True,
                                            logprobs=1, max_tokens=0, temperature=0)
        lp = c.choices[0].logprobs
        assert lp.token_logprobs[0] is None and len(lp.tokens) == len(lp.token_logprobs) > 1
        assert all(isinstance(x, float) for x in lp.token_logprobs[1:])
